// Enough of the CUDA programming model to run this library's kernels on the host, so that
// their index arithmetic, synchronization and numerics are tested on machines without a GPU.
//
// Compiled only when PA_CUDA_HOST_EMULATION is defined (tests build the .cu file as C++ with
// it). Each CTA runs on its own: every CUDA thread is a fiber scheduled cooperatively in one
// OS thread (a six-register stack switch on x86-64, ucontext elsewhere); a fiber runs until
// it reaches a warp-level exchange (__shfl_xor_sync) or __syncthreads, and a
// barrier releases only when every thread it names has arrived. A barrier that can never be
// released (divergent __syncthreads, a lane that left the warp before a full-mask shuffle),
// a launch outside CUDA's limits, or a misaligned vector load is reported through
// cudaGetLastError, as the device would. Not emulated: concurrency between CTAs, memory
// ordering, timing, and bounds (a wild read just reads the host's memory).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

using std::max;
using std::min;

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct alignas(8) uint2 {
    unsigned x, y;
};

using cudaError_t = int;
using cudaStream_t = void*;
constexpr cudaError_t cudaSuccess = 0;

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __half {
    _Float16 value;
};

inline __nv_bfloat16 __float2bfloat16(float f) {  // round to nearest even, as the device does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return {uint16_t(0x7fc0)};
    u += 0x7fff + ((u >> 16) & 1);
    return {uint16_t(u >> 16)};
}
inline float __half2float(__half v) { return float(v.value); }
inline float __bfloat162float(__nv_bfloat16 v) {
    const uint32_t u = uint32_t(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __fmul_rn(float a, float b) { return a * b; }  // (host builds do not contract: no -mfma)
inline float __fadd_rn(float a, float b) { return a + b; }
inline __half __float2half(float f) { return {_Float16(f)}; }
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __half __ushort_as_half(unsigned short bits) {
    __half h;
    std::memcpy(&h, &bits, 2);
    return h;
}

namespace pa_emu {

#if defined(__x86_64__) && !defined(PA_EMU_UCONTEXT)  // PA_EMU_UCONTEXT: test the portable path
// Saves the callee-saved registers on the current stack, stores its pointer in *save and
// continues on `load` (a stack saved the same way, or set up by prepare_context).
extern "C" void pa_emu_switch(void** save, void* load);
asm(R"(
    .text
    .p2align 4
    .type pa_emu_switch, @function
pa_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size pa_emu_switch, .-pa_emu_switch
)");

struct Context {
    void* sp = nullptr;
};
inline void switch_context(Context* from, Context* to) { pa_emu_switch(&from->sp, to->sp); }
inline void prepare_context(Context* c, char* stack, size_t size, void (*entry)(), Context*) {
    auto top = (reinterpret_cast<uintptr_t>(stack + size)) & ~uintptr_t(15);
    auto* slots = reinterpret_cast<void**>(top);
    slots[-1] = nullptr;                           // entry never returns; keeps the ABI's alignment
    slots[-2] = reinterpret_cast<void*>(entry);    // where the first switch's `ret` lands
    for (int i = 3; i <= 8; ++i) slots[-i] = nullptr;  // rbp, rbx, r12-r15
    c->sp = slots - 8;
}
#else
struct Context {
    ucontext_t uc;
};
inline void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
inline void prepare_context(Context* c, char* stack, size_t size, void (*entry)(), Context* link) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = &link->uc;
    makecontext(&c->uc, entry, 0);
}
#endif

enum class State { kRunnable, kWarpBarrier, kBlockBarrier, kDone };

constexpr size_t kStackBytes = 128 * 1024;

struct Fiber {
    Context context;
    std::unique_ptr<char[]> stack{new char[kStackBytes]};  // left uninitialized: no 16 MB memset per launch
    State state = State::kRunnable;
    uint3 thread_idx{};
    unsigned exchanges = 0;  // warp exchanges so far: picks the half of the exchange buffer
};

struct Cta {
    uint3 block_idx{};
    dim3 block_dim;
    std::vector<Fiber> fibers;
    Fiber* current = nullptr;
    Context scheduler;
    std::function<void()> body;
    std::vector<uint64_t> exchange;  // [2][threads]: what each lane offered to a warp exchange
};

inline Cta*& cta() {
    static thread_local Cta* current = nullptr;
    return current;
}

inline std::string& pending_error() {
    static thread_local std::string error;
    return error;
}

inline void report(const std::string& message) {
    if (pending_error().empty()) pending_error() = message;
}

inline void yield(State state) {
    Cta* c = cta();
    Fiber* f = c->current;
    f->state = state;
    switch_context(&f->context, &c->scheduler);
}

[[noreturn]] inline void trampoline() {
    Cta* c = cta();
    c->body();
    yield(State::kDone);  // never resumed
    __builtin_unreachable();
}

inline unsigned linear(const uint3& t, const dim3& d) { return (t.z * d.y + t.y) * d.x + t.x; }

// Runs every thread of one CTA to completion; false (with an error reported) on a deadlock.
inline bool run_cta(Cta& c) {
    const size_t n = c.fibers.size();
    const size_t warps = (n + 31) / 32;
    for (;;) {
        for (Fiber& f : c.fibers) {
            if (f.state != State::kRunnable) continue;
            c.current = &f;
            switch_context(&c.scheduler, &f.context);
        }
        size_t done = 0, at_block = 0;
        for (const Fiber& f : c.fibers) {
            done += f.state == State::kDone;
            at_block += f.state == State::kBlockBarrier;
        }
        if (done == n) return true;
        bool released = false;
        if (at_block == n) {
            for (Fiber& f : c.fibers) f.state = State::kRunnable;
            released = true;
        }
        for (size_t w = 0; w < warps && !released; ++w) {
            const size_t end = std::min(n, (w + 1) * 32);
            bool all = true;
            for (size_t i = w * 32; i < end; ++i) all = all && c.fibers[i].state == State::kWarpBarrier;
            if (!all) continue;
            for (size_t i = w * 32; i < end; ++i) c.fibers[i].state = State::kRunnable;
            released = true;
        }
        if (!released) {
            report("emulated CTA (" + std::to_string(c.block_idx.x) + "," + std::to_string(c.block_idx.y) + "," +
                   std::to_string(c.block_idx.z) + ") deadlocked: " + std::to_string(at_block) + " of " +
                   std::to_string(n) + " threads wait at __syncthreads, " + std::to_string(done) +
                   " have exited, the rest wait at a warp exchange their warp never completes");
            return false;
        }
    }
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
    const uint64_t threads = uint64_t(block.x) * block.y * block.z;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535 ||
        threads == 0 || threads > 1024 || block.z > 64) {
        report("invalid configuration argument (grid " + std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" +
               std::to_string(grid.z) + ", block of " + std::to_string(threads) + " threads)");
        return;
    }
    Cta c;
    c.block_dim = block;
    c.fibers.resize(threads);
    c.exchange.assign(2 * threads, 0);
    c.body = [&] { kernel(args...); };
    Cta* saved = cta();
    cta() = &c;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                c.block_idx = {x, y, z};
                unsigned i = 0;
                for (unsigned tz = 0; tz < block.z; ++tz)
                    for (unsigned ty = 0; ty < block.y; ++ty)
                        for (unsigned tx = 0; tx < block.x; ++tx, ++i) {
                            Fiber& f = c.fibers[i];
                            f.state = State::kRunnable;
                            f.thread_idx = {tx, ty, tz};
                            f.exchanges = 0;
                            prepare_context(&f.context, f.stack.get(), kStackBytes, trampoline, &c.scheduler);
                        }
                if (!run_cta(c)) {
                    cta() = saved;
                    return;
                }
            }
    cta() = saved;
}

inline uint3 thread_idx() { return cta()->current->thread_idx; }
inline uint3 block_idx() { return cta()->block_idx; }
inline uint3 block_dim() { return {cta()->block_dim.x, cta()->block_dim.y, cta()->block_dim.z}; }

inline void check_full_warp(unsigned mask, const char* what) {
    Cta* c = cta();
    const unsigned lanes = std::min<size_t>(32, c->fibers.size() - (c->current - c->fibers.data()) / 32 * 32);
    const unsigned full = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    if (mask != full) report(std::string(what) + ": this emulation supports full-warp masks only");
}

// A warp-level exchange: every lane offers a value, waits for its whole warp, reads a lane's offer.
template <typename T>
T exchange(unsigned mask, T value, int source_of(int lane, int arg, int width), int arg, int width,
           const char* what) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "exchange of at most 8 bytes");
    check_full_warp(mask, what);
    Cta* c = cta();
    Fiber* f = c->current;
    const size_t self = f - c->fibers.data();
    const size_t half = (f->exchanges++ & 1) * c->fibers.size();
    const int lane = int(self % 32);
    std::memcpy(&c->exchange[half + self], &value, sizeof(T));
    yield(State::kWarpBarrier);
    const int source = source_of(lane, arg, width);
    T result = value;
    if (source >= 0 && source < 32) std::memcpy(&result, &c->exchange[half + self - lane + source], sizeof(T));
    return result;
}

inline int xor_source(int lane, int mask, int width) {
    const int target = lane ^ mask;
    return target / width == lane / width ? target : lane;
}

template <typename T>
void check_aligned(const T* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) report(std::string("misaligned address in ") + what);
}

}  // namespace pa_emu

#define threadIdx (::pa_emu::thread_idx())
#define blockIdx (::pa_emu::block_idx())
#define blockDim (::pa_emu::block_dim())

inline void __syncthreads() { pa_emu::yield(pa_emu::State::kBlockBarrier); }
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    return pa_emu::exchange(mask, value, pa_emu::xor_source, lane_mask, width, "__shfl_xor_sync");
}

namespace pa_emu {
inline std::string& reported_error() {
    static thread_local std::string error;
    return error;
}
}  // namespace pa_emu

inline cudaError_t cudaGetLastError() {  // returns and clears the pending error, as CUDA does
    if (pa_emu::pending_error().empty()) return cudaSuccess;
    pa_emu::reported_error().swap(pa_emu::pending_error());
    pa_emu::pending_error().clear();
    return 1;
}
inline const char* cudaGetErrorString(cudaError_t) { return pa_emu::reported_error().c_str(); }

#define PA_LAUNCH(kernel, grid, block, stream, ...) ::pa_emu::launch(kernel, grid, block, __VA_ARGS__)
