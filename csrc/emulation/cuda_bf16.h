// CUDA's __nv_bfloat16 for the CPU emulation (see cuda_runtime.h here): bfloat16 storage (the top
// 16 bits of a float32) and the conversions the kernels use, with CUDA's rounding:
//   __float2bfloat16_rn: round to nearest, ties to even (subnormals kept, overflow to inf);
//                        NaN -> 0x7fff (CUDA's canonical bfloat16 NaN)
//   __bfloat162float:    exact (the bits, shifted)
#pragma once

#include "cuda_fp16.h"  // float_bits, bits_float, shift_right_rn

struct __nv_bfloat16 {
  unsigned short __x;  // the bfloat16 bits
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  using namespace fused_optim::emulation;
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fffu};
  // Rounding the low 16 bits away may carry into the exponent: up to inf, as IEEE rounding does.
  const uint32_t sign = x & 0x80000000u, rounded = shift_right_rn(x & 0x7fffffffu, 16);
  return __nv_bfloat16{static_cast<unsigned short>((sign >> 16) | rounded)};
}

inline float __bfloat162float(__nv_bfloat16 b) {
  return fused_optim::emulation::bits_float(static_cast<uint32_t>(b.__x) << 16);
}
