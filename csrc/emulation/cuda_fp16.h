// CUDA's __half for the CPU emulation (see cuda_runtime.h here): IEEE binary16 storage and the
// conversions the kernels use, with CUDA's rounding and special values:
//   __float2half_rn: round to nearest, ties to even; subnormal halves kept; |x| >= 65520 -> inf;
//                    NaN -> 0x7fff (CUDA's canonical half NaN, whatever the payload)
//   __half2float:    exact; a half NaN -> 0x7fffffff (CUDA's canonical float NaN, sign dropped)
#pragma once

#include <cstdint>
#include <cstring>

struct __half {
  unsigned short __x;  // the binary16 bits
};

namespace fused_optim {
namespace emulation {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// m >> shift, rounded to nearest, ties to even (0 < shift < 32).
inline uint32_t shift_right_rn(uint32_t m, unsigned shift) {
  const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  return q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
}

}  // namespace emulation
}  // namespace fused_optim

inline __half __float2half_rn(float f) {
  using namespace fused_optim::emulation;
  const uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  uint32_t h;
  if (a > 0x7f800000u) {
    h = 0x7fffu;  // NaN
  } else if (a >= 0x47800000u) {
    h = sign | 0x7c00u;  // >= 2^16 (and inf): inf
  } else if (a >= 0x38800000u) {
    // A normal half (>= 2^-14): rebias the exponent (127 -> 15) and round away 13 mantissa bits;
    // a carry out of the mantissa moves into the exponent, up to inf for [65520, 65536).
    h = sign | shift_right_rn(a - 0x38000000u, 13);
  } else if (a < 0x33000000u) {
    h = sign;  // below 2^-25: rounds to zero (2^-25 itself is the tie, handled below)
  } else {
    // Subnormal: |f| = m * 2^(e - 150) with the implicit bit in m, in units of 2^-24: m >> (126 - e).
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    h = sign | shift_right_rn(m, 126u - e);
  }
  return __half{static_cast<unsigned short>(h)};
}

inline float __half2float(__half h) {
  using namespace fused_optim::emulation;
  const uint32_t sign = static_cast<uint32_t>(h.__x & 0x8000u) << 16, e = (h.__x >> 10) & 0x1fu, m = h.__x & 0x3ffu;
  if (e == 0x1fu) return bits_float(m != 0 ? 0x7fffffffu : sign | 0x7f800000u);  // NaN, inf
  if (e == 0) {
    const float magnitude = static_cast<float>(m) * 0x1p-24f;  // subnormal or zero: exact
    return sign != 0 ? -magnitude : magnitude;
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));  // rebias the exponent: 15 -> 127
}
