// Internal to the CPU library: the work-item kernel, compiled twice (kernel.cpp) -- once for
// AVX2+FMA+F16C, once portable -- into namespaces pa_avx2 and pa_portable; paged_attention_cpu.cpp
// picks one at load time from the CPU's features. Also the cache-row writer both write paths use.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_dtype.h"
#include "paged_attention.h"

namespace pa {

constexpr int kQueryTile = 16;      // query tokens per work item (prefill)
constexpr int kMinSplitKeys = 32;   // never split a key range shorter than this (two blocks of 16)

// A work item covers every head of a sequence's query tile, so each cache block (all KV
// heads of its tokens, contiguous) is streamed once, in order.
struct WorkItem {
    int seq, q_begin, q_end;           // query rows relative to the sequence's first new token
    int k_begin, k_end;                // key positions
    int split, num_splits;
    int64_t partial;                   // offset of this item's partials (split items only)
};

struct Problem {
    const pa_shape* s;
    const void* query;
    const void* kv_cache;  // in s->kv_dtype
    void* out;
    const int32_t* qsl;
    const int32_t* seq_lens;
    const int32_t* block_tables;
    float scale;    // of q.k, times an fp8 cache's K scale
    float v_scale;  // an fp8 cache's V scale (else 1)
    int window;     // > 0: a query at position p sees keys p - window < k <= p only
    float softcap;  // > 0: scores become softcap * tanh(score / softcap)
    int group;
    int row;          // elements of the cache's type in one row (head_size, + 2 for int8's scale)
    int64_t kv_half;  // elements in one of K or V
    // Each row summed in an order set by its sequence and position alone (batch-invariant):
    // no split key ranges, and one way of dotting a block's keys whatever the rows of the item.
    bool fixed_order;
};

// Elements of a cache row of `kv_dtype` for `head_size` values, and the bytes of one element.
inline int row_elements(int kv_dtype, int head_size) {
    return kv_dtype == PA_INT8 ? head_size + pa_kv::kInt8ScaleBytes : head_size;
}
inline int element_bytes(int kv_dtype) {
    return kv_dtype == PA_FLOAT32 ? 4 : (kv_dtype == PA_BFLOAT16 || kv_dtype == PA_FLOAT16) ? 2 : 1;
}

// Stores one row of `n` floats as a cache row of `kv_dtype` at `dst`; fp8 stores x * inv_scale.
inline void store_kv_row(void* dst, const float* src, int n, int kv_dtype, float inv_scale) {
    switch (kv_dtype) {
        case PA_FLOAT32: std::memcpy(dst, src, n * sizeof(float)); return;
        case PA_BFLOAT16: for (int i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = pa_kv::float_to_bf16(src[i]); return;
        case PA_FLOAT16: for (int i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = pa_kv::float_to_half(src[i]); return;
        case PA_FP8_E4M3: for (int i = 0; i < n; ++i) static_cast<uint8_t*>(dst)[i] = pa_kv::float_to_e4m3(src[i] * inv_scale); return;
        case PA_FP8_E5M2: for (int i = 0; i < n; ++i) static_cast<uint8_t*>(dst)[i] = pa_kv::float_to_e5m2(src[i] * inv_scale); return;
        default: {
            float amax = 0.f;
            for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(src[i]));
            const float scale = pa_kv::int8_scale(amax);
            int8_t* q = static_cast<int8_t*>(dst);
            for (int i = 0; i < n; ++i) q[i] = pa_kv::int8_value(src[i], scale);
            const uint16_t h = pa_kv::float_to_half(scale);
            std::memcpy(q + n, &h, sizeof h);
        }
    }
}

constexpr int kRowsPerPass = 4;  // query rows sharing one pass over a block's keys (prefill)
constexpr int kMinRowsTogether = 3;  // rows of an item from which its blocks' keys are transposed

// Keys of a block rounded up to whole 16-key chunks (the transposed-K layout's row length).
inline int padded_keys(int block_size) { return (block_size + 15) / 16 * 16; }

// Per-thread scratch: the running softmax state of every (query, head) row of an item; for
// prefill, one KV head's keys of a block transposed (head_size x padded keys, in float) and
// the scores of a pass.
struct Scratch {
    std::vector<float> q, acc, m, l, scores, kt;
    void reserve(int rows, int head_size, int block_size) {
        q.resize(static_cast<size_t>(rows) * head_size);
        acc.resize(static_cast<size_t>(rows) * head_size);
        m.resize(rows);
        l.resize(rows);
        scores.resize(static_cast<size_t>(kRowsPerPass) * padded_keys(block_size));
        kt.resize(static_cast<size_t>(head_size) * padded_keys(block_size));
    }
};

struct Kernels {
    void (*run_item)(const Problem&, const WorkItem&, Scratch&, float* partials);
    void (*merge_splits)(const Problem&, const WorkItem* items, float* partials);
    const char* name;
};

constexpr int kMaxHeadSize = 512;

// Stores `message` for pa_cpu_last_error() (thread-local); returns 1, the failing return code.
int report_error(const char* message);

namespace pa_avx2 { Kernels kernels(); }
namespace pa_portable { Kernels kernels(); }

}  // namespace pa
