// qatc_quant.cuh: the quantization and dropout primitives of runtime/src/quant.rs, bit for bit.
#pragma once

// NF4, DYN_SIGNED, DYN_UNSIGNED: written by the code generator from the IR's constants.
#include "qatc_tables.cuh"

namespace qatc {

__device__ __forceinline__ float nf4_value(int code) { return NF4[code & 15]; }

// The nearest code value to x, the first one on ties.
__device__ __forceinline__ int nf4_nearest(float x) {
    int best = 0;
    for (int k = 1; k < 16; ++k) {
        if (fabsf(x - NF4[k]) < fabsf(x - NF4[best])) best = k;
    }
    return best;
}

__device__ __forceinline__ float dyn_value(const float* map, int code) { return map[code & 255]; }

// DynMap::nearest: pos = how many map values are below y (binary search of the 256 sorted
// values), then the closer of pos - 1 and pos, the lower on a tie; NaN gives 0.
__device__ __forceinline__ int dyn_nearest(const float* map, float y) {
    int pos = 0;
    for (int s = 128; s > 0; s >>= 1) {
        if (map[pos + s - 1] < y) pos += s;
    }
    if (map[pos] < y) pos += 1;
    if (pos == 0) return 0;
    if (pos == 256) return 255;
    return fabsf(map[pos] - y) < fabsf(y - map[pos - 1]) ? pos : pos - 1;
}

// Dropout's keep decision for element i: splitmix64's finalizer of (seed, stream, i), the top 24
// bits as a uniform in [0, 1) compared with p in double (quant::dropout_keep).
__device__ __forceinline__ bool dropout_keep(int seed, unsigned long long stream, unsigned long long i, double p) {
    unsigned long long z = (unsigned long long)(unsigned)seed ^ (stream * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = (double)(z >> 40) / 16777216.0;
    return u >= p;
}

}  // namespace qatc
