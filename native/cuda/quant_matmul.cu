// Matrix products with GGUF-packed weights on NVIDIA GPUs (libqm_cuda.so): the formats of
// quant_matmul.h (Q4_0, Q4_1, Q8_0, Q8_M), activations in fp32, bf16 or fp16, fp32 sums.
//
// linear_kernel (small batches, decode): one warp per output row. Lane l takes the row's
// blocks l, l + 32, ...; it dequantizes a block's 32 values into registers exactly as GGUF's
// reference does, multiplies them into every row of x (up to kRows at a time), and the warp
// sums its lanes with shuffles. Each packed block is read once per kRows rows of x.
// dequantize_kernel (large batches): the weight, or a range of its rows, as x's dtype for a
// GEMM (the caller multiplies with cuBLAS through torch).
//
// Written to be simple and correct first: it has been checked through the host emulation
// (host_emulation.h), not yet tuned on a GPU. Every launch is on the caller's stream and is
// followed by cudaGetLastError.

#include "quant_matmul.h"
#include "launch.h"

#include <cstdint>
#include <string>

namespace {

constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ8_M = 100;
constexpr int kWarps = 4;  // output rows per CTA (one warp each)
constexpr int kRows = 8;   // rows of x multiplied per pass over a weight row
constexpr unsigned kFullMask = 0xffffffffu;

template <int TYPE> struct Format;
template <> struct Format<kQ4_0> { static constexpr int kBytes = 18; };
template <> struct Format<kQ4_1> { static constexpr int kBytes = 20; };
template <> struct Format<kQ8_0> { static constexpr int kBytes = 34; };
template <> struct Format<kQ8_M> { static constexpr int kBytes = 36; };

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

// An fp16 stored little-endian at p (blocks are 2-byte aligned at best: read byte by byte).
__device__ __forceinline__ float fp16_at(const uint8_t* p) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}

// The 32 values of one block, rounded as GGUF's reference dequantizes them: d * q + m
// (Q4_1, Q8_M), (q - 8) * d (Q4_0), q * d (Q8_0). Nibble byte j holds values j and j + 16.
template <int TYPE>
__device__ __forceinline__ void dequantize_block(const uint8_t* b, float* v) {
    const float d = fp16_at(b);
    if (TYPE == kQ4_0 || TYPE == kQ4_1) {
        const uint8_t* qs = b + (TYPE == kQ4_1 ? 4 : 2);
        const float m = TYPE == kQ4_1 ? fp16_at(b + 2) : 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float lo = static_cast<float>(qs[j] & 0x0f), hi = static_cast<float>(qs[j] >> 4);
            v[j] = TYPE == kQ4_1 ? __fadd_rn(__fmul_rn(d, lo), m) : __fmul_rn(lo - 8.f, d);
            v[j + 16] = TYPE == kQ4_1 ? __fadd_rn(__fmul_rn(d, hi), m) : __fmul_rn(hi - 8.f, d);
        }
    } else if (TYPE == kQ8_0) {
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = __fmul_rn(static_cast<float>(static_cast<int8_t>(b[2 + j])), d);
    } else {
        const float m = fp16_at(b + 2);
#pragma unroll
        for (int j = 0; j < 32; ++j) v[j] = __fadd_rn(__fmul_rn(d, static_cast<float>(b[4 + j])), m);
    }
}

template <int TYPE, typename T>
__global__ void __launch_bounds__(kWarps * 32)
    linear_kernel(const uint8_t* __restrict__ w, int64_t n, int64_t k, const T* __restrict__ x, int64_t m,
                  T* __restrict__ y) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.y;
    if (row >= n) return;  // the whole warp leaves together
    const int lane = threadIdx.x;
    const int64_t blocks = k / 32;
    const uint8_t* w_row = w + row * blocks * Format<TYPE>::kBytes;
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const int rows = m - m0 < kRows ? static_cast<int>(m - m0) : kRows;
        float acc[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
        for (int64_t b = lane; b < blocks; b += 32) {
            float v[32];
            dequantize_block<TYPE>(w_row + b * Format<TYPE>::kBytes, v);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                if (r >= rows) break;
                const T* xr = x + (m0 + r) * k + b * 32;
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < 32; ++j) s = fmaf(v[j], to_float<T>(xr[j]), s);
                acc[r] += s;
            }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            float s = acc[r];
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(kFullMask, s, offset);
            if (lane == 0 && r < rows) y[(m0 + r) * n + row] = from_float<T>(s);
        }
    }
}

// out[r - row_begin, :] = W[r, :] in T; one thread per block.
template <int TYPE, typename T>
__global__ void dequantize_kernel(const uint8_t* __restrict__ w, int64_t k, int64_t row_begin, int64_t row_end,
                                  T* __restrict__ out) {
    const int64_t blocks = k / 32;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= (row_end - row_begin) * blocks) return;
    float v[32];
    dequantize_block<TYPE>(w + (row_begin * blocks + i) * Format<TYPE>::kBytes, v);
#pragma unroll
    for (int j = 0; j < 32; ++j) out[i * 32 + j] = from_float<T>(v[j]);
}

template <int TYPE, typename T>
int launch_linear(const void* w, int64_t n, int64_t k, const void* x, int64_t m, void* y, cudaStream_t stream) {
    const int64_t ctas = (n + kWarps - 1) / kWarps;
    if (ctas > 2147483647LL) return fail("qm_cuda_linear: too many output rows");
    const auto kernel = linear_kernel<TYPE, T>;
    PA_LAUNCH(kernel, dim3(static_cast<unsigned>(ctas)), dim3(32, kWarps), stream,
              static_cast<const uint8_t*>(w), n, k, static_cast<const T*>(x), m, static_cast<T*>(y));
    return check_launch("qm_cuda_linear");
}

template <int TYPE, typename T>
int launch_dequantize(const void* w, int64_t k, int64_t row_begin, int64_t row_end, void* out, cudaStream_t stream) {
    const int64_t threads = 256, items = (row_end - row_begin) * (k / 32);
    if (items == 0) return 0;
    const int64_t ctas = (items + threads - 1) / threads;
    if (ctas > 2147483647LL) return fail("qm_cuda_dequantize: too many blocks");
    const auto kernel = dequantize_kernel<TYPE, T>;
    PA_LAUNCH(kernel, dim3(static_cast<unsigned>(ctas)), dim3(threads), stream,
              static_cast<const uint8_t*>(w), k, row_begin, row_end, static_cast<T*>(out));
    return check_launch("qm_cuda_dequantize");
}

// Calls F<TYPE, T>::run(args...) for the runtime type and dtype, or fails naming them.
template <template <int, typename> class F, typename... Args>
int dispatch(int type, int dtype, const char* what, Args... args) {
#define QM_DTYPES(TYPE)                                                   \
    switch (dtype) {                                                      \
        case 0: return F<TYPE, float>::run(args...);                      \
        case 1: return F<TYPE, __nv_bfloat16>::run(args...);              \
        case 2: return F<TYPE, __half>::run(args...);                     \
        default: return fail(std::string(what) + ": unsupported dtype");  \
    }
    switch (type) {
        case kQ4_0: QM_DTYPES(kQ4_0)
        case kQ4_1: QM_DTYPES(kQ4_1)
        case kQ8_0: QM_DTYPES(kQ8_0)
        case kQ8_M: QM_DTYPES(kQ8_M)
        default: return fail(std::string(what) + ": unsupported packed type " + std::to_string(type));
    }
#undef QM_DTYPES
}

template <int TYPE, typename T>
struct Linear {
    static int run(const void* w, int64_t n, int64_t k, const void* x, int64_t m, void* y, cudaStream_t stream) {
        return launch_linear<TYPE, T>(w, n, k, x, m, y, stream);
    }
};

template <int TYPE, typename T>
struct Dequantize {
    static int run(const void* w, int64_t k, int64_t row_begin, int64_t row_end, void* out, cudaStream_t stream) {
        return launch_dequantize<TYPE, T>(w, k, row_begin, row_end, out, stream);
    }
};

int check_sizes(const char* what, int64_t n, int64_t k) {
    if (n < 0 || k <= 0 || k % 32 != 0) return fail(std::string(what) + ": k must be a positive multiple of 32");
    return 0;
}

}  // namespace

extern "C" {

const char* qm_cuda_last_error(void) { return g_last_error.c_str(); }

int qm_cuda_linear(int type, const void* w, int64_t n, int64_t k, const void* x, int64_t m, void* y, int dtype,
                   void* stream) {
    if (int rc = check_sizes("qm_cuda_linear", n, k)) return rc;
    if (m < 0) return fail("qm_cuda_linear: m must be >= 0");
    if (m == 0 || n == 0) return 0;
    return dispatch<Linear>(type, dtype, "qm_cuda_linear", w, n, k, x, m, y, static_cast<cudaStream_t>(stream));
}

int qm_cuda_dequantize(int type, const void* w, int64_t k, int64_t row_begin, int64_t row_end, void* out, int dtype,
                       void* stream) {
    if (int rc = check_sizes("qm_cuda_dequantize", row_end - row_begin, k)) return rc;
    return dispatch<Dequantize>(type, dtype, "qm_cuda_dequantize", w, k, row_begin, row_end, out,
                                static_cast<cudaStream_t>(stream));
}

}  // extern "C"
