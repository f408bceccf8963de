// The work-item kernel of the CPU library; see paged_attention_cpu.cpp for the design.
// Compiled twice: with -mavx2 -mfma -mf16c -DPA_NS=pa_avx2, and plain with -DPA_NS=pa_portable.
// The loops are written for the vectorizer (omp simd); exp has an AVX2 version. Whatever the
// cache's element type (kv_dtype.h), its rows are converted to float in registers as they are
// read (eight at a time with AVX2+F16C), never copied out in float first.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernel.h"
#include "kv_dtype.h"

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

inline void axpy(float* __restrict y, float a, const float* __restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale(float* __restrict y, float a, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] *= a;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp of eight values <= 0 (softmax numerators); below -87.3, and -inf, give 0.
inline __m256 exp256_nonpositive(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2_hi = _mm256_set1_ps(0.693359375f),
                 ln2_lo = _mm256_set1_ps(-2.12194440e-4f), lowest = _mm256_set1_ps(-87.3f);
    const __m256 v = _mm256_max_ps(x, lowest);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(k, ln2_hi, v);
    f = _mm256_fnmadd_ps(k, ln2_lo, f);  // f in [-ln2/2, ln2/2]
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
    return _mm256_and_ps(r, _mm256_cmp_ps(x, lowest, _CMP_GE_OQ));
}

inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// The cache's element types as this kernel reads them: get() one value, load8() eight (AVX2).
// An int8 row's values are multiplied by its scale (row_scale) where the row is used.
struct F32 {
    using T = float;
    static float get(const T* p) { return *p; }
};
struct BF16 {
    using T = uint16_t;
    static float get(const T* p) { return pa_kv::bf16_to_float(*p); }
};
struct F16 {
    using T = uint16_t;
    static float get(const T* p) { return pa_kv::half_to_float(*p); }
};
struct E4M3 {  // (1/256 of the value: the kernel's K and V scales carry the 256, see Problem)
    using T = uint8_t;
    static float get(const T* p) { return pa_kv::e4m3_to_float_over_256(*p); }
};
struct E5M2 {
    using T = uint8_t;
    static float get(const T* p) { return pa_kv::e5m2_to_float(*p); }
};
struct I8 {
    using T = int8_t;
    static float get(const T* p) { return static_cast<float>(*p); }
};

template <class E> inline float row_scale(const typename E::T*, int) { return 1.f; }
template <> inline float row_scale<I8>(const int8_t* row, int D) {
    uint16_t h;
    std::memcpy(&h, row + D, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return pa_kv::half_to_float(h);
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
template <class E> inline __m256 load8(const typename E::T* p);
template <> inline __m256 load8<F32>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<BF16>(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
template <> inline __m256 load8<F16>(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <> inline __m256 load8<E5M2>(const uint8_t* p) {  // the high byte of a float16
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
}
template <> inline __m256 load8<E4M3>(const uint8_t* p) {  // a float16 of 1/256 the value (kv_dtype.h)
    const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
    const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7f)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, magnitude));
}
template <> inline __m256 load8<I8>(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

template <class E>
inline float dot_row(const float* __restrict a, const typename E::T* __restrict b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; ++i) s += a[i] * E::get(b + i);
    return s;
}

template <class E>
inline void axpy_row(float* __restrict y, float a, const typename E::T* __restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) y[i] += a * E::get(x + i);
}

// x[i] = exp(x[i]) for x[i] <= 0 (softmax numerators); -inf gives 0.
inline void exp_nonpositive(float* x, int n) {
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256_nonpositive(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// out[j] = dot(q, k + j * stride) for j < n. With AVX2: eight keys at a time, one FMA
// accumulator per key, reduced by a transpose-and-add tree instead of eight horizontal sums.
template <class E>
inline void dots(const float* q, const typename E::T* k, int64_t stride, int n, int D, float* out) {
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (; j + 8 <= n; j += 8) {
            __m256 acc[8];
            for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, load8<E>(k + (j + t) * stride + d), acc[t]);
            }
            const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
            _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)));
        }
    }
#endif
    for (; j < n; ++j) out[j] = dot_row<E>(q, k + j * stride, D);
    if (std::is_same<E, I8>::value)
        for (j = 0; j < n; ++j) out[j] *= row_scale<E>(k + j * stride, D);
}

// acc += sum_j w[j] * (v + j * stride) for j < n. With AVX2 the accumulator stays in
// registers, 64 dimensions at a time, across all n rows.
template <class E>
inline void weighted_sum(float* acc, const float* w, const typename E::T* v, int64_t stride, int n, int D) {
    int d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 64 <= D; d += 64) {
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_ps(acc + d + 8 * c);
        for (int j = 0; j < n; ++j) {
            const __m256 wj = _mm256_set1_ps(w[j] * row_scale<E>(v + j * stride, D));
            const typename E::T* row = v + j * stride + d;
            for (int c = 0; c < 8; ++c) r[c] = _mm256_fmadd_ps(wj, load8<E>(row + 8 * c), r[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d + 8 * c, r[c]);
    }
#endif
    if (d < D)
        for (int j = 0; j < n; ++j) axpy_row<E>(acc + d, w[j] * row_scale<E>(v + j * stride, D), v + j * stride + d, D - d);
}

inline void load_bf16(float* __restrict dst, const uint16_t* __restrict src, int n) {
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = pa_kv::bf16_to_float(src[i]);
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
        for (int i = 0; i < n; ++i) dst[i] = pa_kv::float_to_bf16(src[i]);
    }
}

int64_t out_offset(const Problem& p, const WorkItem& w, int qi, int head) {
    const int64_t token = p.qsl[w.seq] + qi;
    return (token * p.s->num_heads + head) * p.s->head_size;
}

// The online-softmax step of one row over `n` raw scores (q.k, times `scale` here): returns
// the factor the row's accumulator must be multiplied by before this block's weighted V is
// added, and leaves exp(score - new max) in `scores`.
// scores[j] = softcap * tanh(scores[j] / softcap), the order transformers computes it in.
inline void cap(float* scores, int n, float softcap) {
    for (int j = 0; j < n; ++j) scores[j] = std::tanh(scores[j] / softcap) * softcap;
}

inline float softmax_step(float* scores, int n, float scale, float softcap, float& m, float& l) {
    for (int j = 0; j < n; ++j) scores[j] *= scale;
    if (softcap > 0.f) cap(scores, n, softcap);
    float block_max = kNegInf;
    for (int j = 0; j < n; ++j) block_max = std::max(block_max, scores[j]);
    const float m_new = std::max(m, block_max);
    for (int j = 0; j < n; ++j) scores[j] -= m_new;
    exp_nonpositive(scores, n);
    float sum = 0.f;
    for (int j = 0; j < n; ++j) sum += scores[j];
    const float correction = m == kNegInf ? 0.f : std::exp(m - m_new);
    l = l * correction + sum;
    m = m_new;
    return correction;
}

#if defined(__AVX2__) && defined(__FMA__)
// The online-softmax step of R rows (scratch rows rows[i]) over their scores s[i][0, padded), eight
// at a time: the scores already scaled (and capped), lanes that are no key of theirs at -inf.
// Leaves exp(score - new max) in s, takes each row's sum and max in, and writes into correction
// (eight floats, 32-byte aligned) the factor each row's accumulator must be multiplied by before
// this block's weighted V is added (0 for a row with no keys yet).
template <int R>
inline void softmax_rows(Scratch& sc, float* const* s, const int* rows, int padded, float* correction) {
    alignas(32) float m_old[8] = {}, m_new[8] = {};
    float sums[R];
    for (int i = 0; i < R; ++i) {
        __m256 mx = _mm256_set1_ps(kNegInf);
        for (int j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s[i] + j));
        m_old[i] = sc.m[rows[i]];
        m_new[i] = std::max(m_old[i], hmax256(mx));
        const __m256 mn = _mm256_set1_ps(m_new[i]);
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < padded; j += 8) {
            const __m256 e = exp256_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s[i] + j), mn));
            _mm256_storeu_ps(s[i] + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        sums[i] = hsum256(sum);
    }
    _mm256_store_ps(correction, exp256_nonpositive(_mm256_sub_ps(_mm256_load_ps(m_old), _mm256_load_ps(m_new))));
    for (int i = 0; i < R; ++i) {
        sc.l[rows[i]] = sc.l[rows[i]] * correction[i] + sums[i];
        sc.m[rows[i]] = m_new[i];
    }
}
#endif

// One row at a time: scores, one rescale of the row's running sums, then the weighted V
// accumulation (the flash-attention recurrence). The rows see the block's keys [first, visible).
template <class E>
void attend_rows_one_by_one(const Problem& p, Scratch& sc, const typename E::T* kh, const typename E::T* vh,
                            int64_t stride, const int* rows, int num_rows, int first, int visible) {
    const int D = p.s->head_size, n = visible - first;
    kh += first * stride;
    vh += first * stride;
    float* scores = sc.scores.data();
    for (int i = 0; i < num_rows; ++i) {
        const int r = rows[i];
        dots<E>(&sc.q[static_cast<size_t>(r) * D], kh, stride, n, D, scores);
        float* acc = &sc.acc[static_cast<size_t>(r) * D];
        const float correction = softmax_step(scores, n, p.scale, p.softcap, sc.m[r], sc.l[r]);
        if (correction != 1.f) scale(acc, correction, D);
        weighted_sum<E>(acc, scores, vh, stride, n, D);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// R rows (R <= kRowsPerPass) that see the same keys [first, visible) of a block, against one
// KV head's keys transposed into `kt` (D x kp, zero past the block's keys): every K and V
// vector loaded serves all R rows, and the scores come out one key per lane, with no
// horizontal sums. For prefill, where a work item holds many rows per KV head.
template <class E, int R>
void attend_rows_together(const Problem& p, Scratch& sc, const float* kt, int kp, const typename E::T* vh,
                          int64_t stride, const int* rows, int first, int visible) {
    const int D = p.s->head_size;
    const float* q[R];
    float* acc[R];
    float* scores[R];
    for (int i = 0; i < R; ++i) {
        q[i] = &sc.q[static_cast<size_t>(rows[i]) * D];
        acc[i] = &sc.acc[static_cast<size_t>(rows[i]) * D];
        scores[i] = &sc.scores[static_cast<size_t>(i) * kp];
    }
    const __m256 scale_v = _mm256_set1_ps(p.scale);
    for (int j0 = 0; j0 < visible; j0 += 16) {  // scores, 16 keys at a time
        __m256 s[R][2];
        for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
        for (int d = 0; d < D; ++d) {
            const __m256 k0 = _mm256_loadu_ps(kt + static_cast<size_t>(d) * kp + j0);
            const __m256 k1 = _mm256_loadu_ps(kt + static_cast<size_t>(d) * kp + j0 + 8);
            for (int i = 0; i < R; ++i) {
                const __m256 qd = _mm256_broadcast_ss(q[i] + d);
                s[i][0] = _mm256_fmadd_ps(qd, k0, s[i][0]);
                s[i][1] = _mm256_fmadd_ps(qd, k1, s[i][1]);
            }
        }
        for (int i = 0; i < R; ++i) {
            _mm256_storeu_ps(scores[i] + j0, _mm256_mul_ps(s[i][0], scale_v));
            _mm256_storeu_ps(scores[i] + j0 + 8, _mm256_mul_ps(s[i][1], scale_v));
        }
    }
    if (p.softcap > 0.f)
        for (int i = 0; i < R; ++i) cap(scores[i] + first, visible - first, p.softcap);
    // Keys outside [first, visible) count as -inf in the online softmax.
    const int padded = (visible + 15) / 16 * 16;
    const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), limit = _mm256_set1_ps(static_cast<float>(visible));
    const __m256 lower = _mm256_set1_ps(static_cast<float>(first));
    const __m256 neg_inf = _mm256_set1_ps(kNegInf);
    for (int i = 0; i < R; ++i) {
        for (int j = 0; j < padded; j += 8) {
            const __m256 key = _mm256_add_ps(iota, _mm256_set1_ps(static_cast<float>(j)));
            const __m256 inside = _mm256_and_ps(_mm256_cmp_ps(key, limit, _CMP_LT_OQ), _mm256_cmp_ps(key, lower, _CMP_GE_OQ));
            _mm256_storeu_ps(scores[i] + j, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(scores[i] + j), inside));
        }
    }
    alignas(32) float correction[8];
    softmax_rows<R>(sc, scores, rows, padded, correction);
    for (int d = 0; d < D; d += 16) {  // weighted V, 16 dimensions of every row at a time
        __m256 a[R][2];
        for (int i = 0; i < R; ++i) {  // each row's running sum, rescaled to the new max
            const __m256 c = _mm256_set1_ps(correction[i]);
            a[i][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d), c);
            a[i][1] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d + 8), c);
        }
        for (int j = first; j < visible; ++j) {
            const __m256 v0 = load8<E>(vh + j * stride + d);
            const __m256 v1 = load8<E>(vh + j * stride + d + 8);
            const float rs = row_scale<E>(vh + j * stride, D);
            for (int i = 0; i < R; ++i) {
                const __m256 w = _mm256_set1_ps(scores[i][j] * rs);
                a[i][0] = _mm256_fmadd_ps(w, v0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(w, v1, a[i][1]);
            }
        }
        for (int i = 0; i < R; ++i) {
            _mm256_storeu_ps(acc[i] + d, a[i][0]);
            _mm256_storeu_ps(acc[i] + d + 8, a[i][1]);
        }
    }
}

// kt[d * kp + j] = k[j * stride + d] for j < count, 0 for count <= j < kp: 8 x 8 tiles
// transposed in registers.
template <class E>
void transpose_keys(const typename E::T* k, int64_t stride, int count, int D, int kp, float* kt) {
    for (int j0 = 0; j0 < kp; j0 += 8) {
        float rs[8];
        for (int t = 0; t < 8; ++t) rs[t] = j0 + t < count ? row_scale<E>(k + (j0 + t) * stride, D) : 0.f;
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; ++t) {
                r[t] = j0 + t < count ? load8<E>(k + (j0 + t) * stride + d0) : _mm256_setzero_ps();
                if (std::is_same<E, I8>::value) r[t] = _mm256_mul_ps(r[t], _mm256_set1_ps(rs[t]));
            }
            const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xee);
            const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xee);
            const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xee);
            const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xee);
            const __m256 out[8] = {_mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b1, b5, 0x20),
                                   _mm256_permute2f128_ps(b2, b6, 0x20), _mm256_permute2f128_ps(b3, b7, 0x20),
                                   _mm256_permute2f128_ps(b0, b4, 0x31), _mm256_permute2f128_ps(b1, b5, 0x31),
                                   _mm256_permute2f128_ps(b2, b6, 0x31), _mm256_permute2f128_ps(b3, b7, 0x31)};
            for (int t = 0; t < 8; ++t) _mm256_storeu_ps(kt + static_cast<size_t>(d0 + t) * kp + j0, out[t]);
        }
    }
}

// One decode row: R (<= 3) of its query heads, rows row0.. of the item, that share one KV head,
// against the keys [first, visible) of a block straight from the cache rows. Each K and V
// vector is loaded and converted once for the R heads; the scores of four keys at a time come
// from 4R accumulators summed by a transpose-and-add tree. (The transposed keys of
// attend_rows_together cost more than the scores themselves when one token's heads read them:
// 8 decode rows at 128 tokens, int8 cache, 0.133 -> 0.072 ms in bench/attention_kernels.py. Its sums part
// from that path's in the last bits, so a fixed order keeps that path.)
template <class E, int R>
void attend_decode_heads(const Problem& p, Scratch& sc, const typename E::T* kh, const typename E::T* vh,
                         int64_t stride, int row0, int first, int visible) {
    static_assert(R >= 1 && R <= 3, "4R score accumulators and a K vector must fit in 16 registers");
    const int D = p.s->head_size, n = visible - first;
    kh += first * stride;
    vh += first * stride;
    const float* q[R];
    float* acc[R];
    float* w[R];  // scores, then softmax weights (times the V row's scale)
    for (int i = 0; i < R; ++i) {
        q[i] = &sc.q[static_cast<size_t>(row0 + i) * D];
        acc[i] = &sc.acc[static_cast<size_t>(row0 + i) * D];
        w[i] = &sc.scores[static_cast<size_t>(i) * padded_keys(p.s->block_size)];
    }
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        __m256 a[R][4];
        for (int i = 0; i < R; ++i)
            for (int t = 0; t < 4; ++t) a[i][t] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            for (int t = 0; t < 4; ++t) {
                const __m256 k = load8<E>(kh + (j + t) * stride + d);
                for (int i = 0; i < R; ++i) a[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q[i] + d), k, a[i][t]);
            }
        }
        for (int i = 0; i < R; ++i) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
            _mm_storeu_ps(w[i] + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
        }
    }
    for (; j < n; ++j)
        for (int i = 0; i < R; ++i) w[i][j] = dot_row<E>(q[i], kh + j * stride, D);
    // The online softmax of each head over the block, eight keys at a time (lanes past n count as
    // -inf): an int8 cache's K row scales multiply the scores first, its V row scales the weights
    // after (each scale converted once a pass, for its R heads).
    constexpr bool kInt8 = std::is_same<E, I8>::value;
    const int padded = (n + 7) / 8 * 8;
    float* k_scales = sc.kt.data();  // (the transposed keys' scratch, which a decode row does not use)
    float* v_scales = k_scales + padded_keys(p.s->block_size);
    if constexpr (kInt8) {
        for (j = 0; j < n; ++j) {
            k_scales[j] = row_scale<E>(kh + j * stride, D);
            v_scales[j] = row_scale<E>(vh + j * stride, D);
        }
        for (; j < padded; ++j) k_scales[j] = v_scales[j] = 1.f;
    }
    const __m256 scale_v = _mm256_set1_ps(p.scale);
    int rows[R];
    for (int i = 0; i < R; ++i) {
        rows[i] = row0 + i;
        float* scores = w[i];
        for (j = n; j < padded; ++j) scores[j] = kNegInf;
        for (j = 0; j < padded; j += 8) {
            __m256 v = _mm256_loadu_ps(scores + j);
            if constexpr (kInt8) v = _mm256_mul_ps(v, _mm256_loadu_ps(k_scales + j));
            _mm256_storeu_ps(scores + j, _mm256_mul_ps(v, scale_v));
        }
        if (p.softcap > 0.f) cap(scores, n, p.softcap);
    }
    alignas(32) float correction[8];
    softmax_rows<R>(sc, w, rows, padded, correction);
    if constexpr (kInt8)
        for (int i = 0; i < R; ++i)
            for (j = 0; j < padded; j += 8)
                _mm256_storeu_ps(w[i] + j, _mm256_mul_ps(_mm256_loadu_ps(w[i] + j), _mm256_loadu_ps(v_scales + j)));
    for (int d = 0; d < D; d += 32) {  // weighted V, 32 dimensions of the R heads at a time
        __m256 a[R][4];
        for (int i = 0; i < R; ++i) {
            const __m256 c = _mm256_set1_ps(correction[i]);
            for (int t = 0; t < 4; ++t) a[i][t] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d + 8 * t), c);
        }
        for (j = 0; j < n; ++j) {
            __m256 wj[R];
            for (int i = 0; i < R; ++i) wj[i] = _mm256_broadcast_ss(w[i] + j);
            for (int t = 0; t < 4; ++t) {
                const __m256 v = load8<E>(vh + j * stride + d + 8 * t);
                for (int i = 0; i < R; ++i) a[i][t] = _mm256_fmadd_ps(wj[i], v, a[i][t]);
            }
        }
        for (int i = 0; i < R; ++i)
            for (int t = 0; t < 4; ++t) _mm256_storeu_ps(acc[i] + d + 8 * t, a[i][t]);
    }
}

// The G query heads of KV head `kv_head` of a decode row, in passes of at most three heads
// (as even as possible: G = 4 as 2 + 2, G = 7 as 3 + 2 + 2).
template <class E>
void attend_decode_row(const Problem& p, Scratch& sc, const typename E::T* kh, const typename E::T* vh,
                       int64_t stride, int kv_head, int first, int visible) {
    const int G = p.group, passes = (G + 2) / 3;
    for (int done = 0, pass = 0; pass < passes; ++pass) {
        const int heads = (G - done) / (passes - pass) + ((G - done) % (passes - pass) != 0);
        const int row0 = kv_head * G + done;
        switch (heads) {
            case 1: attend_decode_heads<E, 1>(p, sc, kh, vh, stride, row0, first, visible); break;
            case 2: attend_decode_heads<E, 2>(p, sc, kh, vh, stride, row0, first, visible); break;
            default: attend_decode_heads<E, 3>(p, sc, kh, vh, stride, row0, first, visible); break;
        }
        done += heads;
    }
}

template <class E>
void attend_rows_together(const Problem& p, Scratch& sc, const float* kt, int kp, const typename E::T* vh,
                          int64_t stride, const int* rows, int num_rows, int first, int visible) {
    switch (num_rows) {
        case 1: return attend_rows_together<E, 1>(p, sc, kt, kp, vh, stride, rows, first, visible);
        case 2: return attend_rows_together<E, 2>(p, sc, kt, kp, vh, stride, rows, first, visible);
        case 3: return attend_rows_together<E, 3>(p, sc, kt, kp, vh, stride, rows, first, visible);
        default: return attend_rows_together<E, 4>(p, sc, kt, kp, vh, stride, rows, first, visible);
    }
}
#endif

// One cache block's contribution to every row (query, head) of the item, KV head by KV
// head. k and v point at the block's first token, KV head 0; rows are `stride` apart.
template <class E>
void attend_block(const Problem& p, const WorkItem& w, Scratch& sc, const typename E::T* k, const typename E::T* v,
                  int64_t stride, int k0, int count, int ctx) {
    const int D = p.s->head_size, H = p.s->num_heads, G = p.group;
#if defined(__AVX2__) && defined(__FMA__)
    // Transposing this block's keys pays off once three rows share them: prefill, and decode with
    // a GQA group of three or more (each K/V vector then loaded and converted once for the group;
    // measured with 3 query heads per KV head: float32 the same to 8% faster, int8 1.1-1.2x).
    // A fixed order (batch invariance) always takes the transposed keys: a decode row then sums
    // as the same position's prefill row does.
    // A decode row (one query of the item) reads the cache rows directly (attend_decode_row),
    // except in a fixed order.
    const bool decode = !p.fixed_order && w.q_end - w.q_begin == 1 && D % 32 == 0;
    const bool together = !decode && (p.fixed_order || (w.q_end - w.q_begin) * G >= kMinRowsTogether) && D % 16 == 0;
    const int kp = padded_keys(p.s->block_size);
#endif
    int rows[kRowsPerPass];
    for (int kv_head = 0; kv_head < p.s->num_kv_heads; ++kv_head) {
        const typename E::T* kh = k + kv_head * p.row;
        const typename E::T* vh = v + kv_head * p.row;
#if defined(__AVX2__) && defined(__FMA__)
        if (decode) {
            const int visible = std::min(count, ctx + w.q_begin + 1 - k0);
            const int first = p.window > 0 ? std::max(0, ctx + w.q_begin - p.window + 1 - k0) : 0;
            if (visible > first) attend_decode_row<E>(p, sc, kh, vh, stride, kv_head, first, visible);
            continue;
        }
        if (together) transpose_keys<E>(kh, stride, count, D, kp, sc.kt.data());
#endif
        // Rows that see the same keys go through together: runs of up to kRowsPerPass rows
        // of one key range (all of them, except in the blocks holding the diagonal or a
        // window's edge).
        int num_rows = 0, run_first = 0, run_visible = 0;
        auto flush = [&] {
            if (num_rows == 0) return;
#if defined(__AVX2__) && defined(__FMA__)
            if (together) {
                attend_rows_together<E>(p, sc, sc.kt.data(), kp, vh, stride, rows, num_rows, run_first, run_visible);
                num_rows = 0;
                return;
            }
#endif
            attend_rows_one_by_one<E>(p, sc, kh, vh, stride, rows, num_rows, run_first, run_visible);
            num_rows = 0;
        };
        for (int qi = w.q_begin; qi < w.q_end; ++qi) {
            const int visible = std::min(count, ctx + qi + 1 - k0);  // causal limit within this block
            const int first = p.window > 0 ? std::max(0, ctx + qi - p.window + 1 - k0) : 0;  // the window's
            if (visible <= first) continue;
            for (int g = 0; g < G; ++g) {
                if (num_rows == kRowsPerPass || (num_rows > 0 && (visible != run_visible || first != run_first)))
                    flush();
                rows[num_rows++] = (qi - w.q_begin) * H + kv_head * G + g;
                run_first = first;
                run_visible = visible;
            }
        }
        flush();
    }
}

// The next block sits anywhere in the cache, where no hardware prefetcher looks: ask for it
// while this one is computed.
template <class E>
inline void prefetch_block(const Problem& p, int64_t offset, size_t bytes) {
    const char* k = reinterpret_cast<const char*>(static_cast<const typename E::T*>(p.kv_cache) + offset);
    const char* v = k + p.kv_half * sizeof(typename E::T);
    for (size_t i = 0; i < bytes; i += 64) {
        __builtin_prefetch(k + i);
        __builtin_prefetch(v + i);
    }
}

template <class E>
void run_item_of(const Problem& p, const WorkItem& w, Scratch& sc, float* partials) {
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
    const int64_t row = static_cast<int64_t>(s.num_kv_heads) * p.row;  // one token's K (or V), all KV heads
    const typename E::T* cache = static_cast<const typename E::T*>(p.kv_cache);
    for (int k0 = w.k_begin; k0 < k_end;) {
        const int first = k0 % BS;
        const int count = std::min(BS - first, k_end - k0);
        const int64_t base = (static_cast<int64_t>(table[k0 / BS]) * BS + first) * row;
        if (k0 + count < k_end)
            prefetch_block<E>(p, table[(k0 + count) / BS] * static_cast<int64_t>(BS) * row,
                              BS * row * sizeof(typename E::T));
        attend_block<E>(p, w, sc, cache + base, cache + p.kv_half + base, row, k0, count, ctx);
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
                if (sc.l[r] > 0.f) scale(acc, p.v_scale / sc.l[r], D);
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
            if (l > 0.f) scale(out.data(), p.v_scale / l, D);
            store_row(p.out, out_offset(p, w0, qi, head), out.data(), D, p.s->dtype);
        }
    }
}

void run_item(const Problem& p, const WorkItem& w, Scratch& sc, float* partials) {
    switch (p.s->kv_dtype) {
        case PA_FLOAT32: return run_item_of<F32>(p, w, sc, partials);
        case PA_BFLOAT16: return run_item_of<BF16>(p, w, sc, partials);
        case PA_FLOAT16: return run_item_of<F16>(p, w, sc, partials);
        case PA_FP8_E4M3: return run_item_of<E4M3>(p, w, sc, partials);
        case PA_FP8_E5M2: return run_item_of<E5M2>(p, w, sc, partials);
        default: return run_item_of<I8>(p, w, sc, partials);
    }
}

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
Kernels kernels() { return {run_item, merge_splits, "avx2+fma+f16c"}; }
#else
Kernels kernels() { return {run_item, merge_splits, "portable"}; }
#endif

}  // namespace PA_NS
}  // namespace pa
