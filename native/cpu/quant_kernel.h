// Internal to the packed-weight library: the per-row kernels, compiled five times
// (quant_kernel.cpp) into namespaces qm_avx512_bf16 (AVX-512 with VNNI and BF16),
// qm_avx512_vnni, qm_avx512, qm_avx2 and qm_portable; quant_matmul.cpp picks one per call.
#pragma once

#include <cstdint>

namespace qm {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML type ids
constexpr int kQ8_M = 100;                      // not a GGML type: uint8 with a scale and a min (int8 at load)
// Plain float weights (GGML's ids), for qm_linear_rows alone: rows of k floats or bf16 values,
// "blocks" of 32 with no scale or offset.
constexpr int kF32 = 0, kBF16 = 30;
template <int Type>
constexpr bool kDense = Type == kF32 || Type == kBF16;

struct Job {
    int type;
    const uint8_t* w;
    int64_t n, k, row_bytes, block_bytes;
    const float* x;
    int64_t m;
    float* y;
    // [m, k / 32]: each block's sum of x, for the rows in row tiles (else null); with xq16, xd * sum qx
    const float* xsum;
    // x transposed in slabs of 16 rows, [m_pad / 16][k][16] with rows past m zero (m_pad a
    // multiple of 16), for the panel products of larger batches (vector paths); null below
    // Kernels::panel_min_rows rows. A slab is contiguous, so a product walks it in order (a plain
    // [k][m_pad] transpose strode by m_pad: at m = 512 a power-of-two stride, and cache conflicts).
    // m_pad may be less than m: the rows from m_pad are then multiplied in row tiles (with xsum
    // for those rows).
    const float* xt = nullptr;
    int64_t m_pad = 0;
    // x rounded to int16 per block of 32 (qm_linear_q16): xq16 [m, k] and each block's scale
    // xd [m, k / 32]; null for fp32 activations
    const int16_t* xq16 = nullptr;
    const float* xd = nullptr;
    // x rounded to bf16 (qm_linear_bf16) in slabs of 16 rows with k in pairs,
    // [m_pad / 16][k / 2][16][2] (rows past m zero), and each block's sum of the rounded values
    // for every row of a slab, [m_pad / 16][k / 32][16] (zero past m); null otherwise
    const uint16_t* xbf16 = nullptr;
    const float* xbf16_sums = nullptr;
};

struct Kernels {
    void (*linear_rows)(const Job&, int64_t n0, int64_t n1);
    // The row tiles alone, whatever m (qm_linear_rows): each row of y summed in one order
    // (batch-invariant); packed and dense (kF32, kBF16) weights
    void (*fixed_rows)(const Job&, int64_t n0, int64_t n1);
    void (*dequantize_row)(int type, const uint8_t* row, int64_t k, int64_t block_bytes, float* out);
    // x as bf16 (Job::xbf16): the products, and x rounded into the slabs they read with each
    // block's sums (Job::xbf16_sums); both null without AVX512_BF16
    void (*bf16_rows)(const Job&, int64_t n0, int64_t n1);
    void (*round_to_bf16)(const float* x, int64_t m, int64_t k, uint16_t* xbf16, float* sums);
    // x [m, k] into the slabs of the panel products (Job::xt), rows past m as zeros; null where
    // larger batches are not multiplied in panels (the portable path)
    void (*to_slabs)(const float* x, int64_t m, int64_t k, float* xt);
    // From this many rows of x the panels (to_slabs) take the whole slabs of 16
    int64_t panel_min_rows;
    const char* name;
};

namespace qm_avx512_bf16 { Kernels kernels(); }
namespace qm_avx512_vnni { Kernels kernels(); }
namespace qm_avx512 { Kernels kernels(); }
namespace qm_avx2 { Kernels kernels(); }
namespace qm_portable { Kernels kernels(); }

}  // namespace qm
