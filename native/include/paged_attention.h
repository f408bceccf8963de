/*
 * One C ABI for the native attention backends (CPU and CUDA libraries export the same names
 * with a prefix: pa_cpu_* and pa_cuda_*).
 *
 * Layouts (all contiguous, checked by the Python wrappers before every call, since a raw
 * pointer carries no shape, dtype or device):
 *   query, out    [num_tokens, num_heads, head_size] in dtype (float32, bfloat16 or float16)
 *   key, value    [num_tokens, num_kv_heads, head_size]
 *   kv_cache      [2, num_blocks, block_size, num_kv_heads, row]   (K then V) in kv_dtype, a row
 *                 being head_size elements (+ a 2-byte scale for int8: see kv_dtype.h)
 *   kv_scales     NULL, or [2] float32: fp8 caches hold K / kv_scales[0] and V / kv_scales[1]
 *                 (NULL: 1.0; other dtypes ignore it)
 *   slot_mapping  [num_tokens] int64: block * block_size + offset; a negative slot is skipped
 *   query_start_loc [num_seqs + 1] int32, seq_lens [num_seqs] int32 (cached + new tokens),
 *   block_tables  [num_seqs, max_blocks_per_seq] int32
 *
 * Sequence i owns query rows query_start_loc[i] .. query_start_loc[i+1]-1, which are its
 * last tokens; each attends causally to its first seq_lens[i] tokens. GQA: query head h
 * reads KV head h / (num_heads / num_kv_heads).
 *
 * Attention parameters: scores are q.k * scale; softcap > 0 turns each into
 * softcap * tanh(score / softcap) (Gemma 2); window > 0 lets a query at position p see only
 * the keys at positions p - window < k <= p (a sliding-window layer). 0 turns either off.
 *
 * Every function returns 0 on success, or a nonzero code with a message available from
 * the library's last_error function (thread-local).
 */
#ifndef PAGED_ATTENTION_H
#define PAGED_ATTENTION_H

#include <stdint.h>

/* Raised whenever a signature or pa_shape changes: the Python side refuses a library built
 * from other sources (a stale .so would read its arguments wrongly, past buffers' ends). */
#define PA_ABI_VERSION 4

#ifdef __cplusplus
extern "C" {
#endif

enum pa_dtype { PA_FLOAT32 = 0, PA_BFLOAT16 = 1, PA_FLOAT16 = 2, PA_FP8_E4M3 = 3, PA_FP8_E5M2 = 4, PA_INT8 = 5 };

typedef struct pa_shape {
    int32_t num_tokens;
    int32_t num_seqs;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_size;
    int32_t block_size;
    int32_t num_blocks;
    int32_t max_blocks_per_seq;
    int32_t max_query_len;
    int32_t max_seq_len;
    int32_t dtype;    /* enum pa_dtype: query, out, key, value */
    int32_t kv_dtype; /* enum pa_dtype: the cache */
} pa_shape;

/* CPU library (libpa_cpu.so) */
int pa_cpu_write_kv(const pa_shape* shape, const void* key, const void* value, void* kv_cache,
                    const int64_t* slot_mapping, const float* kv_scales);
/* fixed_order != 0: every output row is summed in an order set by its own sequence and position
 * alone (batch-invariant): key ranges are never split across threads, and the keys of a block are
 * always dotted with the queries the same way, whatever else the call holds. */
int pa_cpu_attention(const pa_shape* shape, void* out, const void* query, const void* kv_cache,
                     const float* kv_scales, const int32_t* query_start_loc, const int32_t* seq_lens,
                     const int32_t* block_tables, float scale, int32_t window, float softcap,
                     int32_t fixed_order);
const char* pa_cpu_last_error(void);
int pa_cpu_abi_version(void); /* PA_ABI_VERSION of the sources it was built from */
const char* pa_cpu_isa(void); /* "avx2+fma+f16c" or "portable": the path chosen at run time */

/* Fused per-layer ops of the CPU library (float32, contiguous rows).
 * pa_cpu_rms_norm: with residual, residual += x first and the sum is normalized;
 *   out = weight * (r * 1 / sqrt(mean(r^2) + eps)) for each of `rows` rows of `hidden` values.
 * pa_cpu_rope_write_kv: qkv is [num_tokens, (num_heads + 2 num_kv_heads) * head_size] (q, k, v);
 *   the first rotary_dim values of each q and k head are rotated (non-interleaved halves) by the
 *   angles of positions[t], read from cos and sin [max_positions, rotary_dim / 2], the rest kept
 *   (a partial rotary); q goes to q_out [num_tokens, num_heads, head_size], k and v to kv_cache
 *   at slot_mapping[t] (skipped for a negative slot). */
int pa_cpu_rms_norm(float* out, float* residual, const float* x, const float* weight, int64_t rows, int64_t hidden,
                    float eps);
int pa_cpu_rope_write_kv(const pa_shape* shape, const float* qkv, const int64_t* positions, const float* cos,
                         const float* sin, int64_t max_positions, int32_t rotary_dim, float* q_out,
                         void* kv_cache, const int64_t* slot_mapping, const float* kv_scales);
/* pa_cpu_silu_mul: out[t, i] = silu(g) * u for g = gate_up[t, i], u = gate_up[t, inter + i]
 *   (SwiGLU), silu(g) = g / (1 + exp(-g)) with one exp for every CPU (the AVX2 and portable paths
 *   give the same bits). */
int pa_cpu_silu_mul(float* out, const float* gate_up, int64_t rows, int64_t inter);

/* A whole stack of Llama-shaped decoder layers in one call (float32, CPU): for each layer
 *   h = rms_norm(x + residual); q, k, v = h @ qkv (+ bias); rotary + K/V write; attention;
 *   x = attn @ o; h = rms_norm(x + residual); x = silu_mul(h @ gate_up) @ down,
 * then out = rms_norm(x + residual, final_norm): the same calls, in the same order, as the
 * per-op path (pa_cpu_rms_norm, pa_cpu_rope_write_kv, pa_cpu_attention, pa_cpu_silu_mul and the
 * packed library's product `linear`), so the result is the same bits, without a return to the
 * caller between ops. x [num_tokens, hidden] is the embedded input (overwritten); residual
 * [num_tokens, hidden] scratch; out [num_tokens, hidden]. A product's failure returns 2 (its
 * message is the packed library's last error); anything else 1. pa_linear_fn is the type of
 * quant_matmul.h's qm_linear (layer_ops.cpp checks that at compile time). */
typedef int (*pa_linear_fn)(int type, const void* w, int64_t n, int64_t k, const float* x, int64_t m, float* y,
                            int isa);
typedef struct pa_product {
    const void* weight; /* in the packed library's layout for `type` */
    const float* bias;  /* [n] or NULL */
    int64_t n, k;
    int32_t type;
} pa_product;
typedef struct pa_decoder_layer {
    pa_product qkv, o, gate_up, down;
    const float* input_norm; /* [hidden] */
    const float* mlp_norm;   /* [hidden] */
    void* kv_cache;
    const float* kv_scales;  /* NULL: 1.0 */
    int32_t window;          /* 0: none */
} pa_decoder_layer;
typedef struct pa_decoder_step {
    const int64_t* positions;
    const float* cos;
    const float* sin;
    int64_t max_positions;
    int32_t rotary_dim;
    const int64_t* slot_mapping;
    const int32_t* query_start_loc;
    const int32_t* seq_lens;
    const int32_t* block_tables;
    float scale;
    float softcap; /* 0: none */
    float eps;
    int32_t fixed_order;
    pa_linear_fn linear; /* one of the packed library's products (qm_linear, qm_linear_q16, ...) */
    int32_t isa;         /* its isa argument */
} pa_decoder_step;
int pa_cpu_decoder_layers(const pa_shape* shape, const pa_decoder_step* step, const pa_decoder_layer* layers,
                          int32_t num_layers, int64_t hidden, const float* final_norm, float* x, float* residual,
                          float* out);

/* CUDA library (libpa_cuda.so); pointers are device pointers, stream a cudaStream_t */
int pa_cuda_write_kv(const pa_shape* shape, const void* key, const void* value, void* kv_cache,
                     const int64_t* slot_mapping, const float* kv_scales, void* stream);
int pa_cuda_attention(const pa_shape* shape, void* out, const void* query, const void* kv_cache,
                      const float* kv_scales, const int32_t* query_start_loc, const int32_t* seq_lens, const int32_t* block_tables,
                      float scale, int32_t window, float softcap, void* workspace, int64_t workspace_bytes,
                      void* stream);
int64_t pa_cuda_workspace_bytes(const pa_shape* shape);
const char* pa_cuda_last_error(void);
int pa_cuda_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* PAGED_ATTENTION_H */
