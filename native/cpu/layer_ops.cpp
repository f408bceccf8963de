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
#include <new>
#include <type_traits>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(PA_NO_AVX2)
#define PA_X86 1
#include <immintrin.h>
#endif

#include "kernel.h"
#include "quant_matmul.h"

static_assert(std::is_same<decltype(&qm_linear), pa_linear_fn>::value, "pa_linear_fn must be qm_linear's type");

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

// exp for silu, the same bits on every path: Cody-Waite range reduction (x = n ln2 + r, |r| <=
// ln2 / 2) and a degree-6 polynomial for e^r (Cephes' expf coefficients), then times 2 * 2^(n-1)
// (2^n itself overflows the exponent field at n = 128, which x up to ln(FLT_MAX) reaches). Only
// multiplies and adds, each rounded (-ffp-contract=off), so the scalar and the AVX2 versions
// below agree bit for bit. Within a few ulp of the exact value on [-87.3, ln(FLT_MAX)]; below,
// the value at -87.3 (silu(g) = g there to float precision); above, infinity, as expf overflows
// (silu(g) = -0 for g < -88.72, as torch's).
constexpr float kExpLo = -87.3f, kExpOverflow = 88.72283935546875f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_scalar(float x) {
    if (x > kExpOverflow) return INFINITY;
    x = x < kExpLo ? kExpLo : x;
    const float n = std::floor(x * kLog2e + 0.5f);
    const float r = (x - n * kLn2Hi) - n * kLn2Lo;
    float p = kP[0];
    for (int i = 1; i < 6; ++i) p = p * r + kP[i];
    const float y = (p * (r * r) + r) + 1.f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) - 1 + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return (y + y) * scale;
}

inline float silu_scalar(float g) { return g / (1.f + exp_scalar(-g)); }

#if PA_X86
__attribute__((target("avx2"))) inline __m256 exp8(__m256 x) {
    const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpOverflow), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpOverflow));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(0.5f)));
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
    __m256 p = _mm256_set1_ps(kP[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP[i]));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(_mm256_add_ps(y, y), _mm256_castsi256_ps(bits)), _mm256_set1_ps(INFINITY),
                            overflow);
}

// The first n - n % 8 values; returns how many.
__attribute__((target("avx2"))) int64_t silu_mul_avx2(float* out, const float* g, const float* u, int64_t n) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    return i;
}

const bool kHaveAvx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
}();
#endif

void silu_mul_row(float* out, const float* g, const float* u, int64_t n) {
    int64_t i = 0;
#if PA_X86
    if (kHaveAvx2) i = silu_mul_avx2(out, g, u, n);
#endif
    for (; i < n; ++i) out[i] = silu_scalar(g[i]) * u[i];
}

int silu_mul(float* out, const float* gate_up, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * inter)) if (rows * inter >= 2 * kMinFloatsPerThread)
    for (int64_t t = 0; t < rows; ++t) silu_mul_row(out + t * inter, gate_up + t * 2 * inter, gate_up + t * 2 * inter + inter, inter);
    return 0;
}

// One product of the stack: y = x @ W.T (+ bias), through the packed library.
int product(const pa_decoder_step& step, const pa_product& p, const float* x, int64_t m, float* y) {
    if (step.linear(p.type, p.weight, p.n, p.k, x, m, y, step.isa) != 0) return 2;
    if (p.bias != nullptr)
        for (int64_t t = 0; t < m; ++t)
            for (int64_t i = 0; i < p.n; ++i) y[t * p.n + i] += p.bias[i];
    return 0;
}

int decoder_layers(const pa_shape* s, const pa_decoder_step* step, const pa_decoder_layer* layers,
                   int32_t num_layers, int64_t hidden, const float* final_norm, float* x, float* residual,
                   float* out) {
    const int64_t T = s->num_tokens, D = s->head_size, H = s->num_heads, KV = s->num_kv_heads;
    if (num_layers <= 0 || T <= 0 || hidden <= 0 || step->linear == nullptr)
        return pa::report_error("decoder_layers: nothing to run");
    const int64_t qkv_n = (H + 2 * KV) * D;
    int64_t inter_max = 0;
    for (int32_t i = 0; i < num_layers; ++i) {
        const pa_decoder_layer& l = layers[i];
        if (l.qkv.k != hidden || l.qkv.n != qkv_n || l.o.k != H * D || l.o.n != hidden || l.gate_up.k != hidden ||
            l.gate_up.n % 2 || l.down.k != l.gate_up.n / 2 || l.down.n != hidden)
            return pa::report_error("decoder_layers: a layer's products do not chain (hidden, heads, intermediate)");
        inter_max = std::max<int64_t>(inter_max, l.down.k);
    }
    // Scratch per call: h (normed), qkv, q, the attention's output, gate_up, the activation.
    std::vector<float> h(T * hidden), qkv(T * qkv_n), q(T * H * D), attn(T * H * D), gate_up(T * 2 * inter_max),
        act(T * inter_max);
    for (int32_t i = 0; i < num_layers; ++i) {
        const pa_decoder_layer& l = layers[i];
        const int64_t inter = l.down.k;
        int rc;
        if (i == 0) {  // the residual stream starts as the embedded input
            std::memcpy(residual, x, T * hidden * sizeof(float));
            rc = pa_cpu_rms_norm(h.data(), nullptr, residual, l.input_norm, T, hidden, step->eps);
        } else {
            rc = pa_cpu_rms_norm(h.data(), residual, x, l.input_norm, T, hidden, step->eps);
        }
        if (rc == 0) rc = product(*step, l.qkv, h.data(), T, qkv.data());
        if (rc == 0)
            rc = pa_cpu_rope_write_kv(s, qkv.data(), step->positions, step->cos, step->sin, step->max_positions,
                                      step->rotary_dim, q.data(), l.kv_cache, step->slot_mapping, l.kv_scales);
        if (rc == 0)
            rc = pa_cpu_attention(s, attn.data(), q.data(), l.kv_cache, l.kv_scales, step->query_start_loc,
                                  step->seq_lens, step->block_tables, step->scale, l.window, step->softcap,
                                  step->fixed_order);
        if (rc == 0) rc = product(*step, l.o, attn.data(), T, x);
        if (rc == 0) rc = pa_cpu_rms_norm(h.data(), residual, x, l.mlp_norm, T, hidden, step->eps);
        if (rc == 0) rc = product(*step, l.gate_up, h.data(), T, gate_up.data());
        if (rc == 0) rc = silu_mul(act.data(), gate_up.data(), T, inter);
        if (rc == 0) rc = product(*step, l.down, act.data(), T, x);
        if (rc != 0) return rc;
    }
    return pa_cpu_rms_norm(out, residual, x, final_norm, T, hidden, step->eps);
}

}  // namespace

extern "C" {

int pa_cpu_silu_mul(float* out, const float* gate_up, int64_t rows, int64_t inter) {
    if (rows < 0 || inter <= 0) return pa::report_error("silu_mul needs rows >= 0 and inter > 0");
    return silu_mul(out, gate_up, rows, inter);
}

int pa_cpu_decoder_layers(const pa_shape* s, const pa_decoder_step* step, const pa_decoder_layer* layers,
                          int32_t num_layers, int64_t hidden, const float* final_norm, float* x, float* residual,
                          float* out) {
    try {
        return decoder_layers(s, step, layers, num_layers, hidden, final_norm, x, residual, out);
    } catch (const std::bad_alloc&) {
        return pa::report_error("decoder_layers: out of memory for its scratch");
    }
}

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
