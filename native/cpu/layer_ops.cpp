// The small per-layer ops around attention, fused (float32): a decode step at batch 1 makes
// ~60 RMSNorm calls and 30 rotary + KV writes, and in torch each is 6-10 dispatches of a few
// microseconds on vectors of a few hundred floats. Here each is one call.
//
// Built with -ffp-contract=off: every product and sum is rounded as torch rounds it, so the
// rotary embedding is bit-equal to torch's; the RMSNorm differs from torch only in the order
// of its sum of squares. One build serves every CPU (the loops are short; omp simd lets the
// compiler use what the baseline ISA has).

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernel.h"

namespace {

// Rows of work one thread should have before a second joins (below that, waking a sleeping
// OpenMP worker costs more than the work).
constexpr int64_t kMinFloatsPerThread = 1 << 16;

int threads_for(int64_t floats) {
    const int64_t wanted = floats / kMinFloatsPerThread;
    return static_cast<int>(wanted < 1 ? 1 : wanted < omp_get_max_threads() ? wanted : omp_get_max_threads());
}

void rms_norm_row(float* out, float* residual, const float* x, const float* weight, int64_t hidden, float eps) {
    const float* r = x;
    if (residual != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) residual[i] += x[i];
        r = residual;
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < hidden; ++i) ss += r[i] * r[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) out[i] = weight[i] * (r[i] * inv);
}

// Rotates one head's first 2 * half values (non-interleaved halves, as transformers' Llama):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin; the rest of the head (a partial rotary) is copied.
void rotate(float* __restrict dst, const float* __restrict src, const float* __restrict cos,
            const float* __restrict sin, int half, int head_size) {
#pragma omp simd
    for (int i = 0; i < half; ++i) {
        const float x1 = src[i], x2 = src[i + half];
        dst[i] = x1 * cos[i] - x2 * sin[i];
        dst[i + half] = x2 * cos[i] + x1 * sin[i];
    }
    if (2 * half < head_size) std::memcpy(dst + 2 * half, src + 2 * half, (head_size - 2 * half) * sizeof(float));
}

}  // namespace

extern "C" {

int pa_cpu_rms_norm(float* out, float* residual, const float* x, const float* weight, int64_t rows, int64_t hidden,
                    float eps) {
    if (rows < 0 || hidden <= 0) return pa::report_error("rms_norm needs rows >= 0 and hidden > 0");
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * hidden)) if (rows * hidden >= 2 * kMinFloatsPerThread)
    for (int64_t t = 0; t < rows; ++t)
        rms_norm_row(out + t * hidden, residual == nullptr ? nullptr : residual + t * hidden, x + t * hidden, weight,
                     hidden, eps);
    return 0;
}

int pa_cpu_rope_write_kv(const pa_shape* s, const float* qkv, const int64_t* positions, const float* cos,
                         const float* sin, int64_t max_positions, int32_t rotary_dim, float* q_out, void* kv_cache,
                         const int64_t* slot_mapping, const float* kv_scales) {
    if (s->dtype != PA_FLOAT32 || rotary_dim % 2 != 0 || rotary_dim <= 0 || rotary_dim > s->head_size)
        return pa::report_error("rope_write_kv supports float32 and an even rotary_dim <= head_size only");
    const int D = s->head_size, half = rotary_dim / 2, H = s->num_heads, KV = s->num_kv_heads;
    if (D > pa::kMaxHeadSize) return pa::report_error("head_size above 512 is not supported");
    const int64_t qkv_row = static_cast<int64_t>(H + 2 * KV) * D, kv_row = static_cast<int64_t>(KV) * D;
    const int64_t num_slots = static_cast<int64_t>(s->num_blocks) * s->block_size;
    const int kv_dtype = s->kv_dtype;
    const int64_t row_bytes = static_cast<int64_t>(pa::row_elements(kv_dtype, D)) * pa::element_bytes(kv_dtype);
    char* k_cache = static_cast<char*>(kv_cache);
    char* v_cache = k_cache + num_slots * KV * row_bytes;
    const float inv_k = kv_scales != nullptr ? 1.f / kv_scales[0] : 1.f;
    const float inv_v = kv_scales != nullptr ? 1.f / kv_scales[1] : 1.f;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) num_threads(threads_for(s->num_tokens * qkv_row)) \
    if (s->num_tokens * qkv_row >= 2 * kMinFloatsPerThread)
    for (int t = 0; t < s->num_tokens; ++t) {
        const int64_t pos = positions[t], slot = slot_mapping[t];
        if (pos < 0 || pos >= max_positions || slot >= num_slots) {
            bad = 1;
            continue;
        }
        const float* c = cos + pos * half;
        const float* sn = sin + pos * half;
        const float* row = qkv + t * qkv_row;
        for (int h = 0; h < H; ++h) rotate(q_out + (t * H + h) * static_cast<int64_t>(D), row + h * D, c, sn, half, D);
        if (slot < 0) continue;  // a padding token: its query is computed, its K/V not stored
        if (kv_dtype == PA_FLOAT32) {  // rotated straight into the cache
            float* k_row = reinterpret_cast<float*>(k_cache + slot * KV * row_bytes);
            for (int h = 0; h < KV; ++h) rotate(k_row + h * D, row + (H + h) * D, c, sn, half, D);
            std::memcpy(v_cache + slot * KV * row_bytes, row + (H + KV) * static_cast<int64_t>(D), kv_row * sizeof(float));
            continue;
        }
        float rotated[pa::kMaxHeadSize];
        for (int h = 0; h < KV; ++h) {
            rotate(rotated, row + (H + h) * D, c, sn, half, D);
            pa::store_kv_row(k_cache + (slot * KV + h) * row_bytes, rotated, D, kv_dtype, inv_k);
            pa::store_kv_row(v_cache + (slot * KV + h) * row_bytes, row + (H + KV + h) * static_cast<int64_t>(D), D,
                             kv_dtype, inv_v);
        }
    }
    return bad ? pa::report_error("a position is outside the rotary table or a slot outside the cache") : 0;
}

}  // extern "C"
