// The per-row work of the packed-weight library (quant_matmul.cpp has the design). Compiled
// twice: with -mavx2 -mfma -mf16c -DQM_NS=qm_avx2 (intrinsics below), and plain with
// -DQM_NS=qm_portable. Both compute the same sums in the same order per 8-lane group (AVX2 with
// fused multiply-adds, so the last bits may differ).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_kernel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QM_AVX2 1
#include <immintrin.h>
#endif

#ifndef QM_NS
#error "compile with -DQM_NS=qm_avx2 or -DQM_NS=qm_portable"
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

#if QM_AVX2
// Four vectors of 8 floats: the block's quantized values, in order.
inline void block_values8(int type, const uint8_t* b, __m256* q) {
    if (type == kQ8_0) {
        const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        const __m128i lo = _mm256_castsi256_si128(all), hi = _mm256_extracti128_si256(all, 1);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        return;
    }
    if (type == kQ8_M) {
        const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 4));
        const __m128i lo = _mm256_castsi256_si128(all), hi = _mm256_extracti128_si256(all, 1);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        return;
    }
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (type == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// The block's 32 values as GGUF's reference dequantizes them: d * q + m, rounded after each
// step (Q8_M, which is not a GGUF type, the same way as Q4_1), or (q - 8) * d, or q * d.
inline void block_dequantized8(int type, const uint8_t* b, __m256* w) {
    block_values8(type, b, w);
    const __m256 vd = _mm256_set1_ps(fp16(b));
    if (type == kQ4_1 || type == kQ8_M) {
        const __m256 vm = _mm256_set1_ps(fp16(b + 2));
        for (int i = 0; i < 4; ++i) w[i] = _mm256_add_ps(_mm256_mul_ps(vd, w[i]), vm);
    } else {
        const __m256 shift = _mm256_set1_ps(type == kQ4_0 ? 8.f : 0.f);
        for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(_mm256_sub_ps(w[i], shift), vd);
    }
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// The block's scale, and what each unit of sum(x) adds (the offset: -8d, m or 0).
inline void scale_offset(int type, const uint8_t* b, float* d, float* offset) {
    *d = fp16(b);
    *offset = type == kQ4_1 || type == kQ8_M ? fp16(b + 2) : type == kQ4_0 ? -8.f * *d : 0.f;
}

#if QM_AVX2
// The block's 32 weight values as two vectors of 16 int16, in order (for int16 activations).
template <int Type>
inline void block_words(const uint8_t* b, __m256i* w) {
    if constexpr (Type == kQ8_0) {
        const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(all));
        w[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(all, 1));
    } else if constexpr (Type == kQ8_M) {
        const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 4));
        w[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(all));
        w[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(all, 1));
    } else {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Type == kQ4_1 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(0x0f);
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    }
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
// row of x takes two multiply-add instructions on integers where fp32 activations take four.
template <int Type, int T, bool Int16>
void rows_tile(const Job& j, int64_t n0, int64_t n1, int64_t m0) {
    const int64_t blocks = j.k / 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = j.w + n * j.row_bytes;
        float acc[T] = {};
#if QM_AVX2
        __m256 vacc[T];
        for (int t = 0; t < T; ++t) vacc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* blk = row + b * j.block_bytes;
            float d, offset;
            scale_offset(Type, blk, &d, &offset);
            __m256 q[4];
            __m256i w[2];
            if constexpr (Int16) {
                block_words<Type>(blk, w);
            } else {
                block_values8(Type, blk, q);
            }
            const __m256 vd = _mm256_set1_ps(d);
            for (int t = 0; t < T; ++t) {
                const int64_t xb = (m0 + t) * blocks + b;
                if constexpr (Int16) {
                    const __m256i* qx = reinterpret_cast<const __m256i*>(j.xq16 + xb * 32);
                    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(qx)),
                                                         _mm256_madd_epi16(w[1], _mm256_loadu_si256(qx + 1)));
                    vacc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * j.xd[xb]), _mm256_cvtepi32_ps(dot), vacc[t]);
                } else {
                    const float* x = j.x + xb * 32;
                    __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
                    s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), s);
                    s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), s);
                    s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), s);
                    vacc[t] = _mm256_fmadd_ps(vd, s, vacc[t]);
                }
                acc[t] += offset * j.xsum[xb];
            }
        }
        for (int t = 0; t < T; ++t) j.y[(m0 + t) * j.n + n] = hsum(vacc[t]) + acc[t];
#else
        float lanes[T][8] = {};
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* blk = row + b * j.block_bytes;
            float d, offset, q[32];
            int w[32];
            scale_offset(Type, blk, &d, &offset);
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
                acc[t] += offset * j.xsum[xb];
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

// Larger batches as a small GEMM: six output rows of W are dequantized into a panel (in L1),
// and a 16 x 6 block of y is accumulated in twelve registers from a slab of x transposed (16
// rows of x per vector pair) times each panel value broadcast: per k, two loads of x, six
// broadcasts, twelve fused multiply-adds, and no horizontal sums. The slabs are taken a few at
// a time (kSlabFloatsPerPass), each panel dequantized again for every pass (~1% of the work at
// 64 rows a pass): streaming all of a large batch's x once per panel ran at half the speed.
template <int Type>
void panel_rows(const Job& j, int64_t n0, int64_t n1) {
    constexpr int kNr = 6;
    const int64_t K = j.k, slab = 16 * K, slabs = j.m_pad / 16;
    const int64_t slabs_per_pass = std::max<int64_t>(1, kSlabFloatsPerPass / slab);
    static thread_local std::vector<float> panel_storage;
    panel_storage.resize(static_cast<size_t>(kNr * K));
    float* panel = panel_storage.data();
    alignas(32) float block[kNr][16];
    for (int64_t pass = 0; pass < slabs; pass += slabs_per_pass) {
        const int64_t pass_end = std::min(slabs, pass + slabs_per_pass);
        for (int64_t nb = n0; nb < n1; nb += kNr) {
            const int nn = static_cast<int>(std::min<int64_t>(kNr, n1 - nb));
            dequantize_panel<Type, kNr>(j, nb, nn, panel);
            for (int64_t s = pass; s < pass_end; ++s) {
                __m256 c[kNr][2];
#pragma GCC unroll 6
                for (int r = 0; r < kNr; ++r) c[r][0] = c[r][1] = _mm256_setzero_ps();
                const float* xt = j.xt + s * slab;
                for (int64_t kk = 0; kk < K; ++kk) {
                    const __m256 x0 = _mm256_loadu_ps(xt + 16 * kk), x1 = _mm256_loadu_ps(xt + 16 * kk + 8);
#pragma GCC unroll 6
                    for (int r = 0; r < kNr; ++r) {
                        const __m256 wv = _mm256_broadcast_ss(panel + r * K + kk);
                        c[r][0] = _mm256_fmadd_ps(wv, x0, c[r][0]);
                        c[r][1] = _mm256_fmadd_ps(wv, x1, c[r][1]);
                    }
                }
                // (stored with constant indexes first: a runtime index into c would make the
                // compiler keep c in memory and store it on every k)
#pragma GCC unroll 6
                for (int r = 0; r < kNr; ++r) {
                    _mm256_store_ps(block[r], c[r][0]);
                    _mm256_store_ps(block[r] + 8, c[r][1]);
                }
                const int64_t m0 = 16 * s, rows = std::min<int64_t>(16, j.m - m0);
                for (int r = 0; r < nn; ++r)
                    for (int64_t i = 0; i < rows; ++i) j.y[(m0 + i) * j.n + nb + r] = block[r][i];
            }
        }
    }
}

// Larger batches: each block is dequantized in registers once (d * q + m, rounded as GGUF's
// reference does) and multiplied into T rows of x, one accumulator per row: per block and
// row, four fused multiply-adds and no per-block scaling or offset work.
template <int Type, int T>
void rows_tile_dequantized(const Job& j, int64_t n0, int64_t n1, int64_t m0) {
    const int64_t blocks = j.k / 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = j.w + n * j.row_bytes;
        __m256 acc[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            __m256 w[4];
            block_dequantized8(Type, row + b * j.block_bytes, w);
            const float* x = j.x + m0 * j.k + b * 32;
            for (int t = 0; t < T; ++t, x += j.k) {
                acc[t] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), acc[t]);
                acc[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), acc[t]);
                acc[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), acc[t]);
                acc[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), acc[t]);
            }
        }
        for (int t = 0; t < T; ++t) j.y[(m0 + t) * j.n + n] = hsum(acc[t]);
    }
}
#endif

// Each tile is compiled per type, so the block format is known in the inner loop.
template <int Type>
void linear_rows_of(const Job& j, int64_t n0, int64_t n1) {
    int64_t m0 = 0;
    if (j.xq16 != nullptr) {  // int16 activations (from 8 rows fp32 is faster: no tile of 8)
        for (; m0 + 4 <= j.m; m0 += 4) rows_tile<Type, 4, true>(j, n0, n1, m0);
        for (; m0 + 2 <= j.m; m0 += 2) rows_tile<Type, 2, true>(j, n0, n1, m0);
        for (; m0 < j.m; ++m0) rows_tile<Type, 1, true>(j, n0, n1, m0);
        return;
    }
#if QM_AVX2
    if (j.xt != nullptr) return panel_rows<Type>(j, n0, n1);
    for (; m0 + 8 <= j.m; m0 += 8) rows_tile_dequantized<Type, 8>(j, n0, n1, m0);
#endif
    // Tiles of 8 rows (dequantized blocks), then 4, 2, 1 (folded offsets) share each block's
    // unpacked values; the caller's chunk of output rows stays in L1 from one tile to the next.
    for (; m0 + 4 <= j.m; m0 += 4) rows_tile<Type, 4, false>(j, n0, n1, m0);
    for (; m0 + 2 <= j.m; m0 += 2) rows_tile<Type, 2, false>(j, n0, n1, m0);
    for (; m0 < j.m; ++m0) rows_tile<Type, 1, false>(j, n0, n1, m0);
}

void linear_rows(const Job& j, int64_t n0, int64_t n1) {
    switch (j.type) {
        case kQ4_0: return linear_rows_of<kQ4_0>(j, n0, n1);
        case kQ4_1: return linear_rows_of<kQ4_1>(j, n0, n1);
        case kQ8_0: return linear_rows_of<kQ8_0>(j, n0, n1);
        case kQ8_M: return linear_rows_of<kQ8_M>(j, n0, n1);
    }
}

// One row, dequantized exactly as GGUF's reference does (see block_dequantized8).
void dequantize_row(int type, const uint8_t* row, int64_t k, int64_t block_bytes, float* out) {
    for (int64_t b = 0; b < k / 32; ++b) {
        const uint8_t* blk = row + b * block_bytes;
        float* o = out + b * 32;
#if QM_AVX2
        __m256 w[4];
        block_dequantized8(type, blk, w);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, w[i]);
#else
        const float d = fp16(blk);
        float q[32];
        block_values(type, blk, q);
        if (type == kQ4_1 || type == kQ8_M) {
            const float m = fp16(blk + 2);
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
#if QM_AVX2
    return {linear_rows, dequantize_row, "avx2+fma", true};
#else
    return {linear_rows, dequantize_row, "portable", false};
#endif
}

}  // namespace QM_NS
}  // namespace qm
