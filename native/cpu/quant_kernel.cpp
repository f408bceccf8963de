// The per-row work of the packed-weight library (quant_matmul.cpp has the design). Compiled
// five times: -DQM_NS=qm_portable (plain C++), qm_avx2 (-mavx2 -mfma -mf16c), qm_avx512 (the
// same plus -mavx512f/bw/vl/dq), qm_avx512_vnni (plus -mavx512vnni) and qm_avx512_bf16 (plus
// -mavx512bf16: also the bf16 panels of qm_linear_bf16). The vector code is written once over a
// vector width (Simd8: AVX2's 8 fp32 lanes; Simd16: AVX-512's 16): a block of 32 values is
// kVecs<S> vectors. Every path computes the same sums per block (the vector ones with fused
// multiply-adds and sums in another order, so the last bits may differ).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_kernel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QM_AVX2 1  // vector code (AVX2, or AVX-512 where QM_AVX512 is set too)
#include <immintrin.h>
#endif
#if QM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define QM_AVX512 1
#endif
#if QM_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define QM_BF16 1  // bf16 dot products for x rounded to bf16 (qm_linear_bf16)
#endif

#ifndef QM_NS
#error "compile with -DQM_NS=qm_avx512_bf16, qm_avx512_vnni, qm_avx512, qm_avx2 or qm_portable"
#endif

namespace qm {
namespace QM_NS {
namespace {

inline float fp16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if QM_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);  // inf, nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        int e = -1;
        do { ++e; mant <<= 1; } while (!(mant & 0x400));
        bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

// The 32 quantized values of a block as floats (before scale and offset).
inline void block_values(int type, const uint8_t* b, float* q) {
    if (type == kF32) {
        std::memcpy(q, b, 32 * sizeof(float));
        return;
    }
    if (type == kBF16) {
        for (int i = 0; i < 32; ++i) {
            uint16_t h;
            std::memcpy(&h, b + 2 * i, 2);
            const uint32_t bits = static_cast<uint32_t>(h) << 16;
            std::memcpy(q + i, &bits, 4);
        }
        return;
    }
    if (type == kQ8_0) {
        const int8_t* s = reinterpret_cast<const int8_t*>(b + 2);
        for (int i = 0; i < 32; ++i) q[i] = static_cast<float>(s[i]);
        return;
    }
    if (type == kQ8_M) {
        for (int i = 0; i < 32; ++i) q[i] = static_cast<float>(b[4 + i]);
        return;
    }
    const uint8_t* s = b + (type == kQ4_1 ? 4 : 2);
    for (int i = 0; i < 16; ++i) {
        q[i] = static_cast<float>(s[i] & 0x0f);
        q[i + 16] = static_cast<float>(s[i] >> 4);
    }
}

// The block's scale, and what each unit of sum(x) adds (the offset: -8d, m or 0). A scale and a
// min side by side are converted by one instruction (1.06x a one-row Q4_1 product, same values).
inline void scale_offset(int type, const uint8_t* b, float* d, float* offset) {
    if (type == kQ4_1 || type == kQ8_M) {
#if QM_AVX2
        int32_t pair;
        std::memcpy(&pair, b, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
        *d = _mm_cvtss_f32(dm);
        *offset = _mm_cvtss_f32(_mm_movehdup_ps(dm));
#else
        *d = fp16(b);
        *offset = fp16(b + 2);
#endif
        return;
    }
    *d = fp16(b);
    *offset = type == kQ4_0 ? -8.f * *d : 0.f;
}

#if QM_AVX2
#if QM_AVX512
// 16 fp32 lanes; a block of 32 values is two vectors.
struct Simd16 {
    using V = __m512;
    static constexpr int kLanes = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float f) { return _mm512_set1_ps(f); }
    static V broadcast(const float* p) { return _mm512_set1_ps(*p); }  // folds into the FMA's operand
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static float hsum(V v) { return _mm512_reduce_add_ps(v); }
    static V from_i8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }   // 16 bytes
    static V from_u8(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
    static V from_bf16(const uint8_t* p) {  // 16 bf16 values
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
};
#endif
// 8 fp32 lanes; a block of 32 values is four vectors.
struct Simd8 {
    using V = __m256;
    static constexpr int kLanes = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float f) { return _mm256_set1_ps(f); }
    static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static float hsum(V v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
    static V from_i8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }   // the low 8 bytes
    static V from_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
    static V from_bf16(const uint8_t* p) {  // 8 bf16 values
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
};

// The row tiles take the widest vectors. The panels (compute-bound) stay at 8 lanes even with
// AVX-512: on Zen 4, where a 512-bit FMA is two 256-bit halves, 16-lane versions of them (a 16 x
// 12 panel, and then also the 8-row dequantized tile) ran 0.75-0.94x as fast on Llama-3-8B's
// shapes (bench/packed.py --paths), and 1.0-1.1x on the default model's. The dequantized tiles
// are 16 lanes since 2026-12-07 (Zen 5, full-width FMAs: 0.61-0.85x the 8-lane tile's time at
// 4-15 rows on the default model's shapes; not re-measured on Zen 4 or on larger models).
#if QM_AVX512
using Simd = Simd16;
#else
using Simd = Simd8;
#endif
template <class S>
constexpr int kVecs = 32 / S::kLanes;  // vectors per block of 32 values

// kLanes bytes of nibbles as two vectors of floats: their low nibbles and their high nibbles.
template <class S>
inline void widened_nibbles(const uint8_t* p, typename S::V* lo, typename S::V* hi);
template <>
inline void widened_nibbles<Simd8>(const uint8_t* p, __m256* lo, __m256* hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#if QM_AVX512
template <>
inline void widened_nibbles<Simd16>(const uint8_t* p, __m512* lo, __m512* hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#endif

// The block's quantized values, in order.
template <class S>
inline void block_vectors(int type, const uint8_t* b, typename S::V* q) {
    if (type == kF32) {
        for (int i = 0; i < kVecs<S>; ++i) q[i] = S::load(reinterpret_cast<const float*>(b) + i * S::kLanes);
        return;
    }
    if (type == kBF16) {  // a bf16 value is the high half of its float
        for (int i = 0; i < kVecs<S>; ++i) q[i] = S::from_bf16(b + 2 * i * S::kLanes);
        return;
    }
    if (type == kQ8_0 || type == kQ8_M) {  // each vector's bytes widened straight from memory
        const uint8_t* bytes = b + (type == kQ8_0 ? 2 : 4);
        for (int i = 0; i < kVecs<S>; ++i) {
            const __m128i part = S::kLanes == 8 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i))
                                                : _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * i));
            q[i] = type == kQ8_0 ? S::from_i8(part) : S::from_u8(part);
        }
        return;
    }
    // Nibbles: each byte widened to a 32-bit lane straight from memory, its low nibble (value j)
    // and high nibble (value j + 16) split there (an and, a shift). Widening the two nibble halves
    // after splitting them in 16 bytes took three times the shuffles, the scarce port at one row.
    const uint8_t* nibbles = b + (type == kQ4_1 ? 4 : 2);
    constexpr int kPerVec = S::kLanes;  // bytes widened per vector: 8 (AVX2) or 16
    for (int h = 0; h < 16 / kPerVec; ++h) {
        typename S::V lo, hi;
        widened_nibbles<S>(nibbles + h * kPerVec, &lo, &hi);
        q[h] = lo;
        q[16 / kPerVec + h] = hi;
    }
}

// The block's 32 values as GGUF's reference dequantizes them: d * q + m, rounded after each
// step (Q8_M, which is not a GGUF type, the same way as Q4_1), or (q - 8) * d, or q * d.
template <class S>
inline void block_dequantized(int type, const uint8_t* b, typename S::V* w) {
    using V = typename S::V;
    block_vectors<S>(type, b, w);
    float d, offset;
    scale_offset(type, b, &d, &offset);
    const V vd = S::set1(d);
    if (type == kQ4_1 || type == kQ8_M) {
        const V vm = S::set1(offset);
        for (int i = 0; i < kVecs<S>; ++i) w[i] = S::add(S::mul(vd, w[i]), vm);
    } else {
        const V shift = S::set1(type == kQ4_0 ? 8.f : 0.f);
        for (int i = 0; i < kVecs<S>; ++i) w[i] = S::mul(S::sub(w[i], shift), vd);
    }
}
#endif

#if QM_AVX2
// How far ahead of the block in use the row products ask for weights. A one-row product reads
// its weights once, from memory, and with the hardware prefetcher alone ran at half the copy
// bandwidth (AMD EPYC family 23, two threads, a Q4_1 product over 50 MB of weights: 12 GB/s
// against 25); asking 2-4 KB ahead took it to 14.5 GB/s, and the default model's batch-1 decode
// step from 9.2 to 8.3 ms (1 KB: 8.45, 8 KB: 8.4). Past the end of a thread's rows the request
// only warms lines another thread reads.
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_ahead(const uint8_t* block) {
    _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);
}
#endif

#if QM_AVX2
// The block's 32 weight values as int16 (for int16 activations): one vector of 32 on AVX-512,
// two of 16 on AVX2.
#if QM_AVX512
struct Words { __m512i v; };
#else
struct Words { __m256i v[2]; };
#endif

template <int Type>
inline Words block_words(const uint8_t* b) {
#if !QM_AVX512
    if constexpr (Type == kQ4_0 || Type == kQ4_1) {  // widened from memory, then split: one shuffle
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Type == kQ4_1 ? 4 : 2))));
        return {{_mm256_and_si256(v, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16(v, 4)}};
    }
#endif
    __m256i bytes;  // the 32 values as bytes, in order
    if constexpr (Type == kQ8_0 || Type == kQ8_M) {
        bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (Type == kQ8_0 ? 2 : 4)));
    } else {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Type == kQ4_1 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(0x0f);
        bytes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
    }
#if QM_AVX512
    return {Type == kQ8_0 ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes)};
#else
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    if constexpr (Type == kQ8_0) return {{_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)}};
    return {{_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)}};
#endif
}

// The block's integer dot product with 32 int16 of x, as kLanes partial sums in floats (int32
// until then: exact, |q| <= 255 and |qx| <= 32767 over 32 terms). With VNNI one instruction
// multiplies, pairs and accumulates.
inline Simd::V int16_dot(const Words& w, const int16_t* qx) {
#if QM_AVX512
    const __m512i x = _mm512_loadu_si512(qx);
#if defined(__AVX512VNNI__)
    return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w.v, x));
#else
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w.v, x));
#endif
#else
    const __m256i* x = reinterpret_cast<const __m256i*>(qx);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w.v[0], _mm256_loadu_si256(x)),
                                               _mm256_madd_epi16(w.v[1], _mm256_loadu_si256(x + 1))));
#endif
}
#else
// The block's 32 quantized values as integers (for int16 activations).
inline void block_ints(int type, const uint8_t* b, int* q) {
    if (type == kQ8_0) {
        for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(b[2 + i]);
    } else if (type == kQ8_M) {
        for (int i = 0; i < 32; ++i) q[i] = b[4 + i];
    } else {
        const uint8_t* s = b + (type == kQ4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) {
            q[i] = s[i] & 0x0f;
            q[i + 16] = s[i] >> 4;
        }
    }
}
#endif

// Rows [n0, n1) of y for T rows of x from m0. Per block: the quantized values are dotted with x,
// then scaled; the offset term uses the block sums of x (Job::xsum), so sum_i (d q_i + m) x_i is
// computed as d * sum_i q_i x_i + m * sum_i x_i.
// With Int16 (qm_linear_q16), x is rounded per block to int16 (x ~ xd * qx): the dot is
// d * xd * sum_i q_i qx_i, the sum in integers (int32, exact: |q| <= 255, |qx| <= 32767, 32
// terms). The weights are unpacked to int16 once per block (no conversions to float), and each
// row of x takes one or two multiply-add instructions on integers where fp32 activations take
// two or four.
template <int Type, int T, bool Int16>
void rows_tile(const Job& j, int64_t n0, int64_t n1, int64_t m0) {
    const int64_t blocks = j.k / 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = j.w + n * j.row_bytes;
        float acc[T] = {};
#if QM_AVX2
        using V = Simd::V;
        V vacc[T];
        for (int t = 0; t < T; ++t) vacc[t] = Simd::zero();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* blk = row + b * j.block_bytes;
            prefetch_ahead(blk);
            float d = 1.f, offset = 0.f;
            if constexpr (!kDense<Type>) scale_offset(Type, blk, &d, &offset);
            V q[kVecs<Simd>];
            Words w;
            if constexpr (Int16) {
                w = block_words<Type>(blk);
            } else {
                block_vectors<Simd>(Type, blk, q);
            }
            const V vd = Simd::set1(d);
            for (int t = 0; t < T; ++t) {
                const int64_t xb = (m0 + t) * blocks + b;
                if constexpr (Int16) {
                    vacc[t] = Simd::fmadd(Simd::set1(d * j.xd[xb]), int16_dot(w, j.xq16 + xb * 32), vacc[t]);
                } else {
                    const float* x = j.x + xb * 32;
                    V s = Simd::mul(q[0], Simd::load(x));
                    for (int i = 1; i < kVecs<Simd>; ++i) s = Simd::fmadd(q[i], Simd::load(x + i * Simd::kLanes), s);
                    vacc[t] = Simd::fmadd(vd, s, vacc[t]);
                }
                if constexpr (!kDense<Type>) acc[t] += offset * j.xsum[xb];
            }
        }
        for (int t = 0; t < T; ++t) j.y[(m0 + t) * j.n + n] = Simd::hsum(vacc[t]) + acc[t];
#else
        float lanes[T][8] = {};
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* blk = row + b * j.block_bytes;
            float d = 1.f, offset = 0.f, q[32];
            int w[32];
            if constexpr (!kDense<Type>) scale_offset(Type, blk, &d, &offset);
            if constexpr (Int16) {
                block_ints(Type, blk, w);
            } else {
                block_values(Type, blk, q);
            }
            for (int t = 0; t < T; ++t) {
                const int64_t xb = (m0 + t) * blocks + b;
                if constexpr (Int16) {
                    const int16_t* qx = j.xq16 + xb * 32;
                    int32_t dot = 0;
                    for (int i = 0; i < 32; ++i) dot += w[i] * qx[i];
                    lanes[t][0] += d * j.xd[xb] * static_cast<float>(dot);
                } else {
                    const float* x = j.x + xb * 32;
                    for (int l = 0; l < 8; ++l) {
                        const float s = q[l] * x[l] + q[l + 8] * x[l + 8] + q[l + 16] * x[l + 16] + q[l + 24] * x[l + 24];
                        lanes[t][l] += d * s;
                    }
                }
                if constexpr (!kDense<Type>) acc[t] += offset * j.xsum[xb];
            }
        }
        for (int t = 0; t < T; ++t) {
            float s = 0.f;
            for (int l = 0; l < 8; ++l) s += lanes[t][l];
            j.y[(m0 + t) * j.n + n] = s + acc[t];
        }
#endif
    }
}

#if QM_AVX2
// One row, dequantized exactly as GGUF's reference does (defined below).
void dequantize_row(int type, const uint8_t* row, int64_t k, int64_t block_bytes, float* out);

// Slabs of x (16 rows x k floats each) one pass over a chunk's panels works through: about
// 256 KB, so that they stay in L2 while every panel of the chunk multiplies them.
constexpr int64_t kSlabFloatsPerPass = 64 * 1024;

// Output rows [nb, nb + nn) of W dequantized into kNr rows of k floats; rows past nn as zeros.
template <int Type, int kNr>
void dequantize_panel(const Job& j, int64_t nb, int nn, float* panel) {
    for (int r = 0; r < kNr; ++r) {
        if (r < nn) {
            dequantize_row(Type, j.w + (nb + r) * j.row_bytes, j.k, j.block_bytes, panel + r * j.k);
        } else {  // rows past the chunk multiply as zeros and are not stored
            std::memset(panel + r * j.k, 0, static_cast<size_t>(j.k) * sizeof(float));
        }
    }
}

// A panel product's 16 x kNr block of y (block[r][i]: output row nb + r, row 16 s + i of x) into
// y, without the rows past m and the panel rows past nn.
template <int kNr>
void store_block(const Job& j, int64_t s, int64_t nb, int nn, const float (&block)[kNr][16]) {
    const int64_t m0 = 16 * s, rows = std::min<int64_t>(16, j.m - m0);
    for (int r = 0; r < nn; ++r)
        for (int64_t i = 0; i < rows; ++i) j.y[(m0 + i) * j.n + nb + r] = block[r][i];
}

// x [m, k] transposed into slabs of 16 rows (Job::xt: [m_pad / 16][k][16], rows past m zero),
// eight rows by eight columns at a time in registers: a row-by-row copy wrote each value 64
// bytes from the last, ~10% of a panel product's time at 64 rows.
void to_slabs(const float* x, int64_t m, int64_t k, float* xt) {
    const int64_t m_pad = (m + 15) / 16 * 16;
    for (int64_t r0 = 0; r0 < m_pad; r0 += 8) {
        float* slab = xt + (r0 / 16) * 16 * k + r0 % 16;  // column c of these rows: slab[16 c .. 16 c + 8)
        for (int64_t c = 0; c < k; c += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; ++i) v[i] = r0 + i < m ? _mm256_loadu_ps(x + (r0 + i) * k + c) : _mm256_setzero_ps();
            // 8 x 8 transpose: pairs of rows interleaved, then pairs of pairs, then the halves
            __m256 t[8], u[8];
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
                u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
            }
            for (int j = 0; j < 4; ++j) {
                _mm256_storeu_ps(slab + 16 * (c + j), _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
                _mm256_storeu_ps(slab + 16 * (c + j + 4), _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
            }
        }
    }
}

// Larger batches as a small GEMM: six output rows of W are dequantized into a panel, and a
// 16 x 6 block of y is accumulated in twelve registers from a slab of x transposed (16 rows of
// x per vector pair) times each panel value broadcast: per k, two loads of x, six broadcasts,
// twelve fused multiply-adds, and no horizontal sums. The slabs are taken a few at
// a time (kSlabFloatsPerPass), each panel dequantized again for every pass (~1% of the work at
// 64 rows a pass): streaming all of a large batch's x once per panel ran at half the speed.
template <int Type>
void panel_rows(const Job& j, int64_t n0, int64_t n1) {
    using S = Simd8;
    using V = S::V;
    constexpr int kSlabVecs = 16 / S::kLanes, kNr = 12 / kSlabVecs;
    const int64_t K = j.k, slab = 16 * K, slabs = j.m_pad / 16;
    const int64_t slabs_per_pass = std::max<int64_t>(1, kSlabFloatsPerPass / slab);
    static thread_local std::vector<float> panel_storage;
    panel_storage.resize(static_cast<size_t>(kNr * K));
    float* panel = panel_storage.data();
    alignas(64) float block[kNr][16];
    for (int64_t pass = 0; pass < slabs; pass += slabs_per_pass) {
        const int64_t pass_end = std::min(slabs, pass + slabs_per_pass);
        for (int64_t nb = n0; nb < n1; nb += kNr) {
            const int nn = static_cast<int>(std::min<int64_t>(kNr, n1 - nb));
            dequantize_panel<Type, kNr>(j, nb, nn, panel);
            for (int64_t s = pass; s < pass_end; ++s) {
                V c[kNr][kSlabVecs];
#pragma GCC unroll 12
                for (int r = 0; r < kNr; ++r)
                    for (int v = 0; v < kSlabVecs; ++v) c[r][v] = S::zero();
                const float* xt = j.xt + s * slab;
                for (int64_t kk = 0; kk < K; ++kk) {
                    V x[kSlabVecs];
                    for (int v = 0; v < kSlabVecs; ++v) x[v] = S::load(xt + 16 * kk + v * S::kLanes);
#pragma GCC unroll 12
                    for (int r = 0; r < kNr; ++r) {
                        const V wv = S::broadcast(panel + r * K + kk);
                        for (int v = 0; v < kSlabVecs; ++v) c[r][v] = S::fmadd(wv, x[v], c[r][v]);
                    }
                }
                // (stored with constant indexes first: a runtime index into c would make the
                // compiler keep c in memory and store it on every k)
#pragma GCC unroll 12
                for (int r = 0; r < kNr; ++r)
                    for (int v = 0; v < kSlabVecs; ++v) S::store(block[r] + v * S::kLanes, c[r][v]);
                store_block<kNr>(j, s, nb, nn, block);
            }
        }
    }
}

#if QM_BF16
// For the bf16 panels: output rows [nb, nb + nn) as the quantized values in bf16 pairs (exact:
// integers of at most 8 bits), [kNr][k / 2] uint32 with value 2p in the low half, and each
// block's scale and offset, [kNr][k / 32]; rows past nn as zeros.
template <int Type, int kNr>
void bf16_panel(const Job& j, int64_t nb, int nn, uint32_t* q, float* scale, float* offset) {
    const int64_t pairs = j.k / 2, blocks = j.k / 32;
    for (int r = 0; r < kNr; ++r) {
        if (r >= nn) {
            std::memset(q + r * pairs, 0, static_cast<size_t>(pairs) * sizeof(uint32_t));
            std::memset(scale + r * blocks, 0, static_cast<size_t>(blocks) * sizeof(float));
            std::memset(offset + r * blocks, 0, static_cast<size_t>(blocks) * sizeof(float));
            continue;
        }
        const uint8_t* row = j.w + (nb + r) * j.row_bytes;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* blk = row + b * j.block_bytes;
            scale_offset(Type, blk, scale + r * blocks + b, offset + r * blocks + b);
            const __m512i words = block_words<Type>(blk).v;  // 32 int16, in order
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(words)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(words, 1)));
            _mm512_storeu_si512(q + r * pairs + b * 16, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
        }
    }
}

// Batches of 16 rows or more with x rounded to bf16 (qm_linear_bf16; AVX512_BF16): twelve output
// rows of W in a panel of bf16 pairs (bf16_panel) against slabs of x (16 rows, k in pairs).
// Per pair of k: one load of the slab and twelve vdpbf16ps (each two multiply-adds per lane,
// summed in fp32: twice the multiply-adds of an fp32 FMA per instruction), into per-block
// sums; at each block's end those are scaled into the accumulators, and the block's offset
// (-8d, m) is added through the sums of x. Twelve accumulators and twelve block sums: 24 of
// the 32 registers. Slabs are taken a few at a time, as in panel_rows.
template <int Type>
void bf16_panel_rows(const Job& j, int64_t n0, int64_t n1) {
    constexpr int kNr = 12;
    const int64_t pairs = j.k / 2, blocks = j.k / 32, slab = 16 * pairs, slabs = j.m_pad / 16;
    const int64_t slabs_per_pass = std::max<int64_t>(1, kSlabFloatsPerPass / slab);
    static thread_local std::vector<uint32_t> q_storage;
    static thread_local std::vector<float> scale_storage, offset_storage;
    q_storage.resize(static_cast<size_t>(kNr * pairs));
    scale_storage.resize(static_cast<size_t>(kNr * blocks));
    offset_storage.resize(static_cast<size_t>(kNr * blocks));
    uint32_t* q = q_storage.data();
    float *scale = scale_storage.data(), *offset = offset_storage.data();
    const auto* xt = reinterpret_cast<const uint32_t*>(j.xbf16);
    alignas(64) float block[kNr][16];
    for (int64_t pass = 0; pass < slabs; pass += slabs_per_pass) {
        const int64_t pass_end = std::min(slabs, pass + slabs_per_pass);
        for (int64_t nb = n0; nb < n1; nb += kNr) {
            const int nn = static_cast<int>(std::min<int64_t>(kNr, n1 - nb));
            bf16_panel<Type, kNr>(j, nb, nn, q, scale, offset);
            for (int64_t s = pass; s < pass_end; ++s) {
                __m512 c[kNr];
#pragma GCC unroll 12
                for (int r = 0; r < kNr; ++r) c[r] = _mm512_setzero_ps();
                const uint32_t* xs = xt + s * slab;
                const float* sums = j.xbf16_sums + s * blocks * 16;
                for (int64_t b = 0; b < blocks; ++b) {
                    __m512 t[kNr];
#pragma GCC unroll 12
                    for (int r = 0; r < kNr; ++r) t[r] = _mm512_setzero_ps();
                    for (int p = 0; p < 16; ++p) {
                        const int64_t pair = b * 16 + p;
                        const auto xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xs + pair * 16));
#pragma GCC unroll 12
                        for (int r = 0; r < kNr; ++r) {
                            const auto wv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(q[r * pairs + pair])));
                            t[r] = _mm512_dpbf16_ps(t[r], xv, wv);
                        }
                    }
                    const __m512 xsum = _mm512_loadu_ps(sums + b * 16);
#pragma GCC unroll 12
                    for (int r = 0; r < kNr; ++r) {
                        c[r] = _mm512_fmadd_ps(_mm512_set1_ps(scale[r * blocks + b]), t[r], c[r]);
                        if constexpr (Type != kQ8_0) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(offset[r * blocks + b]), xsum, c[r]);
                    }
                }
#pragma GCC unroll 12
                for (int r = 0; r < kNr; ++r) _mm512_store_ps(block[r], c[r]);
                store_block<kNr>(j, s, nb, nn, block);
            }
        }
    }
}

// x [m, k] rounded to bf16 into the slabs of the bf16 panels (Job::xbf16: 16 rows, k in pairs;
// rows past m zero), and each block's sum of the rounded values per row (Job::xbf16_sums).
// vcvtne2ps2bf16 rounds 32 values at a time to nearest, ties to even (and, as the instruction
// does, takes a denormal as zero).
void round_to_bf16(const float* x, int64_t m, int64_t k, uint16_t* xbf16, float* sums) {
    const int64_t blocks = k / 32, m_pad = (m + 15) / 16 * 16;
    alignas(64) uint32_t pairs[16];
    for (int64_t r = 0; r < m_pad; ++r) {
        const int64_t s = r / 16, i = r % 16;
        uint32_t* slab = reinterpret_cast<uint32_t*>(xbf16 + s * 16 * k) + i;  // pair p of this row: slab[16 p]
        for (int64_t b = 0; b < blocks; ++b) {
            __m512i h = _mm512_setzero_si512();
            if (r < m) {
                const float* v = x + r * k + b * 32;
                h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v)));
            }
            _mm512_store_si512(pairs, h);
            for (int p = 0; p < 16; ++p) slab[(b * 16 + p) * 16] = pairs[p];
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
            sums[(s * blocks + b) * 16 + i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
    }
}

void bf16_rows(const Job& j, int64_t n0, int64_t n1) {
    switch (j.type) {
        case kQ4_0: return bf16_panel_rows<kQ4_0>(j, n0, n1);
        case kQ4_1: return bf16_panel_rows<kQ4_1>(j, n0, n1);
        case kQ8_0: return bf16_panel_rows<kQ8_0>(j, n0, n1);
        case kQ8_M: return bf16_panel_rows<kQ8_M>(j, n0, n1);
    }
}
#endif

// The row products dequantize each block once for all rows from kDequantizedMinRows, in tiles of
// up to kDequantizedMaxRows; from kPanelMinRows (Kernels::panel_min_rows) the panels take whole
// slabs of 16. AVX2: dequantized from 5 rows (5-7 rows 0.77-0.91x the folded tile's time; at 3-4
// not paid back), tiles of up to 12 (twelve accumulators and a block's four vectors fill the
// sixteen registers), panels from 13 (13-15 rows in a slab padded with zeros as fast as 16, and
// 0.77-1.0x the tiles' time) (AMD EPYC Zen 3). AVX-512: 16-lane tiles (a block is two vectors,
// 32 registers) from 2 rows (0.94-0.98x the folded tile's time at 2 rows, 0.80-0.85x at 3-4,
// 0.71-0.78x at 5-6), up to 15 rows, the panels from 16: 13-15 rows in a tile took 0.61-0.69x
// the time of a padded slab's panel (AMD EPYC Zen 5, bench/kernel_ab.py, the default model's
// four layer products; its 8-lane tiles from 8 rows were 1.4-1.6x slower than the 16-lane ones).
#if QM_AVX512
constexpr int64_t kDequantizedMinRows = 2, kDequantizedMaxRows = 15, kPanelMinRows = 16;
#elif QM_AVX2
constexpr int64_t kDequantizedMinRows = 5, kDequantizedMaxRows = 12, kPanelMinRows = 13;
#endif
#if QM_AVX2
static_assert(kDequantizedMinRows >= 2 && kDequantizedMaxRows <= 15, "linear_rows_of has tiles of 2-15 rows");
#endif

// Larger batches: each block is dequantized in registers once (d * q + m, rounded as GGUF's
// reference does) and multiplied into T rows of x, one accumulator per row: per block and
// row, kVecs fused multiply-adds and no per-block scaling or offset work.
template <int Type, int T>
void rows_tile_dequantized(const Job& j, int64_t n0, int64_t n1, int64_t m0) {
    const int64_t blocks = j.k / 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = j.w + n * j.row_bytes;
        using S = Simd;
        S::V acc[T];
        for (int t = 0; t < T; ++t) acc[t] = S::zero();
        for (int64_t b = 0; b < blocks; ++b) {
            S::V w[kVecs<S>];
            prefetch_ahead(row + b * j.block_bytes);
            block_dequantized<S>(Type, row + b * j.block_bytes, w);
            const float* x = j.x + m0 * j.k + b * 32;
            for (int t = 0; t < T; ++t, x += j.k)
                for (int i = 0; i < kVecs<S>; ++i) acc[t] = S::fmadd(w[i], S::load(x + i * S::kLanes), acc[t]);
        }
        for (int t = 0; t < T; ++t) j.y[(m0 + t) * j.n + n] = S::hsum(acc[t]);
    }
}
#endif

// Rows m0.. of x in tiles of 7 rows and one tile of what is left (folded offsets). Each row's
// sums run in the same order whatever its tile (rows_tile).
template <int Type>
void folded_rows_from(const Job& j, int64_t n0, int64_t n1, int64_t m0) {
    for (; m0 + 7 <= j.m; m0 += 7) rows_tile<Type, 7, false>(j, n0, n1, m0);
    switch (j.m - m0) {
        case 6: return rows_tile<Type, 6, false>(j, n0, n1, m0);
        case 5: return rows_tile<Type, 5, false>(j, n0, n1, m0);
        case 4: return rows_tile<Type, 4, false>(j, n0, n1, m0);
        case 3: return rows_tile<Type, 3, false>(j, n0, n1, m0);
        case 2: return rows_tile<Type, 2, false>(j, n0, n1, m0);
        case 1: return rows_tile<Type, 1, false>(j, n0, n1, m0);
        default: return;
    }
}

// Each tile is compiled per type, so the block format is known in the inner loop.
template <int Type>
void linear_rows_of(const Job& j, int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    if (j.xq16 != nullptr) {  // int16 activations (up to 2 rows; no dequantized tiles)
        for (; m0 + 4 <= j.m; m0 += 4) rows_tile<Type, 4, true>(j, n0, n1, m0);
        for (; m0 + 2 <= j.m; m0 += 2) rows_tile<Type, 2, true>(j, n0, n1, m0);
        for (; m0 < j.m; ++m0) rows_tile<Type, 1, true>(j, n0, n1, m0);
        return;
    }
#if QM_AVX2
    if (j.xt != nullptr) {  // the whole slabs in panels, the rows past them (if any) in tiles
        panel_rows<Type>(j, n0, n1);
        m0 = std::min(j.m, j.m_pad);
    }
    // Tiles of kDequantizedMinRows to kDequantizedMaxRows rows (dequantized blocks, x read as the
    // multiply-adds' memory operand), then one tile of what is left (folded offsets), so every row
    // shares each block's unpacked values: unpacking is most of a few rows' cost. Tiles of 4 and 1
    // for 5 rows took 1.5x the time of one tile of 8 (AMD EPYC family 23, the default model's
    // gate/up product; a step verifying 4 proposed tokens computes 5 rows); 9-12 rows as one tile
    // took 0.85-0.91x the time of a tile of 8 and a folded one (AMD EPYC Zen 3: per row and block
    // four multiply-adds against the folded tile's five and a scalar offset term). Each output is
    // summed in the same order whatever its tile.
    for (int64_t rows; (rows = std::min(j.m - m0, kDequantizedMaxRows)) >= kDequantizedMinRows; m0 += rows) {
        switch (rows) {
            case 2: rows_tile_dequantized<Type, 2>(j, n0, n1, m0); break;
            case 3: rows_tile_dequantized<Type, 3>(j, n0, n1, m0); break;
            case 4: rows_tile_dequantized<Type, 4>(j, n0, n1, m0); break;
            case 5: rows_tile_dequantized<Type, 5>(j, n0, n1, m0); break;
            case 6: rows_tile_dequantized<Type, 6>(j, n0, n1, m0); break;
            case 7: rows_tile_dequantized<Type, 7>(j, n0, n1, m0); break;
            case 8: rows_tile_dequantized<Type, 8>(j, n0, n1, m0); break;
            case 9: rows_tile_dequantized<Type, 9>(j, n0, n1, m0); break;
            case 10: rows_tile_dequantized<Type, 10>(j, n0, n1, m0); break;
            case 11: rows_tile_dequantized<Type, 11>(j, n0, n1, m0); break;
            case 12: rows_tile_dequantized<Type, 12>(j, n0, n1, m0); break;
            case 13: rows_tile_dequantized<Type, 13>(j, n0, n1, m0); break;
            case 14: rows_tile_dequantized<Type, 14>(j, n0, n1, m0); break;
            case 15: rows_tile_dequantized<Type, 15>(j, n0, n1, m0); break;
            default: break;  // (unreachable: kDequantizedMaxRows <= 15)
        }
    }
#endif
    folded_rows_from<Type>(j, n0, n1, m0);  // (no dequantized tiles without AVX2)
}

// qm_linear_rows: the folded row tiles whatever m, so a row of y does not depend on the other
// rows of x.
template <int Type>
void fixed_rows_of(const Job& j, int64_t n0, int64_t n1) {
    folded_rows_from<Type>(j, n0, n1, 0);
}

void fixed_rows(const Job& j, int64_t n0, int64_t n1) {
    switch (j.type) {
        case kQ4_0: return fixed_rows_of<kQ4_0>(j, n0, n1);
        case kQ4_1: return fixed_rows_of<kQ4_1>(j, n0, n1);
        case kQ8_0: return fixed_rows_of<kQ8_0>(j, n0, n1);
        case kQ8_M: return fixed_rows_of<kQ8_M>(j, n0, n1);
        case kF32: return fixed_rows_of<kF32>(j, n0, n1);
        case kBF16: return fixed_rows_of<kBF16>(j, n0, n1);
    }
}

void linear_rows(const Job& j, int64_t n0, int64_t n1) {
    switch (j.type) {
        case kQ4_0: return linear_rows_of<kQ4_0>(j, n0, n1);
        case kQ4_1: return linear_rows_of<kQ4_1>(j, n0, n1);
        case kQ8_0: return linear_rows_of<kQ8_0>(j, n0, n1);
        case kQ8_M: return linear_rows_of<kQ8_M>(j, n0, n1);
    }
}

// One row, dequantized exactly as GGUF's reference does (see block_dequantized).
void dequantize_row(int type, const uint8_t* row, int64_t k, int64_t block_bytes, float* out) {
    for (int64_t b = 0; b < k / 32; ++b) {
        const uint8_t* blk = row + b * block_bytes;
        float* o = out + b * 32;
#if QM_AVX2
        Simd::V w[kVecs<Simd>];
        block_dequantized<Simd>(type, blk, w);
        for (int i = 0; i < kVecs<Simd>; ++i) Simd::store(o + i * Simd::kLanes, w[i]);
#else
        float d, m, q[32];
        scale_offset(type, blk, &d, &m);
        block_values(type, blk, q);
        if (type == kQ4_1 || type == kQ8_M) {
            for (int i = 0; i < 32; ++i) o[i] = d * q[i] + m;
        } else {
            const float shift = type == kQ4_0 ? 8.f : 0.f;
            for (int i = 0; i < 32; ++i) o[i] = (q[i] - shift) * d;
        }
#endif
    }
}

}  // namespace

Kernels kernels() {
#if QM_BF16
    return {linear_rows, fixed_rows, dequantize_row, bf16_rows, round_to_bf16,
            to_slabs, kPanelMinRows, "avx512+vnni+bf16"};
#elif QM_AVX512 && defined(__AVX512VNNI__)
    return {linear_rows, fixed_rows, dequantize_row, nullptr, nullptr, to_slabs, kPanelMinRows, "avx512+vnni"};
#elif QM_AVX512
    return {linear_rows, fixed_rows, dequantize_row, nullptr, nullptr, to_slabs, kPanelMinRows, "avx512"};
#elif QM_AVX2
    return {linear_rows, fixed_rows, dequantize_row, nullptr, nullptr, to_slabs, kPanelMinRows, "avx2+fma"};
#else
    return {linear_rows, fixed_rows, dequantize_row, nullptr, nullptr, nullptr, 0, "portable"};
#endif
}

}  // namespace QM_NS
}  // namespace qm
