// cuda_on_cpu.h: enough of CUDA's execution model to run qatc's generated CUDA C kernels on the
// CPU, compiled by the system C++ compiler (tests/cuda_c_on_cpu.rs). Included before a kernel's
// source; the kernel's own `#include "qatc_*.cuh"` headers are qatc's, unchanged. The launcher
// (fibers, barriers, buffers, `main`'s work) is cuda_on_cpu.cpp, compiled once and linked in.
//
// The model. Blocks run one after another. The threads of a block are fibers (user-level
// contexts with stacks of their own) on the one OS thread, run in a fixed order: each runs until
// it reaches a barrier (`__syncthreads`, `__syncwarp`, a warp shuffle) or returns. Warps run in
// turn, each as far as it can: a warp barrier is released when all the warp's live threads wait
// at one, the block barrier when all the block's live threads wait there; threads waiting at
// different barriers are a deadlock (reported, exit 3). A thread that returned counts as arrived
// (as on the GPU). `__shared__` is `static`: one copy, shared by the running block's threads.
// Warp shuffles go through a per-warp exchange buffer (two, alternating, so a fast lane cannot
// overwrite a value a slow one has not read). A kernel with no barrier or shuffle in its text
// runs without fibers (`direct`: each thread a plain call); a barrier reached there is an error,
// not a silent wrong answer.
//
// `main` (QATC_CPU_MAIN) runs the launch twice over the same inputs: threads, warps and blocks in
// ascending order, then in descending order, and requires the two results to be bitwise equal:
// a kernel whose threads communicate without a barrier (a race), or read shared memory no thread
// of the block wrote, depends on the order and fails (exit 4). Param buffers sit against guard
// pages (PROT_NONE before and after), so an access more than 3 bytes past a buffer's end (or
// before its start) faults, and a write into those 0-3 bytes is caught after the launch; the
// fault handler names the buffer, the block and the thread.
//
// The device is an sm_80 (`__CUDA_ARCH__` 800): code written for tensor cores takes its mma
// branch, and `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` (the one tensor-core instruction
// qatc's headers use, routed here under QATC_CPU_SHIM) is emulated as the warp-collective
// operation it is: every lane of the warp hands in its fragments at a warp barrier, the launcher
// assembles A, B and C by the PTX ISA's fragment layouts, computes D = A B + C in fp32, and hands
// each lane its part of D (cuda_on_cpu.cpp, `mma_m16n8k16`). A warp whose lanes do not all take
// part (some returned, or are at another barrier: diverged) stops the run (exit 8).
//
// Scalar semantics are CUDA's where they differ from C's: float -> integer conversions
// (`__float2int_rz` and kin) truncate toward zero, saturate at the target's range, NaN -> 0.
// Transcendentals are the C library's (correctly rounded or nearly so; CUDA's are within 1-2 ulp),
// and the compiler is told not to contract a*b+c into FMA (NVRTC does by default).
#pragma once

#include <bit>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

// ---- the device: an sm_80 that runs this shim ----
// qatc's headers route what has no C++ meaning (the tensor-core mma) to the shim under this.
#define QATC_CPU_SHIM 1
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 800
#endif

// ---- qualifiers ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define __constant__
#define __align__(n) __attribute__((aligned(n)))

// ---- built-in variables (set by the launcher before each thread runs) ----
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
constexpr int warpSize = 32;

// ---- the launcher's side (cuda_on_cpu.cpp) ----
namespace qatc_cpu {

enum State : unsigned char { READY, AT_BLOCK, AT_WARP, DONE };

// Stops the run: the message (printf-style), the block and thread, exit `code`.
[[noreturn]] void fail(int code, const char* fmt, ...);
// The calling thread waits at a barrier of kind `s` (AT_BLOCK, AT_WARP).
void wait(State s);
// The calling thread's lane, and a warp shuffle: every lane publishes `bits`, then reads lane
// `src`'s (of the same warp).
unsigned lane_id();
uint64_t exchange(uint64_t bits, unsigned src);
// main(): argv DIR SLOTS GRID BLOCK MODE (see cuda_on_cpu.cpp); `body(ptrs)` runs one thread.
int run(int argc, char** argv, size_t params, const bool* written, void (*body)(void**));

// Inline PTX has no CPU meaning: a kernel that uses it is skipped by the harness; one that
// reaches it anyway stops here with the instruction's text.
[[noreturn]] inline void inline_ptx(const char* text) { fail(5, "inline PTX cannot run on the CPU: %s", text); }

// But for the two conversions qatc_common.cuh writes as inline PTX, whose operands it names `f`
// (the float) and `h` (the f16's bits): `asm(...)` becomes a call of this with the statement's
// text and those two, and the text must be one of the two statements exactly (else the
// instruction is named and the kernel stops). cvt.f32.f16 is exact; cvt.rn.f16.f32 rounds to
// nearest even, as a C++ conversion to _Float16 does.
inline void ptx(const char* text, float* f, unsigned short* h) {
    if (std::strcmp(text, "\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(h)") == 0) {
        *f = (float)std::bit_cast<_Float16>(*h);
    } else if (std::strcmp(text, "\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(f)") == 0) {
        *h = std::bit_cast<unsigned short>((_Float16)*f);
    } else {
        inline_ptx(text);
    }
}

// mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32 {c}, {a}, {b}, {c} (T: bf16 or f16), as
// qatc_attention_mma.cuh issues it: c += a b over the warp, each lane's a[4], b[2] (two 16-bit
// elements a register, the lower-numbered in the low half) and c[4] its fragments. A warp-wide
// barrier: all 32 lanes must reach it (cuda_on_cpu.cpp).
enum MmaType : unsigned { MMA_BF16 = 1, MMA_F16 = 2 };
void mma_m16n8k16(MmaType type, float c[4], const unsigned a[4], const unsigned b[2]);
inline void mma_m16n8k16_bf16(float c[4], const unsigned a[4], const unsigned b[2]) { mma_m16n8k16(MMA_BF16, c, a, b); }
inline void mma_m16n8k16_f16(float c[4], const unsigned a[4], const unsigned b[2]) { mma_m16n8k16(MMA_F16, c, a, b); }

}  // namespace qatc_cpu

// After every system header: `asm("...")` becomes a call with its text (`ptx` above). (`asm
// volatile` is not expanded: the tensor-core mma, qatc's one, is routed to `mma_m16n8k16` under
// QATC_CPU_SHIM instead; any other stops the compilation, and the harness skips such kernels.)
#define asm(...) ::qatc_cpu::ptx(#__VA_ARGS__, &f, &h)

// ---- math: CUDA's overloads and intrinsics ----
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }

// cvt.rzi with saturation, NaN -> 0 (PTX ISA, "cvt": float-to-integer conversions saturate).
inline int __double2int_rz(double x) {
    if (x != x) return 0;
    if (x >= 2147483648.0) return INT_MAX;
    if (x <= -2147483649.0) return INT_MIN;
    return (int)x;
}
inline int __float2int_rz(float x) { return __double2int_rz((double)x); }
inline unsigned __double2uint_rz(double x) {
    if (x != x || x <= -1.0) return 0;
    if (x >= 4294967296.0) return UINT_MAX;
    return (unsigned)x;
}
inline unsigned __float2uint_rz(float x) { return __double2uint_rz((double)x); }
inline long long __double2ll_rz(double x) {
    if (x != x) return 0;
    if (x >= 9223372036854775808.0) return LLONG_MAX;
    if (x < -9223372036854775808.0) return LLONG_MIN;
    return (long long)x;
}
inline long long __float2ll_rz(float x) { return __double2ll_rz((double)x); }

// The fast intrinsics, as their accurate counterparts (the GPU's are approximate).
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }

// ---- atomics (GCC's __atomic builtins: the fibers share one OS thread, atomic all the same) ----
#define QATC_CPU_ATOMIC(T)                                                                               \
    inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }                 \
    inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }                 \
    inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }               \
    inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }                 \
    inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }                   \
    inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }                 \
    inline T atomicCAS(T* a, T compare, T v) {                                                           \
        __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);          \
        return compare;                                                                                  \
    }                                                                                                    \
    inline T atomicMax(T* a, T v) {                                                                      \
        T old = __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                    \
        while (old < v && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                                \
        return old;                                                                                      \
    }                                                                                                    \
    inline T atomicMin(T* a, T v) {                                                                      \
        T old = __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                    \
        while (v < old && !__atomic_compare_exchange_n(a, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                                \
        return old;                                                                                      \
    }
QATC_CPU_ATOMIC(int)
QATC_CPU_ATOMIC(unsigned)
QATC_CPU_ATOMIC(unsigned long long)
#undef QATC_CPU_ATOMIC

// Float atomics: a compare-and-swap loop on the bits.
#define QATC_CPU_ATOMIC_FLOAT(T, I)                                                                              \
    inline T atomicAdd(T* a, T v) {                                                                              \
        I old = __atomic_load_n((I*)a, __ATOMIC_SEQ_CST);                                                        \
        while (!__atomic_compare_exchange_n((I*)a, &old, std::bit_cast<I>(std::bit_cast<T>(old) + v), true,     \
                                            __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {                               \
        }                                                                                                        \
        return std::bit_cast<T>(old);                                                                            \
    }                                                                                                            \
    inline T atomicExch(T* a, T v) { return std::bit_cast<T>(__atomic_exchange_n((I*)a, std::bit_cast<I>(v), __ATOMIC_SEQ_CST)); }
QATC_CPU_ATOMIC_FLOAT(float, unsigned)
QATC_CPU_ATOMIC_FLOAT(double, unsigned long long)
#undef QATC_CPU_ATOMIC_FLOAT

// ---- barriers and warp shuffles ----
inline void __syncthreads() { qatc_cpu::wait(qatc_cpu::AT_BLOCK); }
inline void __syncwarp(unsigned = 0xffffffffu) { qatc_cpu::wait(qatc_cpu::AT_WARP); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

namespace qatc_cpu {
template <typename T>
inline T shuffle(T v, unsigned src) {
    static_assert(sizeof(T) <= 8, "shuffles of up to 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = exchange(bits, src);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace qatc_cpu

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = warpSize) {
    const unsigned lane = qatc_cpu::lane_id(), src = lane ^ (unsigned)mask;
    return qatc_cpu::shuffle(v, src / width == lane / width ? src : lane);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = warpSize) {
    const unsigned lane = qatc_cpu::lane_id();
    return qatc_cpu::shuffle(v, lane % width + delta < (unsigned)width ? lane + delta : lane);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = warpSize) {
    const unsigned lane = qatc_cpu::lane_id();
    return qatc_cpu::shuffle(v, lane % width >= delta ? lane - delta : lane);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = warpSize) {
    const unsigned lane = qatc_cpu::lane_id();
    return qatc_cpu::shuffle(v, lane / width * width + (unsigned)src % width);
}

// ---- main(): the kernel launched over the buffers ----
namespace qatc_cpu {
template <typename... A>
struct Launch {
    static inline void (*kernel)(A...) = nullptr;
    template <size_t... I>
    static void call(void** p, std::index_sequence<I...>) {
        kernel(static_cast<A>(p[I])...);
    }
    static void body(void** p) { call(p, std::index_sequence_for<A...>{}); }
};

template <typename... A>
int launch_main(int argc, char** argv, void (*kernel)(A...)) {
    Launch<A...>::kernel = kernel;
    // a param the kernel writes is a pointer to non-const
    const bool written[] = {!std::is_const_v<std::remove_pointer_t<A>>..., false};
    return run(argc, argv, sizeof...(A), written, &Launch<A...>::body);
}
}  // namespace qatc_cpu

#define QATC_CPU_MAIN(KERNEL) \
    int main(int argc, char** argv) { return ::qatc_cpu::launch_main(argc, argv, &KERNEL); }
