/* Matrix products with weights kept in GGUF's packed block formats (CPU).
 *
 * A packed weight is N rows of K values; each row is K / 32 blocks laid out as in GGUF/ggml:
 *   Q4_0 (type 2): fp16 d, 16 bytes of nibbles             -> value = (q - 8) * d   (18 bytes)
 *   Q4_1 (type 3): fp16 d, fp16 m, 16 bytes of nibbles     -> value = q * d + m     (20 bytes)
 *   Q8_0 (type 8): fp16 d, 32 int8                         -> value = q * d         (34 bytes)
 *   Q8_M (type 100, not a GGUF type): fp16 d, fp16 m, 32 uint8 -> value = q * d + m (36 bytes);
 *        what --quantization int8 makes at load (a scale and a minimum per 32 values)
 * In a nibble block, byte j holds value j (low nibble) and value j + 16 (high nibble).
 *
 * Activations and results are fp32, row-major and contiguous. Every call returns 0, or 1
 * with a message for qm_last_error(). isa: 0 = the best this CPU runs (capped by QM_CPU_ISA in
 * the environment), 1 = portable, 2 = AVX2+FMA, 3 = AVX-512 (F/BW/VL/DQ), 4 = AVX-512 with VNNI,
 * 5 = AVX-512 with VNNI and BF16.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* y[m, n] = sum_k x[m, k] * W[n, k]: each packed block is read once per call and used for all
 * M rows of x (for small M: decode). */
int qm_linear(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int isa);

/* qm_linear with x rounded to int16 per block of 32 values (scale max|x| / 32767, to nearest,
 * ties to even): y[m, n] = sum over blocks of d_w * d_x * (integer dot product) + the weight
 * block's offset * d_x * sum(q_x). Faster for a few rows; differs from qm_linear by x's
 * rounding, at most 1.5e-5 of each block's largest value (--activation-quantization int16). */
int qm_linear_q16(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int isa);

/* qm_linear with x rounded to bf16 (to nearest, ties to even) and multiplied by bf16 dot products
 * with fp32 sums: the weights' quantized values are exact in bf16, so y differs from qm_linear by
 * x's rounding alone (relative 2^-9 per value). For batches of 16 rows or more, where the
 * products are compute-bound (--activation-quantization bf16). Needs AVX512_BF16 (isa 0 or 5). */
int qm_linear_bf16(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int isa);

/* qm_linear with every row of y summed in one order, whatever m and the other rows of x
 * (batch-invariant: the folded row tiles, qm_linear's below 5 rows with AVX2 (1 row with
 * AVX-512), at every m; never the dequantized tiles or the panels). Also takes plain weights,
 * type 0 (F32: rows of k floats) and 30 (BF16: rows of k bfloat16 values). */
int qm_linear_rows(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t m, float *y, int isa);

/* out[i, :] = W[rows[i], :] as fp32 (an embedding lookup). */
int qm_dequantize_rows(int type, const void *w, int64_t k, const int64_t *rows, int64_t count, float *out, int isa);

/* out[r - row_begin, :] = W[r, :] for row_begin <= r < row_end (a tile for a GEMM). */
int qm_dequantize_range(int type, const void *w, int64_t k, int64_t row_begin, int64_t row_end, float *out,
                        int isa);

/* Bytes of one packed row of k values (0 for an unknown type or a k that is not whole blocks). */
int64_t qm_row_bytes(int type, int64_t k);

/* The vector path isa 0 picks on this CPU ("avx512+vnni+bf16", "avx512+vnni", "avx512", "avx2+fma"
 * or "portable");
 * whether an isa runs here. */
const char *qm_isa(void);
int qm_isa_supported(int isa);
const char *qm_last_error(void);

/* The CUDA library (libqm_cuda.so, native/cuda/quant_matmul.cu): pointers are device pointers,
 * stream a cudaStream_t; x, y and out in dtype 0 = float32, 1 = bfloat16, 2 = float16 (fp32 sums).
 * qm_cuda_linear: y[m, n] = x[m, k] @ W.T, reading each block once per 8 rows of x (small m).
 * qm_cuda_dequantize: out[r - row_begin, :] = W[r, :] for a GEMM (large m). */
int qm_cuda_linear(int type, const void *w, int64_t n, int64_t k, const void *x, int64_t m, void *y, int dtype,
                   void *stream);
int qm_cuda_dequantize(int type, const void *w, int64_t k, int64_t row_begin, int64_t row_end, void *out, int dtype,
                       void *stream);
const char *qm_cuda_last_error(void);

#ifdef __cplusplus
}
#endif
