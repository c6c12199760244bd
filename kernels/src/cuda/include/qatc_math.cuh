// qatc_math.cuh: GPT-2's GELU and its gradient, written as the interpreter writes them
// (runtime/src/kernels/elementwise.rs), operation for operation.
#pragma once

namespace qatc {

#define QATC_SQRT_2_OVER_PI 0.7978845608028654f
#define QATC_GELU_C 0.044715f

// gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
__device__ __forceinline__ float gelu(float x) {
    const float u = QATC_SQRT_2_OVER_PI * (x + QATC_GELU_C * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

// dy * gelu'(x) = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2))
__device__ __forceinline__ float gelu_grad(float x, float dy) {
    const float t = tanhf(QATC_SQRT_2_OVER_PI * (x + QATC_GELU_C * x * x * x));
    const float d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * QATC_SQRT_2_OVER_PI * (1.0f + 3.0f * QATC_GELU_C * x * x);
    return dy * d;
}

}  // namespace qatc
