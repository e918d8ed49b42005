// The primitives the shared update rules (*_math.h) use besides + - * /, for the value types the
// rules are written on: float and double here (CUDA's per-element math, and every per-tensor rule,
// on double), at::vec::Vectorized<float/double> in csrc/cpu/multi_tensor.h (the CPU's SIMD blocks,
// declared there before the CPU includes a rule). The overloads of one name mean the same:
//   mul_add(a, b, c)    a*b + c with one rounding (fused multiply-add; the CPU's SIMD blocks
//                       round twice where the CPU has no FMA, see csrc/cpu/multi_tensor.h)
//   sqrt_of(x)          the square root
//   max_of(a, b)        the larger of a and b; NaN when either is NaN (as torch.maximum)
//   min_of(a, b)        b if b < a, else a (as std::min; per-tensor rules only)
//   clamp_of(x, lo, hi) x limited to [lo, hi]; NaN stays NaN (as torch.clamp)
//   sign_of(x)          -1, 0 or 1; 0 for ±0 and NaN (as torch.sign)
// and from_double<V>(x), a per-tensor number (double) as a value of V, rounded once to V's element
// type (the rules' factories, *_rule in *_math.h, build every field with it).
//
// FUSED_OPTIM_HD marks the functions the CPU and CUDA kernels share (the update rules of this
// folder): __host__ __device__ __forceinline__ under nvcc; otherwise (the CPU build, and a host
// compiler building the .cu files with __host__ / __device__ defined empty) inline, and always
// inlined where the compiler allows saying so: the rules run inside the CPU's SIMD loops, where
// GCC left some out of line (called through the PLT of the -fPIC library, once per block).
// Nothing else in csrc/shared may depend on __CUDACC__: the shared headers compile with nvcc
// without torch headers and with a host compiler without CUDA headers. csrc/shared is the
// torch-free math (update rules, bias corrections, trust ratios, element formats); the host code
// both devices' ops share that uses ATen (argument checks, index draws) is csrc/host.
// tests/build/test_math_headers_torch_free.py compiles each header here without torch.
#pragma once

#if defined(__CUDACC__)
#define FUSED_OPTIM_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define FUSED_OPTIM_HD inline __attribute__((always_inline))
#else
#define FUSED_OPTIM_HD inline
#endif

#include <math.h>

namespace fused_optim {

FUSED_OPTIM_HD float mul_add(float a, float b, float c) { return fmaf(a, b, c); }
FUSED_OPTIM_HD double mul_add(double a, double b, double c) { return fma(a, b, c); }

FUSED_OPTIM_HD float sqrt_of(float x) { return sqrtf(x); }
FUSED_OPTIM_HD double sqrt_of(double x) { return sqrt(x); }

FUSED_OPTIM_HD float max_of(float a, float b) { return a != a ? a : a > b ? a : b; }
FUSED_OPTIM_HD double max_of(double a, double b) { return a != a ? a : a > b ? a : b; }

FUSED_OPTIM_HD double min_of(double a, double b) { return b < a ? b : a; }

FUSED_OPTIM_HD float clamp_of(float x, float lo, float hi) { return x < lo ? lo : hi < x ? hi : x; }
FUSED_OPTIM_HD double clamp_of(double x, double lo, double hi) { return x < lo ? lo : hi < x ? hi : x; }

FUSED_OPTIM_HD float sign_of(float x) { return x > 0.f ? 1.f : x < 0.f ? -1.f : 0.f; }
FUSED_OPTIM_HD double sign_of(double x) { return x > 0.0 ? 1.0 : x < 0.0 ? -1.0 : 0.0; }

// from_double<V>: static_cast for float and double; multi_tensor.h specializes FromDouble for
// at::vec::Vectorized<M> (static_cast<M>, then every lane).
template <typename V>
struct FromDouble {
  static FUSED_OPTIM_HD V of(double x) { return static_cast<V>(x); }
};

template <typename V>
FUSED_OPTIM_HD V from_double(double x) {
  return FromDouble<V>::of(x);
}

}  // namespace fused_optim
