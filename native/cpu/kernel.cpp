// The work-item kernel of the CPU library; see paged_attention_cpu.cpp for the design.
// Compiled twice: with -mavx2 -mfma -DPA_NS=pa_avx2, and plain with -DPA_NS=pa_portable.
// The loops are written for the vectorizer (omp simd); exp has an AVX2 version.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef PA_NS
#error "compile with -DPA_NS=pa_avx2 or -DPA_NS=pa_portable"
#endif

namespace pa {
namespace PA_NS {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float dot(const float* __restrict a, const float* __restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale(float* __restrict y, float a, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] *= a;
}

// x[i] = exp(x[i]) for x[i] <= 0 (softmax numerators); -inf gives 0.
inline void exp_nonpositive(float* x, int n) {
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2_hi = _mm256_set1_ps(0.693359375f),
                 ln2_lo = _mm256_set1_ps(-2.12194440e-4f), lowest = _mm256_set1_ps(-87.3f);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + i), lowest);
        __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 f = _mm256_fnmadd_ps(k, ln2_hi, v);
        f = _mm256_fnmadd_ps(k, ln2_lo, f);  // f in [-ln2/2, ln2/2]
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
        __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
        // inputs below the clamp (or -inf) underflow to 0
        r = _mm256_and_ps(r, _mm256_cmp_ps(_mm256_loadu_ps(x + i), lowest, _CMP_GE_OQ));
        _mm256_storeu_ps(x + i, r);
    }
#endif
    for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// out[j] = dot(q, k + j * stride) for j < n. With AVX2: eight keys at a time, one FMA
// accumulator per key, reduced by a transpose-and-add tree instead of eight horizontal sums.
inline void dots(const float* q, const float* k, int64_t stride, int n, int D, float* out) {
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (; j + 8 <= n; j += 8) {
            __m256 acc[8];
            for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + t) * stride + d), acc[t]);
            }
            const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
            _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)));
        }
    }
#endif
    for (; j < n; ++j) out[j] = dot(q, k + j * stride, D);
}

// acc += sum_j w[j] * (v + j * stride) for j < n. With AVX2 the accumulator stays in
// registers, 64 dimensions at a time, across all n rows.
inline void weighted_sum(float* acc, const float* w, const float* v, int64_t stride, int n, int D) {
    int d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 64 <= D; d += 64) {
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_ps(acc + d + 8 * c);
        for (int j = 0; j < n; ++j) {
            const __m256 wj = _mm256_set1_ps(w[j]);
            const float* row = v + j * stride + d;
            for (int c = 0; c < 8; ++c) r[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(row + 8 * c), r[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d + 8 * c, r[c]);
    }
#endif
    if (d < D)
        for (int j = 0; j < n; ++j) axpy(acc + d, w[j], v + j * stride + d, D - d);
}

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

inline void load_bf16(float* __restrict dst, const uint16_t* __restrict src, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

void load_row(float* dst, const void* base, int64_t offset, int n, int dtype) {
    if (dtype == PA_FLOAT32) std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
    else load_bf16(dst, static_cast<const uint16_t*>(base) + offset, n);
}

void store_row(void* base, int64_t offset, const float* src, int n, int dtype) {
    if (dtype == PA_FLOAT32) {
        std::memcpy(static_cast<float*>(base) + offset, src, n * sizeof(float));
    } else {
        uint16_t* dst = static_cast<uint16_t*>(base) + offset;
        for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
    }
}

int64_t out_offset(const Problem& p, const WorkItem& w, int qi, int head) {
    const int64_t token = p.qsl[w.seq] + qi;
    return (token * p.s->num_heads + head) * p.s->head_size;
}

// One cache block's contribution to every row (query, head) of the item: scores, one rescale
// of each row's running sums, then the weighted V accumulation (the flash-attention
// recurrence). k and v point at the block's first token, KV head 0; rows are `stride` apart.
void attend_block(const Problem& p, const WorkItem& w, Scratch& sc, const float* k, const float* v, int64_t stride,
                  int k0, int count, int ctx) {
    const int D = p.s->head_size, H = p.s->num_heads, G = p.group;
    float* scores = sc.scores.data();
    for (int qi = w.q_begin; qi < w.q_end; ++qi) {
        const int visible = std::min(count, ctx + qi + 1 - k0);  // causal limit within this block
        if (visible <= 0) continue;
        for (int head = 0; head < H; ++head) {
            const int r = (qi - w.q_begin) * H + head;
            const float* q = &sc.q[static_cast<size_t>(r) * D];
            const float* kh = k + (head / G) * D;
            const float* vh = v + (head / G) * D;
            dots(q, kh, stride, visible, D, scores);
            float block_max = kNegInf;
            for (int j = 0; j < visible; ++j) {
                scores[j] *= p.scale;
                block_max = std::max(block_max, scores[j]);
            }
            const float m_new = std::max(sc.m[r], block_max);
            for (int j = 0; j < visible; ++j) scores[j] -= m_new;
            exp_nonpositive(scores, visible);
            float* acc = &sc.acc[static_cast<size_t>(r) * D];
            const float correction = sc.m[r] == kNegInf ? 0.f : std::exp(sc.m[r] - m_new);
            if (correction != 1.f) scale(acc, correction, D);
            float sum = 0.f;
            for (int j = 0; j < visible; ++j) sum += scores[j];
            weighted_sum(acc, scores, vh, stride, visible, D);
            sc.l[r] = sc.l[r] * correction + sum;
            sc.m[r] = m_new;
        }
    }
}

// The next block sits anywhere in the cache, where no hardware prefetcher looks: ask for it
// while this one is computed.
inline void prefetch_block(const Problem& p, int64_t offset, size_t bytes) {
    const size_t elem = p.s->dtype == PA_FLOAT32 ? 4 : 2;
    const char* k = static_cast<const char*>(p.kv_cache) + offset * elem;
    const char* v = k + p.kv_half * elem;
    for (size_t i = 0; i < bytes; i += 64) {
        __builtin_prefetch(k + i);
        __builtin_prefetch(v + i);
    }
}

void run_item(const Problem& p, const WorkItem& w, Scratch& sc, float* partials) {
    const pa_shape& s = *p.s;
    const int D = s.head_size, BS = s.block_size, H = s.num_heads;
    const int q_len = p.qsl[w.seq + 1] - p.qsl[w.seq];
    const int ctx = p.seq_lens[w.seq] - q_len;  // tokens cached before the first new one
    const int rows = (w.q_end - w.q_begin) * H;
    for (int qi = w.q_begin; qi < w.q_end; ++qi)  // a token's heads are contiguous: one row of H * D
        load_row(&sc.q[static_cast<size_t>(qi - w.q_begin) * H * D], p.query, out_offset(p, w, qi, 0), H * D, s.dtype);
    std::fill(sc.acc.begin(), sc.acc.begin() + static_cast<size_t>(rows) * D, 0.f);
    std::fill(sc.m.begin(), sc.m.begin() + rows, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);
    const int k_end = std::min(w.k_end, ctx + w.q_end);  // the tile's last query sees keys < ctx + q_end
    const int32_t* table = p.block_tables + static_cast<int64_t>(w.seq) * s.max_blocks_per_seq;
    const int64_t row = static_cast<int64_t>(s.num_kv_heads) * D;  // one token's K (or V), all KV heads
    const size_t elem = s.dtype == PA_FLOAT32 ? 4 : 2;
    for (int k0 = w.k_begin; k0 < k_end;) {
        const int first = k0 % BS;
        const int count = std::min(BS - first, k_end - k0);
        const int64_t base = (static_cast<int64_t>(table[k0 / BS]) * BS + first) * row;
        if (k0 + count < k_end) prefetch_block(p, table[(k0 + count) / BS] * static_cast<int64_t>(BS) * row,
                                               BS * row * elem);
        if (s.dtype == PA_FLOAT32) {  // fp32 rows are read in place
            const float* cache = static_cast<const float*>(p.kv_cache);
            attend_block(p, w, sc, cache + base, cache + p.kv_half + base, row, k0, count, ctx);
        } else {  // bf16: the block's rows (all KV heads, contiguous) converted once
            load_row(sc.k.data(), p.kv_cache, base, static_cast<int>(count * row), s.dtype);
            load_row(sc.v.data(), p.kv_cache, p.kv_half + base, static_cast<int>(count * row), s.dtype);
            attend_block(p, w, sc, sc.k.data(), sc.v.data(), row, k0, count, ctx);
        }
        k0 += count;
    }
    for (int qi = w.q_begin; qi < w.q_end; ++qi) {
        for (int head = 0; head < H; ++head) {
            const int r = (qi - w.q_begin) * H + head;
            float* acc = &sc.acc[static_cast<size_t>(r) * D];
            if (w.num_splits > 1) {  // keep (m, l, acc) for the merge
                float* dst = partials + w.partial + static_cast<int64_t>(r) * (D + 2);
                dst[0] = sc.m[r];
                dst[1] = sc.l[r];
                std::memcpy(dst + 2, acc, D * sizeof(float));
            } else {
                if (sc.l[r] > 0.f) scale(acc, 1.f / sc.l[r], D);
                store_row(p.out, out_offset(p, w, qi, head), acc, D, s.dtype);
            }
        }
    }
}

// Combine the partials of the splits items[0 .. num_splits) of one tile with log-sum-exp.
void merge_splits(const Problem& p, const WorkItem* items, float* partials) {
    const WorkItem& w0 = items[0];
    const int D = p.s->head_size, H = p.s->num_heads;
    std::vector<float> out(D);
    for (int qi = w0.q_begin; qi < w0.q_end; ++qi) {
        for (int head = 0; head < H; ++head) {
            const int64_t r = (qi - w0.q_begin) * H + head;
            float m = kNegInf;
            for (int i = 0; i < w0.num_splits; ++i) m = std::max(m, partials[items[i].partial + r * (D + 2)]);
            std::fill(out.begin(), out.end(), 0.f);
            float l = 0.f;
            for (int i = 0; i < w0.num_splits; ++i) {
                const float* part = partials + items[i].partial + r * (D + 2);
                if (part[1] == 0.f) continue;
                const float weight = std::exp(part[0] - m);
                l += part[1] * weight;
                axpy(out.data(), weight, part + 2, D);
            }
            if (l > 0.f) scale(out.data(), 1.f / l, D);
            store_row(p.out, out_offset(p, w0, qi, head), out.data(), D, p.s->dtype);
        }
    }
}

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
Kernels kernels() { return {run_item, merge_splits, "avx2+fma"}; }
#else
Kernels kernels() { return {run_item, merge_splits, "portable"}; }
#endif

}  // namespace PA_NS
}  // namespace pa
