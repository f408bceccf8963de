// Internal to the CPU library: the work-item kernel, compiled twice (kernel.cpp) -- once for
// AVX2+FMA, once portable -- into namespaces pa_avx2 and pa_portable; paged_attention_cpu.cpp
// picks one at load time from the CPU's features.
#pragma once

#include <cstdint>
#include <vector>

#include "paged_attention.h"

namespace pa {

constexpr int kQueryTile = 16;      // query tokens per work item (prefill)
constexpr int kMinSplitKeys = 256;  // never split a key range shorter than this

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
    const void* kv_cache;
    void* out;
    const int32_t* qsl;
    const int32_t* seq_lens;
    const int32_t* block_tables;
    float scale;
    int window;     // > 0: a query at position p sees keys p - window < k <= p only
    float softcap;  // > 0: scores become softcap * tanh(score / softcap)
    int group;
    int64_t kv_half;  // elements in one of K or V
};

constexpr int kRowsPerPass = 4;  // query rows sharing one pass over a block's keys (prefill)

// Keys of a block rounded up to whole 16-key chunks (the transposed-K layout's row length).
inline int padded_keys(int block_size) { return (block_size + 15) / 16 * 16; }

// Per-thread scratch: the running softmax state of every (query, head) row of an item; for
// bf16, one block of K and V converted to fp32; for prefill, one KV head's keys of a block
// transposed (head_size x padded keys) and the scores of a pass.
struct Scratch {
    std::vector<float> q, acc, m, l, k, v, scores, kt;
    void reserve(int rows, int head_size, int block_size, int64_t kv_row) {
        q.resize(static_cast<size_t>(rows) * head_size);
        acc.resize(static_cast<size_t>(rows) * head_size);
        m.resize(rows);
        l.resize(rows);
        k.resize(static_cast<size_t>(block_size) * kv_row);
        v.resize(static_cast<size_t>(block_size) * kv_row);
        scores.resize(static_cast<size_t>(kRowsPerPass) * padded_keys(block_size));
        kt.resize(static_cast<size_t>(head_size) * padded_keys(block_size));
    }
};

struct Kernels {
    void (*run_item)(const Problem&, const WorkItem&, Scratch&, float* partials);
    void (*merge_splits)(const Problem&, const WorkItem* items, float* partials);
    const char* name;
};

// Stores `message` for pa_cpu_last_error() (thread-local); returns 1, the failing return code.
int report_error(const char* message);

namespace pa_avx2 { Kernels kernels(); }
namespace pa_portable { Kernels kernels(); }

}  // namespace pa
