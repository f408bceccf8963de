// Paged attention on NVIDIA GPUs: varlen (prefill, decode, mixed), GQA-grouped, split-KV
// partitions with a log-sum-exp reduce, fp32 / bf16 / fp16, plus the cache write. The cache
// holds the model's dtype or fp8 (e4m3, e5m2: x / the layer's scale, kv_dtype.h's conversions).
//
// attention_kernel: one CTA per (query token, KV head, key partition), for all query heads of
// the GQA group, so each K/V row is read once per CTA. Lanes load 16 bytes at a time; a few
// lanes cover a row and a warp reads several rows per step (see RowSplit). Partitions are
// 128-512 keys (more of them when the batch is small); their (max, sum, acc) partials are
// combined by reduce_kernel. Prefill and mixed batches use the same kernel: a query token
// sees its sequence's keys up to its own position (in a sliding-window layer, only the last
// `window` of them); Gemma 2's soft-cap bends each score with tanh before the softmax.
//
// Every launch is on the caller's stream and is followed by cudaGetLastError. The same
// source compiles for the host with PA_CUDA_HOST_EMULATION, which is how CI runs it.

#include "paged_attention.h"
#include "kv_dtype.h"
#include "launch.h"

#include <cstdint>
#include <string>

namespace {

constexpr int kNumWarps = 4;
constexpr int kMaxGroup = 8;  // query heads per KV head handled by one CTA
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

// The fp8 cache elements (one byte; see kv_dtype.h), converted by the same functions as the
// CPU library's, so both store the same bits.
struct fp8_e4m3 { uint8_t bits; };
struct fp8_e5m2 { uint8_t bits; };
template <> __device__ __forceinline__ fp8_e4m3 from_float<fp8_e4m3>(float v) { return {pa_kv::float_to_e4m3(v)}; }
template <> __device__ __forceinline__ fp8_e5m2 from_float<fp8_e5m2>(float v) { return {pa_kv::float_to_e5m2(v)}; }

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename C> struct IsFp8 { static constexpr bool value = false; };
template <> struct IsFp8<fp8_e4m3> { static constexpr bool value = true; };
template <> struct IsFp8<fp8_e5m2> { static constexpr bool value = true; };

// How a warp covers K/V rows: every lane loads 16 bytes at a time (8 for one-byte fp8, so
// that a warp holds as many rows as for bf16 and the merge's shared memory stays the same),
// so a row of HEAD_SIZE elements takes LANES_PER_KEY lanes and one warp reads KEYS_PER_WARP
// rows per step (four 128-byte bf16 rows at head size 64), which keeps many loads in flight.
template <typename T, int HEAD_SIZE>
struct RowSplit {
    static constexpr int LOAD_BYTES = sizeof(T) == 1 ? 8 : 16;
    static constexpr int VEC = LOAD_BYTES / sizeof(T);  // elements per load
    static_assert(HEAD_SIZE % VEC == 0, "rows must be whole vectors");
    static constexpr int LANES_PER_KEY = HEAD_SIZE / VEC < 32 ? HEAD_SIZE / VEC : 32;
    static constexpr int VECS_PER_LANE = HEAD_SIZE / (VEC * LANES_PER_KEY);
    static constexpr int ELEMS = VEC * VECS_PER_LANE;  // row elements held by one lane
    static constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
    // Row element held at position e of lane `slice` (consecutive lanes read consecutive vectors).
    static __device__ __forceinline__ int dim(int slice, int e) { return ((e / VEC) * LANES_PER_KEY + slice) * VEC + e % VEC; }
};

__device__ __forceinline__ unsigned word(const uint4& raw, int i) {
    return i == 0 ? raw.x : i == 1 ? raw.y : i == 2 ? raw.z : raw.w;
}

// Element i of a 16-byte vector as a float, from its bits (no type punning through pointers).
template <typename T> __device__ __forceinline__ float unpack(const uint4& raw, int i);
template <> __device__ __forceinline__ float unpack<float>(const uint4& raw, int i) { return __uint_as_float(word(raw, i)); }
template <> __device__ __forceinline__ float unpack<__nv_bfloat16>(const uint4& raw, int i) {
    const unsigned w = word(raw, i / 2);
    return __uint_as_float(i % 2 == 0 ? w << 16 : w & 0xffff0000u);
}
template <> __device__ __forceinline__ float unpack<__half>(const uint4& raw, int i) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(word(raw, i / 2) >> (16 * (i % 2)))));
}
__device__ __forceinline__ uint8_t byte_of(const uint4& raw, int i) {
    return static_cast<uint8_t>(word(raw, i / 4) >> (8 * (i % 4)));
}
template <> __device__ __forceinline__ float unpack<fp8_e4m3>(const uint4& raw, int i) {
    return pa_kv::e4m3_to_float(byte_of(raw, i));
}
template <> __device__ __forceinline__ float unpack<fp8_e5m2>(const uint4& raw, int i) {
    return pa_kv::e5m2_to_float(byte_of(raw, i));
}

// This lane's vectors of a row (the raw bits, in the low bytes of a uint4; see RowSplit for
// which ones).
template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void fetch_slice(const T* row, int slice, uint4 (&raw)[RowSplit<T, HEAD_SIZE>::VECS_PER_LANE]) {
    using S = RowSplit<T, HEAD_SIZE>;
#pragma unroll
    for (int v = 0; v < S::VECS_PER_LANE; ++v) {
        const T* at = row + (v * S::LANES_PER_KEY + slice) * S::VEC;
        if constexpr (S::LOAD_BYTES == 16) {
            const uint4* src = reinterpret_cast<const uint4*>(at);
#ifdef PA_CUDA_HOST_EMULATION
            pa_emu::check_aligned(src, "fetch_slice");
#endif
            raw[v] = *src;
        } else {
            const uint2* src = reinterpret_cast<const uint2*>(at);
#ifdef PA_CUDA_HOST_EMULATION
            pa_emu::check_aligned(src, "fetch_slice");
#endif
            const uint2 half = *src;
            raw[v] = make_uint4(half.x, half.y, 0, 0);
        }
    }
}

template <typename T, int HEAD_SIZE>
__device__ __forceinline__ void unpack_slice(const uint4 (&raw)[RowSplit<T, HEAD_SIZE>::VECS_PER_LANE],
                                             float (&dst)[RowSplit<T, HEAD_SIZE>::ELEMS]) {
    using S = RowSplit<T, HEAD_SIZE>;
#pragma unroll
    for (int v = 0; v < S::VECS_PER_LANE; ++v) {
#pragma unroll
        for (int i = 0; i < S::VEC; ++i) dst[v * S::VEC + i] = unpack<T>(raw[v], i);
    }
}

// What a layer asks of its attention (see paged_attention.h): score scale, tanh soft-cap, window.
struct Params {
    float scale, softcap;     // softcap 0: none
    int window;               // 0: none
    const float* kv_scales;   // an fp8 cache's K and V scales (device memory), or null: 1.0
};

struct Dims {
    int num_seqs, num_heads, num_kv_heads, block_size, max_blocks_per_seq, num_partitions, partition_size;
    int64_t kv_half;  // elements of K (== of V) in the cache
};

// The cache write: rows of T stored as C (the same type, or fp8 of x / the layer's scale).
template <typename T, typename C>
__global__ void write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value, C* __restrict__ kv_cache,
                                const int64_t* __restrict__ slot_mapping, const float* __restrict__ kv_scales,
                                int64_t row, int64_t kv_half) {
    const int64_t token = blockIdx.x;
    const int64_t slot = slot_mapping[token];
    if (slot < 0) return;
    if constexpr (IsFp8<C>::value) {
        const float inv_k = kv_scales != nullptr ? 1.f / kv_scales[0] : 1.f;
        const float inv_v = kv_scales != nullptr ? 1.f / kv_scales[1] : 1.f;
        for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
            kv_cache[slot * row + i] = from_float<C>(to_float<T>(key[token * row + i]) * inv_k);
            kv_cache[kv_half + slot * row + i] = from_float<C>(to_float<T>(value[token * row + i]) * inv_v);
        }
    } else {
        for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
            kv_cache[slot * row + i] = key[token * row + i];
            kv_cache[kv_half + slot * row + i] = value[token * row + i];
        }
    }
}

// One CTA per (query token, KV head, key partition), for the GROUP query heads sharing that
// KV head. Lanes form groups of LANES_PER_KEY; each group walks its own keys with an online
// softmax per query head, so every K/V row is read once per CTA. The groups' states are
// merged through shared memory; with several partitions the CTA writes (max, sum, acc) to the
// workspace for reduce_kernel, with one it writes the output.
template <typename T, typename C, int HEAD_SIZE, int GROUP>
__global__ void __launch_bounds__(kNumWarps * 32)
attention_kernel(T* __restrict__ out, const T* __restrict__ query, const C* __restrict__ kv_cache,
                 const int32_t* __restrict__ qsl, const int32_t* __restrict__ seq_lens,
                 const int32_t* __restrict__ block_tables, float* __restrict__ workspace, Params params, Dims d) {
    using S = RowSplit<C, HEAD_SIZE>;  // how lanes split the cache's rows (and so the query's dimensions)
    constexpr int NUM_STATES = kNumWarps * S::KEYS_PER_WARP;  // lane groups per CTA
    const int token = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slice = lane % S::LANES_PER_KEY;       // which 16-byte vectors of a row
    const int state = warp * S::KEYS_PER_WARP + lane / S::LANES_PER_KEY;  // this lane group

    int lo = 0, hi = d.num_seqs - 1;  // the sequence owning this query row
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (qsl[mid] <= token) lo = mid; else hi = mid - 1;
    }
    const int seq = lo;
    const int q_len = qsl[seq + 1] - qsl[seq];
    const int visible = seq_lens[seq] - q_len + (token - qsl[seq]) + 1;  // causal: keys [0, visible)
    // A window shifts the partitions to start at its first key (the last ones are then empty).
    const int first = params.window > 0 ? max(0, visible - params.window) : 0;
    const int k_begin = first + part * d.partition_size;
    const int k_end = min(visible, k_begin + d.partition_size);

    // An fp8 cache's K scale joins the score scale; its V scale multiplies the result.
    const float k_scale = IsFp8<C>::value && params.kv_scales != nullptr ? params.kv_scales[0] : 1.f;
    const float v_scale = IsFp8<C>::value && params.kv_scales != nullptr ? params.kv_scales[1] : 1.f;
    float q[GROUP][S::ELEMS], acc[GROUP][S::ELEMS], m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const T* q_row = query + ((int64_t)token * d.num_heads + kv_head * GROUP + g) * HEAD_SIZE;
        if constexpr (sizeof(C) == sizeof(T)) {  // the query's rows split as the cache's: 16-byte loads
            uint4 raw[S::VECS_PER_LANE];
            fetch_slice<T, HEAD_SIZE>(q_row, slice, raw);
            unpack_slice<T, HEAD_SIZE>(raw, q[g]);
        } else {  // (once per CTA) the dimensions this lane holds of the cache's rows
#pragma unroll
            for (int e = 0; e < S::ELEMS; ++e) q[g][e] = to_float<T>(q_row[S::dim(slice, e)]);
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < S::ELEMS; ++e) {
            q[g][e] *= params.scale * k_scale;
            acc[g][e] = 0.f;
        }
    }

    const int32_t* table = block_tables + (int64_t)seq * d.max_blocks_per_seq;
    // This lane group's K and V vectors of key j, or zeros past the partition's end.
    uint4 k_raw[S::VECS_PER_LANE], v_raw[S::VECS_PER_LANE];
    auto fetch_key = [&](int j) {
        if (j < k_end) {
            const int64_t block = table[j / d.block_size];
            const C* k_row = kv_cache + ((block * d.block_size + j % d.block_size) * d.num_kv_heads + kv_head) * HEAD_SIZE;
            fetch_slice<C, HEAD_SIZE>(k_row, slice, k_raw);
            fetch_slice<C, HEAD_SIZE>(k_row + d.kv_half, slice, v_raw);
        } else {
#pragma unroll
            for (int v = 0; v < S::VECS_PER_LANE; ++v) k_raw[v] = v_raw[v] = make_uint4(0, 0, 0, 0);
        }
    };
    // Every lane of a warp runs the same iterations (the shuffles need the whole warp); a
    // lane group whose key is past the end computes on zeros and discards the result. The
    // next step's rows are requested before this step's arithmetic, so each warp keeps two
    // steps of loads in flight.
    const int first_key = k_begin + warp * S::KEYS_PER_WARP + lane / S::LANES_PER_KEY;
    fetch_key(first_key);
    for (int j = first_key; j - lane / S::LANES_PER_KEY < k_end; j += NUM_STATES) {
        const bool valid = j < k_end;
        float k[S::ELEMS], v[S::ELEMS];
        unpack_slice<C, HEAD_SIZE>(k_raw, k);
        unpack_slice<C, HEAD_SIZE>(v_raw, v);
        fetch_key(j + NUM_STATES);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < S::ELEMS; ++e) s = fmaf(q[g][e], k[e], s);
#pragma unroll
            for (int offset = S::LANES_PER_KEY / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(kFullMask, s, offset);
            if (params.softcap > 0.f) s = tanhf(s / params.softcap) * params.softcap;
            if (valid) {
                const float m_new = fmaxf(m[g], s);
                const float correction = __expf(m[g] - m_new);
                const float p = __expf(s - m_new);
                l[g] = l[g] * correction + p;
#pragma unroll
                for (int e = 0; e < S::ELEMS; ++e) acc[g][e] = fmaf(acc[g][e], correction, p * v[e]);
                m[g] = m_new;
            }
        }
    }

    __shared__ float s_m[NUM_STATES][GROUP], s_l[NUM_STATES][GROUP];
    __shared__ float s_acc[NUM_STATES][GROUP][HEAD_SIZE];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        if (slice == 0) {
            s_m[state][g] = m[g];
            s_l[state][g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < S::ELEMS; ++e) s_acc[state][g][S::dim(slice, e)] = acc[g][e];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < GROUP * HEAD_SIZE; idx += blockDim.x) {
        const int g = idx / HEAD_SIZE, dim = idx % HEAD_SIZE;
        float m_all = -INFINITY;
        for (int w = 0; w < NUM_STATES; ++w) m_all = fmaxf(m_all, s_m[w][g]);
        float l_all = 0.f, a_all = 0.f;
        if (m_all != -INFINITY) {
            for (int w = 0; w < NUM_STATES; ++w) {
                const float weight = __expf(s_m[w][g] - m_all);
                l_all += s_l[w][g] * weight;
                a_all += s_acc[w][g][dim] * weight;
            }
        }
        const int head = kv_head * GROUP + g;
        if (d.num_partitions == 1) {
            out[((int64_t)token * d.num_heads + head) * HEAD_SIZE + dim] = from_float<T>(l_all > 0.f ? a_all * v_scale / l_all : 0.f);
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
__global__ void reduce_kernel(T* __restrict__ out, const float* __restrict__ workspace, int num_heads, int num_partitions,
                              const float* __restrict__ v_scale_ptr) {
    const float v_scale = v_scale_ptr != nullptr ? *v_scale_ptr : 1.f;  // (an fp8 cache's V scale)
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
    out[row * HEAD_SIZE + dim] = from_float<T>(l_all > 0.f ? a_all * v_scale / l_all : 0.f);
}

template <typename T, typename C>
void launch_write_kv(const pa_shape* s, const void* key, const void* value, void* kv_cache, const int64_t* slot_mapping,
                     const float* kv_scales, int64_t row, int64_t kv_half, dim3 threads, cudaStream_t stream) {
    auto write = write_kv_kernel<T, C>;
    PA_LAUNCH(write, dim3(s->num_tokens), threads, stream, static_cast<const T*>(key), static_cast<const T*>(value),
              static_cast<C*>(kv_cache), slot_mapping, kv_scales, row, kv_half);
}

template <typename T>
void launch_write_kv_of(const pa_shape* s, const void* key, const void* value, void* kv_cache,
                        const int64_t* slot_mapping, const float* kv_scales, int64_t row, int64_t kv_half,
                        dim3 threads, cudaStream_t stream) {
    switch (s->kv_dtype) {
        case PA_FP8_E4M3: return launch_write_kv<T, fp8_e4m3>(s, key, value, kv_cache, slot_mapping, kv_scales, row, kv_half, threads, stream);
        case PA_FP8_E5M2: return launch_write_kv<T, fp8_e5m2>(s, key, value, kv_cache, slot_mapping, kv_scales, row, kv_half, threads, stream);
        default: return launch_write_kv<T, T>(s, key, value, kv_cache, slot_mapping, kv_scales, row, kv_half, threads, stream);
    }
}

// Keys per split-KV partition: 512, or shorter (down to 128) while the grid would have
// fewer than kMinCtas CTAs, so a few long sequences still spread over the whole GPU.
constexpr int64_t kMinCtas = 1024;

int partition_size(const pa_shape* s) {
    int size = 512;
    while (size > 128 && (int64_t)s->num_tokens * s->num_kv_heads * ((s->max_seq_len + size - 1) / size) < kMinCtas)
        size /= 2;
    return size;
}

int num_partitions(const pa_shape* s) {
    const int size = partition_size(s);
    return (s->max_seq_len + size - 1) / size;
}

template <typename T, typename C, int HEAD_SIZE, int GROUP>
int launch_attention(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                     const int32_t* seq_lens, const int32_t* block_tables, Params params, void* workspace,
                     cudaStream_t stream) {
    const Dims d{s->num_seqs, s->num_heads, s->num_kv_heads, s->block_size, s->max_blocks_per_seq, num_partitions(s),
                 partition_size(s), (int64_t)s->num_blocks * s->block_size * s->num_kv_heads * s->head_size};
    if (d.num_partitions > 65535) return fail("max_seq_len is too long for the CUDA kernel's grid");
    const dim3 grid(s->num_tokens, s->num_kv_heads, d.num_partitions);
    auto attention = attention_kernel<T, C, HEAD_SIZE, GROUP>;
    PA_LAUNCH(attention, grid, dim3(kNumWarps * 32), stream, static_cast<T*>(out), static_cast<const T*>(query),
              static_cast<const C*>(kv_cache), qsl, seq_lens, block_tables, static_cast<float*>(workspace), params, d);
    if (int rc = check_launch("attention_kernel")) return rc;
    if (d.num_partitions > 1) {
        auto reduce = reduce_kernel<T, HEAD_SIZE>;
        PA_LAUNCH(reduce, dim3(s->num_tokens, s->num_heads), dim3(HEAD_SIZE), stream, static_cast<T*>(out),
                  static_cast<const float*>(workspace), s->num_heads, d.num_partitions,
                  IsFp8<C>::value && params.kv_scales != nullptr ? params.kv_scales + 1 : nullptr);
        if (int rc = check_launch("reduce_kernel")) return rc;
    }
    return 0;
}

template <typename T, typename C, int HEAD_SIZE>
int dispatch_group(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                   const int32_t* seq_lens, const int32_t* block_tables, Params params, void* workspace,
                   cudaStream_t stream) {
#define PA_GROUP_CASE(G) \
    case G: return launch_attention<T, C, HEAD_SIZE, G>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, stream);
    switch (s->num_heads / s->num_kv_heads) {
        PA_GROUP_CASE(1) PA_GROUP_CASE(2) PA_GROUP_CASE(3) PA_GROUP_CASE(4)
        PA_GROUP_CASE(5) PA_GROUP_CASE(6) PA_GROUP_CASE(7) PA_GROUP_CASE(8)
        default: return fail("GQA groups larger than 8 query heads per KV head are not supported");
    }
#undef PA_GROUP_CASE
}

template <typename T, typename C>
int dispatch_head_size(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                       const int32_t* seq_lens, const int32_t* block_tables, Params params, void* workspace,
                       cudaStream_t stream) {
    switch (s->head_size) {
        case 64: return dispatch_group<T, C, 64>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, stream);
        case 128: return dispatch_group<T, C, 128>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, stream);
        case 256: return dispatch_group<T, C, 256>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, stream);
        default: return fail("the CUDA library supports head sizes 64, 128 and 256; got " + std::to_string(s->head_size));
    }
}

template <typename T>
int dispatch_cache(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                   const int32_t* seq_lens, const int32_t* block_tables, Params params, void* workspace,
                   cudaStream_t stream) {
    switch (s->kv_dtype) {
        case PA_FP8_E4M3: return dispatch_head_size<T, fp8_e4m3>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, stream);
        case PA_FP8_E5M2: return dispatch_head_size<T, fp8_e5m2>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, stream);
        default: return dispatch_head_size<T, T>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, stream);
    }
}

int check_shape(const pa_shape* s) {
    if (s == nullptr) return fail("shape is null");
    if (s->num_kv_heads <= 0 || s->num_heads % s->num_kv_heads != 0) return fail("num_heads must be a multiple of num_kv_heads");
    if (s->num_heads / s->num_kv_heads > kMaxGroup) return fail("GQA groups larger than 8 query heads per KV head are not supported");
    if (s->dtype < PA_FLOAT32 || s->dtype > PA_FLOAT16) return fail("unknown dtype");
    if (s->kv_dtype != s->dtype && s->kv_dtype != PA_FP8_E4M3 && s->kv_dtype != PA_FP8_E5M2)
        return fail("the CUDA library keeps the KV cache in the model's dtype or fp8 (e4m3, e5m2)");
    return 0;
}

}  // namespace

extern "C" {

const char* pa_cuda_last_error(void) { return g_last_error.c_str(); }

int pa_cuda_abi_version(void) { return PA_ABI_VERSION; }

int64_t pa_cuda_workspace_bytes(const pa_shape* s) {
    const int parts = num_partitions(s);
    if (parts <= 1) return 0;
    return (int64_t)s->num_tokens * s->num_heads * parts * (s->head_size + 2) * (int64_t)sizeof(float);
}

int pa_cuda_write_kv(const pa_shape* s, const void* key, const void* value, void* kv_cache, const int64_t* slot_mapping,
                     const float* kv_scales, void* stream) {
    if (int rc = check_shape(s)) return rc;
    if (s->num_tokens == 0) return 0;
    const int64_t row = (int64_t)s->num_kv_heads * s->head_size;
    const int64_t kv_half = (int64_t)s->num_blocks * s->block_size * row;
    const dim3 threads(row < 1024 ? (unsigned)row : 1024u);
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    switch (s->dtype) {
        case PA_FLOAT32: launch_write_kv_of<float>(s, key, value, kv_cache, slot_mapping, kv_scales, row, kv_half, threads, st); break;
        case PA_BFLOAT16: launch_write_kv_of<__nv_bfloat16>(s, key, value, kv_cache, slot_mapping, kv_scales, row, kv_half, threads, st); break;
        default: launch_write_kv_of<__half>(s, key, value, kv_cache, slot_mapping, kv_scales, row, kv_half, threads, st);
    }
    return check_launch("write_kv_kernel");
}

int pa_cuda_attention(const pa_shape* s, void* out, const void* query, const void* kv_cache, const float* kv_scales,
                      const int32_t* qsl, const int32_t* seq_lens, const int32_t* block_tables, float scale,
                      int32_t window, float softcap, void* workspace, int64_t workspace_bytes, void* stream) {
    if (int rc = check_shape(s)) return rc;
    if (window < 0 || !(softcap >= 0.f)) return fail("window and softcap must be >= 0 (0: none)");
    const Params params{scale, softcap, window, kv_scales};
    if (s->num_tokens == 0) return 0;
    if (workspace_bytes < pa_cuda_workspace_bytes(s)) return fail("workspace too small");
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    switch (s->dtype) {
        case PA_FLOAT32: return dispatch_cache<float>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, st);
        case PA_BFLOAT16: return dispatch_cache<__nv_bfloat16>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, st);
        default: return dispatch_cache<__half>(s, out, query, kv_cache, qsl, seq_lens, block_tables, params, workspace, st);
    }
}

}  // extern "C"
