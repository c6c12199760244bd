// qatc_common.cuh: element types, loads and stores, and the scalar semantics generated kernels
// share with the reference interpreter (runtime/src). Included by every generated kernel.
#pragma once

// NVRTC compiles without the C library's headers.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace qatc {

// f16 and bf16 are stored as raw 16-bit patterns, so kernels need no CUDA headers beyond what
// NVRTC builds in.
typedef unsigned short f16_t;
typedef unsigned short bf16_t;

__device__ __forceinline__ float f16_to_float(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, as half::f16::from_f32.
__device__ __forceinline__ f16_t float_to_f16(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_float(bf16_t h) {
    return __uint_as_float(((unsigned)h) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// A buffer's element type as a template argument (f16 and bf16 are both `unsigned short`, so an
// overload cannot tell them apart): T the stored type, load widens it to f32 exactly, store
// rounds an f32 to it (nearest even). For templates that read or write buffers of any float type.
struct ElemF32 {
    typedef float T;
    static __device__ __forceinline__ float load(float x) { return x; }
    static __device__ __forceinline__ float store(float x) { return x; }
};
struct ElemF16 {
    typedef f16_t T;
    static __device__ __forceinline__ float load(f16_t x) { return f16_to_float(x); }
    static __device__ __forceinline__ f16_t store(float x) { return float_to_f16(x); }
};
struct ElemBf16 {
    typedef bf16_t T;
    static __device__ __forceinline__ float load(bf16_t x) { return bf16_to_float(x); }
    static __device__ __forceinline__ bf16_t store(float x) { return float_to_bf16(x); }
};

// An f16 / bf16 node's value inside a fused kernel: rounded to its type, kept in f32.
__device__ __forceinline__ float round_f16(float x) { return f16_to_float(float_to_f16(x)); }
__device__ __forceinline__ float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// Packed 4-bit codes: element 2k is the low nibble of byte k, element 2k+1 the high nibble.
template <typename I>
__device__ __forceinline__ int load_i4(const unsigned char* p, I i) {
    return (p[i >> 1] >> ((i & 1) * 4)) & 15;
}

// Two threads may write the two nibbles of one byte: update the containing 32-bit word
// atomically (CUDA has no byte-wide compare-and-swap). The word may extend up to 3 bytes past the
// buffer's last byte, so a packed 4-bit buffer must start 4-byte aligned and be padded to whole
// words: `Buffer::device_bytes` (kernels/src/program.rs) is the size to allocate.
template <typename I>
__device__ __forceinline__ void store_i4(unsigned char* p, I i, int v) {
    unsigned* word = (unsigned*)((size_t)(p + (i >> 1)) & ~(size_t)3);
    const unsigned shift = (unsigned)(((size_t)(p + (i >> 1)) & 3) * 8 + (i & 1) * 4);
    unsigned old = *word, assumed;
    do {
        assumed = old;
        const unsigned next = (assumed & ~(15u << shift)) | (((unsigned)v & 15u) << shift);
        old = atomicCAS(word, assumed, next);
    } while (old != assumed);
}

// Float to integer (a Cast): the writer calls __float2int_rz / __double2ll_rz and their kin
// directly, truncating toward zero and saturating at the target type's range, NaN -> 0.

// max / min that propagate NaN, as torch.maximum and the interpreter's Max / Min, in the
// operands' own precision (the writer converts a float operand met by a double).
__device__ __forceinline__ float max_nan(float a, float b) {
    return (a != a) ? a : ((b != b) ? b : (a >= b ? a : b));
}
__device__ __forceinline__ float min_nan(float a, float b) {
    return (a != a) ? a : ((b != b) ? b : (a <= b ? a : b));
}
__device__ __forceinline__ double max_nan(double a, double b) {
    return (a != a) ? a : ((b != b) ? b : (a >= b ? a : b));
}
__device__ __forceinline__ double min_nan(double a, double b) {
    return (a != a) ? a : ((b != b) ? b : (a <= b ? a : b));
}

}  // namespace qatc
