// Matrix products with GGUF-packed weights on the CPU (see quant_matmul.h for the formats).
//
// Decode-sized batches (small M): the packed weight is streamed once per call, each block
// unpacked in registers and used for every row of x, over output rows split among OpenMP
// threads when there is enough work (kMinWorkPerThread). Below 5 rows (2 with AVX-512) the
// offsets of Q4_0/Q4_1/Q8_M are folded out of the inner loop: sum_i (d q_i + m) x_i =
// d * sum_i q_i x_i + m * sum_i x_i, with the block sums of x computed once per call. From there
// (the vector paths) each block is dequantized in registers once and feeds tiles of up to 12
// rows of x (15 with AVX-512). From 13 rows (16 with AVX-512: Kernels::panel_min_rows) slabs of
// 16 rows of x are multiplied in panels, and a few rows past the last whole slab in the row
// tiles (kMaxRowsPastSlabs). Large batches are better served by dequantizing a tile of rows
// (qm_dequantize_range) and an optimized GEMM; the caller picks by M.
//
// The arithmetic (quant_kernel.cpp) is compiled five times: AVX-512 with VNNI and BF16, with
// VNNI, AVX-512 (F/BW/VL/DQ), AVX2+FMA+F16C and portable. The best one the CPU runs and the OS
// enables is picked at load time, never by compile flags of the library; QM_CPU_ISA in the
// environment (portable, avx2, avx512, avx512+vnni or avx512+vnni+bf16) caps the choice, for a
// machine that reports more than it runs.
//
// qm_linear_bf16 rounds x to bf16 and multiplies it in panels with bf16 dot products
// (AVX512_BF16), for batches of 16 rows or more (--activation-quantization bf16).

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(QM_NO_AVX2)
#define QM_X86 1
#include <cpuid.h>
#endif
#include <omp.h>

#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "quant_kernel.h"
#include "quant_matmul.h"

namespace {

thread_local std::string g_last_error;

int fail(const std::string& message) {
    g_last_error = message;
    return 1;
}

// The isa argument of the C API; names as qm_isa() reports them.
enum Isa { kBest = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Vnni = 4, kAvx512Bf16 = 5 };
constexpr const char* kIsaNames[] = {"best", "portable", "avx2+fma", "avx512", "avx512+vnni", "avx512+vnni+bf16"};

// The vector paths this CPU runs: what CPUID reports and the OS saves across context switches
// (XCR0: a VM may report AVX-512 and leave its registers off, and its instructions then fault).
// Each path needs the ones below it.
int highest_isa_supported() {
#if QM_X86
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return kPortable;
    uint32_t xcr0, xcr0_high;
    __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_high) : "c"(0));
    const bool ymm = (xcr0 & 0x06) == 0x06;  // SSE and AVX state
    const bool zmm = (xcr0 & 0xe6) == 0xe6;  // and the opmask and both halves of the ZMM registers
    __builtin_cpu_init();
    if (!ymm || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !(ecx & bit_F16C))
        return kPortable;
    if (!zmm || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
        return kAvx2;
    if (!__builtin_cpu_supports("avx512vnni")) return kAvx512;
    return __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kAvx512Vnni;
#else
    return kPortable;
#endif
}

const int kHighestIsa = highest_isa_supported();

// What isa 0 (best) means: the highest this CPU runs, capped by QM_CPU_ISA.
int best_isa() {
    const char* cap = std::getenv("QM_CPU_ISA");
    if (cap == nullptr) return kHighestIsa;
    for (int isa = kPortable; isa <= kAvx512Bf16; ++isa)
        if (std::strcmp(cap, kIsaNames[isa]) == 0 || (isa == kAvx2 && std::strcmp(cap, "avx2") == 0))
            return std::min(isa, kHighestIsa);
    return kHighestIsa;  // (backends/packed.py refuses an unknown name before loading)
}

const int kBestIsa = best_isa();

int64_t block_bytes(int type) {
    switch (type) {
        case qm::kQ4_0: return 18;
        case qm::kQ4_1: return 20;
        case qm::kQ8_0: return 34;
        case qm::kQ8_M: return 36;
        case qm::kF32: return 128;  // (qm_linear_rows alone)
        case qm::kBF16: return 64;
        default: return 0;
    }
}

// The kernels for isa (0: best), or nullptr with the error set.
const qm::Kernels* pick(int isa) {
    static const qm::Kernels portable = qm::qm_portable::kernels();
#if QM_X86
    static const qm::Kernels avx2 = qm::qm_avx2::kernels(), avx512 = qm::qm_avx512::kernels(),
                             avx512_vnni = qm::qm_avx512_vnni::kernels(), avx512_bf16 = qm::qm_avx512_bf16::kernels();
    static const qm::Kernels* const table[] = {nullptr, &portable, &avx2, &avx512, &avx512_vnni, &avx512_bf16};
#else
    static const qm::Kernels* const table[] = {nullptr, &portable};
#endif
    if (isa == kBest) isa = kBestIsa;
    if (isa < kPortable || isa > kAvx512Bf16) {
        fail("unknown isa " + std::to_string(isa));
        return nullptr;
    }
    if (isa > kHighestIsa) {
        fail(std::string("this CPU does not run ") + kIsaNames[isa]);
        return nullptr;
    }
    return table[isa];
}

// Block-row products (or blocks dequantized) one thread should have before a second one
// joins: a thread woken for less costs more than it saves. 4096 splits every product of a
// batch-1 decode step of the default model over both cores. That pays only while the
// process has one OpenMP pool (the engine's device thread, engine/core/device_thread.py): with
// two, libgomp cuts its spin-wait short and each product waits for a sleeping worker
// (measured then: a batch-1 step 20% slower than with one thread).
constexpr int64_t kMinWorkPerThread = 1 << 12;

// Rows of x past the last whole slab of 16 that the row tiles take; from one more, a slab padded
// with zeros is faster. A step of the default model with 17-19 rows took 0.66-0.78x the time
// of padding to 32, with 20-24 rows about as long, with 25-28 rows 1.05-1.2x as long (AMD EPYC
// Zen 3, AVX2, bench/step_cost.py --decodes 1): the tiles read the chunk's weight rows again,
// from cache, right after its panels. (Measured while 5-7 rows past the slabs took the folded
// tiles; they take the dequantized one now, 0.78-0.83x its time.)
constexpr int64_t kMaxRowsPastSlabs = 8;

int threads_for(int64_t work, int64_t chunks) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({omp_get_max_threads(), chunks,
                                                                      work / kMinWorkPerThread})));
}

bool dense(int type) { return type == qm::kF32 || type == qm::kBF16; }

int check(int type, const void* w, int64_t k, const void* out, bool dense_allowed = false) {
    if (block_bytes(type) == 0 || (dense(type) && !dense_allowed))
        return fail("unsupported packed type " + std::to_string(type) + " (2: Q4_0, 3: Q4_1, 8: Q8_0, 100: Q8_M" +
                    (dense_allowed ? "; 0: F32, 30: BF16" : "") + ")");
    if (k <= 0 || k % 32) return fail("k must be a positive multiple of 32; got " + std::to_string(k));
    if (w == nullptr || out == nullptr) return fail("null pointer");
    return 0;
}

// x rounded to int16 per block of 32 (scale max|x| / 32767, to nearest, ties to even) for
// qm_linear_q16, by the same code for every vector path, so that they all multiply the same
// integers: the values, each block's scale, and its scale times the sum of its integers.
void round_to_int16(const float* x, int64_t count, int16_t* q, float* scale, float* sum) {
    for (int64_t xb = 0; xb < count; ++xb) {
        const float* v = x + xb * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float d = amax / 32767.f, inverse = d != 0.f ? 1.f / d : 0.f;
        int total = 0;
        for (int i = 0; i < 32; ++i) {
            const int r = std::clamp(static_cast<int>(std::nearbyint(v[i] * inverse)), -32767, 32767);
            q[xb * 32 + i] = static_cast<int16_t>(r);
            total += r;
        }
        scale[xb] = d;
        sum[xb] = d * static_cast<float>(total);
    }
}

// Each block's sum of x for rows [r0, r1) (Job::xsum: the row tiles fold the blocks' offsets
// through them).
void row_sums(const float* x, int64_t r0, int64_t r1, int64_t k, float* xsum) {
    const int64_t blocks = k / 32;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            float s = 0.f;
            for (int i = 0; i < 32; ++i) s += x[r * k + b * 32 + i];
            xsum[r * blocks + b] = s;
        }
}

// kFixedOrder: fp32 activations through the row tiles alone, whatever m (qm_linear_rows).
enum class Activations { kFloat32, kInt16, kBfloat16, kFixedOrder };

// A per-call buffer that is written whole before it is read: not zero-filled first, as a
// std::vector's would be (the slabs of x are as large as x).
template <class T>
std::unique_ptr<T[]> scratch(int64_t count) {
    return std::unique_ptr<T[]>(new T[static_cast<size_t>(count)]);
}

// qm_linear, qm_linear_q16 (int16 activations) and qm_linear_bf16.
int linear(int type, const void* w, int64_t n, int64_t k, const float* x, int64_t m, float* y, int isa,
           Activations activations) {
    if (check(type, w, k, y, activations == Activations::kFixedOrder) || x == nullptr) return 1;
    const qm::Kernels* kern = pick(isa);
    if (kern == nullptr) return 1;
    if (activations == Activations::kBfloat16 && kern->bf16_rows == nullptr)
        return fail(std::string("bf16 activations need AVX512_BF16; the ") + kern->name + " path has none");
    if (n <= 0 || m <= 0) return n < 0 || m < 0 ? fail("negative size") : 0;
    const int64_t blocks = k / 32;
    qm::Job job{type, static_cast<const uint8_t*>(w), n, k, qm_row_bytes(type, k), block_bytes(type), x, m, y,
                nullptr};
    const int64_t m_pad = (m + 15) / 16 * 16;  // rows of the slabs of x (the panels)
    std::unique_ptr<float[]> xt, xsum, xd;
    std::unique_ptr<int16_t[]> xq;
    std::unique_ptr<uint16_t[]> xbf16;
    if (activations == Activations::kBfloat16) {  // the bf16 panels, whatever m
        xbf16 = scratch<uint16_t>(k * m_pad);
        xsum = scratch<float>(m_pad * blocks);
        kern->round_to_bf16(x, m, k, xbf16.get(), xsum.get());
        job.xbf16 = xbf16.get();
        job.xbf16_sums = xsum.get();
        job.m_pad = m_pad;
    } else if (activations == Activations::kInt16) {  // the row tiles, on integers
        xq = scratch<int16_t>(m * k);
        xd = scratch<float>(m * blocks);
        xsum = scratch<float>(m * blocks);
        round_to_int16(x, m * blocks, xq.get(), xd.get(), xsum.get());
        job.xq16 = xq.get();
        job.xd = xd.get();
        job.xsum = xsum.get();
    } else if (activations == Activations::kFixedOrder && dense(type)) {
        // (plain weights: no offsets to fold)
    } else if (activations != Activations::kFixedOrder && kern->to_slabs != nullptr && m >= kern->panel_min_rows) {
        // x transposed, in slabs of 16 rows, for the panels; up to kMaxRowsPastSlabs rows past
        // the last whole slab are multiplied in row tiles (linear_rows) rather than in a slab
        // padded with zeros
        const int64_t rest = m % 16;
        const int64_t m_panels = rest <= kMaxRowsPastSlabs ? m - rest : m_pad;
        xt = scratch<float>(k * m_panels);
        kern->to_slabs(x, std::min(m, m_panels), k, xt.get());
        job.xt = xt.get();
        job.m_pad = m_panels;
        if (m_panels < m) {
            xsum = scratch<float>(m * blocks);
            row_sums(x, m_panels, m, k, xsum.get());
            job.xsum = xsum.get();
        }
    } else {  // the row tiles fold the blocks' offsets through the sums of x
        xsum = scratch<float>(m * blocks);
        row_sums(x, 0, m, k, xsum.get());
        job.xsum = xsum.get();
    }
    // Chunks of 16 output rows (48 for the panel products: whole panels of 6, or of 12 for the
    // bf16 ones): enough work per chunk, and whole cache lines of y per thread.
    const bool panels = job.xt != nullptr || job.xbf16 != nullptr;
    const auto rows = activations == Activations::kFixedOrder ? kern->fixed_rows
                      : job.xbf16 != nullptr                 ? kern->bf16_rows
                                                             : kern->linear_rows;
    // Static: each thread streams one contiguous range of rows. (Taking chunks as the threads go,
    // so that a core lent to another thread for a while would take fewer, made a batch-1 decode
    // step of the default model 1.3x slower on AMD EPYC family 23: 13.6-14.8 vs 10.5-11.1 ms.)
    const int64_t chunk = panels ? 48 : 16, chunks = (n + chunk - 1) / chunk;
    const int threads = threads_for(n * blocks * m, chunks);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; ++c) rows(job, c * chunk, std::min(n, (c + 1) * chunk));
    return 0;
}

}  // namespace

extern "C" {

int64_t qm_row_bytes(int type, int64_t k) {
    if (block_bytes(type) == 0 || k <= 0 || k % 32) return 0;
    return k / 32 * block_bytes(type);
}

int qm_linear(int type, const void* w, int64_t n, int64_t k, const float* x, int64_t m, float* y, int isa) {
    return linear(type, w, n, k, x, m, y, isa, Activations::kFloat32);
}

int qm_linear_q16(int type, const void* w, int64_t n, int64_t k, const float* x, int64_t m, float* y, int isa) {
    return linear(type, w, n, k, x, m, y, isa, Activations::kInt16);
}

int qm_linear_bf16(int type, const void* w, int64_t n, int64_t k, const float* x, int64_t m, float* y, int isa) {
    return linear(type, w, n, k, x, m, y, isa, Activations::kBfloat16);
}

int qm_linear_rows(int type, const void* w, int64_t n, int64_t k, const float* x, int64_t m, float* y, int isa) {
    return linear(type, w, n, k, x, m, y, isa, Activations::kFixedOrder);
}

int qm_dequantize_rows(int type, const void* w, int64_t k, const int64_t* rows, int64_t count, float* out, int isa) {
    if (check(type, w, k, out) || (count > 0 && rows == nullptr)) return 1;
    const qm::Kernels* kern = pick(isa);
    if (kern == nullptr) return 1;
    const int64_t row_bytes = qm_row_bytes(type, k);
    const auto* base = static_cast<const uint8_t*>(w);
    for (int64_t i = 0; i < count; ++i) kern->dequantize_row(type, base + rows[i] * row_bytes, k, block_bytes(type), out + i * k);
    return 0;
}

int qm_dequantize_range(int type, const void* w, int64_t k, int64_t row_begin, int64_t row_end, float* out, int isa) {
    if (check(type, w, k, out)) return 1;
    if (row_begin < 0 || row_end < row_begin) return fail("bad row range");
    const qm::Kernels* kern = pick(isa);
    if (kern == nullptr) return 1;
    const int64_t row_bytes = qm_row_bytes(type, k);
    const auto* base = static_cast<const uint8_t*>(w);
    // Tiles are dequantized for large batches, whose steps are long: waking a worker is cheap there.
    const int threads = threads_for((row_end - row_begin) * (k / 32) * 16, row_end - row_begin);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = row_begin; r < row_end; ++r)
        kern->dequantize_row(type, base + r * row_bytes, k, block_bytes(type), out + (r - row_begin) * k);
    return 0;
}

const char* qm_isa(void) { return pick(0)->name; }

int qm_isa_supported(int isa) { return isa == kBest || (isa >= kPortable && isa <= kHighestIsa); }

const char* qm_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"
