// Paged attention on NVIDIA GPUs: varlen (prefill, decode, mixed), GQA-grouped, split-KV
// partitions with a log-sum-exp reduce, fp32 / bf16 / fp16, plus the cache write.
//
// attention_kernel: one CTA per (KV head, query token, key partition). Its warps stride
// over the partition's keys; the 32 lanes of a warp split the head dimension, so each K/V
// row is read once per CTA and serves every query head of the GQA group. Each warp keeps
// an online-softmax state per query head; the warps are merged in shared memory. With
// several partitions the CTA writes (max, sum, acc) to the workspace and reduce_kernel
// combines them; with one it writes the output directly.
//
// Every launch is on the caller's stream and is followed by cudaGetLastError.

#include "paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace {

thread_local std::string g_last_error;

int fail(const std::string& message) {
    g_last_error = message;
    return 1;
}

int check_launch(const char* what) {
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail(std::string(what) + ": " + cudaGetErrorString(err));
    return 0;
}

constexpr int kNumWarps = 4;
constexpr int kMaxGroup = 8;           // query heads per KV head handled by one CTA
constexpr int kPartitionSize = 512;    // keys per split-KV partition

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

struct Dims {
    int num_seqs, num_heads, num_kv_heads, group, block_size, max_blocks_per_seq, num_partitions;
    int64_t kv_half;  // elements of K (== of V) in the cache
};

template <typename T>
__global__ void write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ kv_cache,
                                const int64_t* __restrict__ slot_mapping, int64_t row, int64_t kv_half) {
    const int64_t token = blockIdx.x;
    const int64_t slot = slot_mapping[token];
    if (slot < 0) return;
    for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
        kv_cache[slot * row + i] = key[token * row + i];
        kv_cache[kv_half + slot * row + i] = value[token * row + i];
    }
}

template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(kNumWarps * 32)
attention_kernel(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ kv_cache,
                 const int32_t* __restrict__ qsl, const int32_t* __restrict__ seq_lens,
                 const int32_t* __restrict__ block_tables, float* __restrict__ workspace, float scale, Dims d) {
    constexpr int PER_LANE = HEAD_SIZE / 32;
    const int kv_head = blockIdx.x, token = blockIdx.y, part = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    int lo = 0, hi = d.num_seqs - 1;  // the sequence owning this query row
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (qsl[mid] <= token) lo = mid; else hi = mid - 1;
    }
    const int seq = lo;
    const int q_len = qsl[seq + 1] - qsl[seq];
    const int visible = seq_lens[seq] - q_len + (token - qsl[seq]) + 1;  // causal: keys [0, visible)
    const int k_begin = part * kPartitionSize;
    const int k_end = min(visible, k_begin + kPartitionSize);

    float q[kMaxGroup][PER_LANE], acc[kMaxGroup][PER_LANE], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            acc[g][e] = 0.f;
            q[g][e] = g < d.group
                ? to_float(query[((int64_t)token * d.num_heads + kv_head * d.group + g) * HEAD_SIZE + lane * PER_LANE + e]) * scale
                : 0.f;
        }
    }
    const int32_t* table = block_tables + (int64_t)seq * d.max_blocks_per_seq;
    for (int j = k_begin + warp; j < k_end; j += kNumWarps) {
        const int64_t block = table[j / d.block_size];
        const int64_t base = ((block * d.block_size + j % d.block_size) * d.num_kv_heads + kv_head) * HEAD_SIZE + lane * PER_LANE;
        float k[PER_LANE], v[PER_LANE];
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {
            k[e] = to_float(kv_cache[base + e]);
            v[e] = to_float(kv_cache[d.kv_half + base + e]);
        }
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g >= d.group) break;
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < PER_LANE; ++e) s += q[g][e] * k[e];
            s = warp_sum(s);
            const float m_new = fmaxf(m[g], s);
            const float correction = __expf(m[g] - m_new);
            const float p = __expf(s - m_new);
            l[g] = l[g] * correction + p;
#pragma unroll
            for (int e = 0; e < PER_LANE; ++e) acc[g][e] = acc[g][e] * correction + p * v[e];
            m[g] = m_new;
        }
    }

    __shared__ float s_m[kNumWarps][kMaxGroup], s_l[kNumWarps][kMaxGroup];
    __shared__ float s_acc[kNumWarps][kMaxGroup][HEAD_SIZE];
    for (int g = 0; g < d.group; ++g) {
        if (lane == 0) {
            s_m[warp][g] = m[g];
            s_l[warp][g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) s_acc[warp][g][lane * PER_LANE + e] = acc[g][e];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < d.group * HEAD_SIZE; idx += blockDim.x) {
        const int g = idx / HEAD_SIZE, dim = idx % HEAD_SIZE;
        float m_all = -INFINITY;
        for (int w = 0; w < kNumWarps; ++w) m_all = fmaxf(m_all, s_m[w][g]);
        float l_all = 0.f, a_all = 0.f;
        if (m_all != -INFINITY) {
            for (int w = 0; w < kNumWarps; ++w) {
                const float weight = __expf(s_m[w][g] - m_all);
                l_all += s_l[w][g] * weight;
                a_all += s_acc[w][g][dim] * weight;
            }
        }
        const int head = kv_head * d.group + g;
        if (d.num_partitions == 1) {
            out[((int64_t)token * d.num_heads + head) * HEAD_SIZE + dim] = from_float<T>(l_all > 0.f ? a_all / l_all : 0.f);
        } else {
            float* part_out = workspace + (((int64_t)token * d.num_heads + head) * d.num_partitions + part) * (HEAD_SIZE + 2);
            if (dim == 0) {
                part_out[0] = m_all;
                part_out[1] = l_all;
            }
            part_out[2 + dim] = a_all;
        }
    }
}

template <typename T, int HEAD_SIZE>
__global__ void reduce_kernel(T* __restrict__ out, const float* __restrict__ workspace, int num_heads, int num_partitions) {
    const int64_t row = (int64_t)blockIdx.x * num_heads + blockIdx.y;  // (token, head)
    const float* parts = workspace + row * num_partitions * (HEAD_SIZE + 2);
    const int dim = threadIdx.x;
    float m_all = -INFINITY;
    for (int p = 0; p < num_partitions; ++p) m_all = fmaxf(m_all, parts[p * (HEAD_SIZE + 2)]);
    float l_all = 0.f, a_all = 0.f;
    if (m_all != -INFINITY) {
        for (int p = 0; p < num_partitions; ++p) {
            const float* part = parts + p * (HEAD_SIZE + 2);
            const float weight = __expf(part[0] - m_all);
            l_all += part[1] * weight;
            a_all += part[2 + dim] * weight;
        }
    }
    out[row * HEAD_SIZE + dim] = from_float<T>(l_all > 0.f ? a_all / l_all : 0.f);
}

int num_partitions(const pa_shape* s) { return (s->max_seq_len + kPartitionSize - 1) / kPartitionSize; }

template <typename T, int HEAD_SIZE>
int launch_attention(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                     const int32_t* seq_lens, const int32_t* block_tables, float scale, void* workspace,
                     cudaStream_t stream) {
    Dims d{s->num_seqs, s->num_heads, s->num_kv_heads, s->num_heads / s->num_kv_heads, s->block_size,
           s->max_blocks_per_seq, num_partitions(s),
           (int64_t)s->num_blocks * s->block_size * s->num_kv_heads * s->head_size};
    dim3 grid(s->num_kv_heads, s->num_tokens, d.num_partitions);
    attention_kernel<T, HEAD_SIZE><<<grid, kNumWarps * 32, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(query), static_cast<const T*>(kv_cache), qsl, seq_lens,
        block_tables, static_cast<float*>(workspace), scale, d);
    if (int rc = check_launch("attention_kernel")) return rc;
    if (d.num_partitions > 1) {
        reduce_kernel<T, HEAD_SIZE><<<dim3(s->num_tokens, s->num_heads), HEAD_SIZE, 0, stream>>>(
            static_cast<T*>(out), static_cast<const float*>(workspace), s->num_heads, d.num_partitions);
        if (int rc = check_launch("reduce_kernel")) return rc;
    }
    return 0;
}

template <typename T>
int dispatch_head_size(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                       const int32_t* seq_lens, const int32_t* block_tables, float scale, void* workspace,
                       cudaStream_t stream) {
    switch (s->head_size) {
        case 64: return launch_attention<T, 64>(s, out, query, kv_cache, qsl, seq_lens, block_tables, scale, workspace, stream);
        case 128: return launch_attention<T, 128>(s, out, query, kv_cache, qsl, seq_lens, block_tables, scale, workspace, stream);
        case 256: return launch_attention<T, 256>(s, out, query, kv_cache, qsl, seq_lens, block_tables, scale, workspace, stream);
        default: return fail("the CUDA library supports head sizes 64, 128 and 256; got " + std::to_string(s->head_size));
    }
}

int check_shape(const pa_shape* s) {
    if (s == nullptr) return fail("shape is null");
    if (s->num_kv_heads <= 0 || s->num_heads % s->num_kv_heads != 0) return fail("num_heads must be a multiple of num_kv_heads");
    if (s->num_heads / s->num_kv_heads > kMaxGroup) return fail("GQA groups larger than 8 query heads per KV head are not supported");
    if (s->dtype < PA_FLOAT32 || s->dtype > PA_FLOAT16) return fail("unknown dtype");
    return 0;
}

}  // namespace

extern "C" {

const char* pa_cuda_last_error(void) { return g_last_error.c_str(); }

int64_t pa_cuda_workspace_bytes(const pa_shape* s) {
    const int parts = num_partitions(s);
    if (parts <= 1) return 0;
    return (int64_t)s->num_tokens * s->num_heads * parts * (s->head_size + 2) * (int64_t)sizeof(float);
}

int pa_cuda_write_kv(const pa_shape* s, const void* key, const void* value, void* kv_cache, const int64_t* slot_mapping,
                     void* stream) {
    if (int rc = check_shape(s)) return rc;
    if (s->num_tokens == 0) return 0;
    const int64_t row = (int64_t)s->num_kv_heads * s->head_size;
    const int64_t kv_half = (int64_t)s->num_blocks * s->block_size * row;
    const int threads = row < 1024 ? (int)row : 1024;
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    switch (s->dtype) {
        case PA_FLOAT32:
            write_kv_kernel<float><<<s->num_tokens, threads, 0, st>>>(static_cast<const float*>(key), static_cast<const float*>(value),
                                                                      static_cast<float*>(kv_cache), slot_mapping, row, kv_half);
            break;
        case PA_BFLOAT16:
            write_kv_kernel<__nv_bfloat16><<<s->num_tokens, threads, 0, st>>>(
                static_cast<const __nv_bfloat16*>(key), static_cast<const __nv_bfloat16*>(value),
                static_cast<__nv_bfloat16*>(kv_cache), slot_mapping, row, kv_half);
            break;
        default:
            write_kv_kernel<__half><<<s->num_tokens, threads, 0, st>>>(static_cast<const __half*>(key), static_cast<const __half*>(value),
                                                                       static_cast<__half*>(kv_cache), slot_mapping, row, kv_half);
    }
    return check_launch("write_kv_kernel");
}

int pa_cuda_attention(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                      const int32_t* seq_lens, const int32_t* block_tables, float scale, void* workspace,
                      int64_t workspace_bytes, void* stream) {
    if (int rc = check_shape(s)) return rc;
    if (s->num_tokens == 0) return 0;
    if (workspace_bytes < pa_cuda_workspace_bytes(s)) return fail("workspace too small");
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    switch (s->dtype) {
        case PA_FLOAT32: return dispatch_head_size<float>(s, out, query, kv_cache, qsl, seq_lens, block_tables, scale, workspace, st);
        case PA_BFLOAT16: return dispatch_head_size<__nv_bfloat16>(s, out, query, kv_cache, qsl, seq_lens, block_tables, scale, workspace, st);
        default: return dispatch_head_size<__half>(s, out, query, kv_cache, qsl, seq_lens, block_tables, scale, workspace, st);
    }
}

}  // extern "C"
