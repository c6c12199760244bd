// qatc_quant.cuh: the quantization and dropout primitives of runtime/src/quant.rs, bit for bit.
#pragma once

namespace qatc {

// QLoRA / bitsandbytes NormalFloat4 code values: qatc_ir::NF4 exactly (tested in cuda/mod.rs).
__device__ __constant__ float NF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};

__device__ __forceinline__ float nf4_value(int code) { return NF4[code & 15]; }

// The nearest code value to x, the first one on ties.
__device__ __forceinline__ int nf4_nearest(float x) {
    int best = 0;
    for (int k = 1; k < 16; ++k) {
        if (fabsf(x - NF4[k]) < fabsf(x - NF4[best])) best = k;
    }
    return best;
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
