// The element formats of compact optimizer state, per element, for the CPU and CUDA kernels (the
// reference: fused_optim/state_formats.py, which these reproduce bit for bit).
//
// 8-bit state: per block of 256 elements an fp32 absmax; per element a byte, a small float of
// y = |x| * (kQ8Top / absmax) in [0, kQ8Top]: 4 exponent bits and M mantissa bits (M = 3 for a
// signed moment, whose byte's top bit is the sign; M = 4 for an unsigned one). Exponent field f =
// 1..15 holds 2^(f-16) * (1 + m/2^M) (the binades 2^-15 .. 1, the top entry kQ8Top = 1 - 2^-(M+1));
// f = 0 holds m * 2^-(15+M) (evenly spaced down to 0, as IEEE subnormals). The byte is y rounded
// to the nearest entry, ties to even, computed on y's fp32 bits; a non-zero unsigned value never
// takes the byte 0 (Adam divides by its square root). The value of a byte is entry * (absmax / kQ8Top).
//
// bf16 state and stochastic rounding: the 16 high bits of the fp32 value, rounded to nearest even
// or with 16 random bits from hash32 of (a per-step seed, the element index).
#pragma once

#include "host_device.h"

#include <stdint.h>
#include <string.h>

namespace fused_optim {

FUSED_OPTIM_HD uint32_t bits_of(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

FUSED_OPTIM_HD float float_of(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

// a if c else b, written as masks: GCC vectorizes it where a ?: whose one side is fp32 arithmetic
// becomes a branch (the AVX2 loops).
FUSED_OPTIM_HD uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// ---- 8-bit ---------------------------------------------------------------------------------

constexpr int kQ8Block = 256;
constexpr uint32_t kQ8SmallestNormal = 0x38000000u;  // the fp32 bits of 2^-15 (exponent field 1)

template <bool Signed>
struct Q8Code {
  static constexpr int kMantissa = Signed ? 3 : 4;
  static constexpr int kShift = 23 - kMantissa;         // fp32 mantissa bits dropped
  static constexpr uint32_t kMaxMagnitude = Signed ? 127u : 255u;
  static constexpr uint32_t kBias = 111u << kMantissa;  // fp32 exponent 127 - 16 at field 0
  static constexpr float kTop = 1.0f - 1.0f / (2 << kMantissa);
  static constexpr float kSubnormalStep = 1.0f / (1u << (15 + kMantissa));
};

// The byte of x in a block whose encode scale is kTop / absmax (0 for absmax 0).
template <bool Signed>
FUSED_OPTIM_HD uint32_t q8_encode(float x, float inv_scale) {
  using C = Q8Code<Signed>;
  const uint32_t bx = bits_of(x);
  const float y = float_of(bx & 0x7fffffffu) * inv_scale;
  const uint32_t b = bits_of(y);
  // normal: round the fp32 bits to kMantissa mantissa bits, nearest even (a carry moves a binade up)
  const uint32_t normal = ((b + (1u << (C::kShift - 1)) - 1u + ((b >> C::kShift) & 1u)) >> C::kShift) - C::kBias;
  // subnormal: y / step < 2^M rounded to an integer, nearest even, by the fp32 addition of 2^23
  const uint32_t subnormal = bits_of(y * (1.0f / C::kSubnormalStep) + 8388608.0f) - 0x4b000000u;
  uint32_t m = select_bits(b < kQ8SmallestNormal, subnormal, normal);
  m = m < C::kMaxMagnitude ? m : C::kMaxMagnitude;  // (y a few fp32 ulps above kTop, or NaN)
  if constexpr (Signed) {
    return m | ((bx >> 31) << 7);
  } else {
    return m | static_cast<uint32_t>((m == 0u) & ((bx & 0x7fffffffu) != 0u));
  }
}

// The entry of a byte (before the block's scale absmax / kTop).
template <bool Signed>
FUSED_OPTIM_HD float q8_entry(uint32_t code) {
  using C = Q8Code<Signed>;
  const uint32_t m = Signed ? code & 0x7fu : code;
  // subnormal m: the entry of m + 2^M (binade 2^-15) minus 2^-15, exact
  const bool subnormal = m < (1u << C::kMantissa);
  const uint32_t lifted = select_bits(subnormal, 1u << C::kMantissa, 0u);
  const float magnitude = float_of(((m | lifted) + C::kBias) << C::kShift) - float_of(select_bits(subnormal, kQ8SmallestNormal, 0u));
  return Signed ? float_of(bits_of(magnitude) | ((code >> 7) << 31)) : magnitude;
}

// The per-block scales: encode multiplies by kTop / absmax, decode by absmax / kTop.
template <bool Signed>
FUSED_OPTIM_HD float q8_encode_scale(float absmax) {
  return absmax > 0.0f ? Q8Code<Signed>::kTop / absmax : 0.0f;
}

template <bool Signed>
FUSED_OPTIM_HD float q8_decode_scale(float absmax) {
  return absmax / Q8Code<Signed>::kTop;
}

// ---- bf16 and stochastic rounding ---------------------------------------------------------

// The bijective 32-bit mix of the random bits (state_formats.hash32), of a uint32_t or of SIMD
// lanes of them (csrc/cpu/state_code_lanes.h).
template <typename U>
FUSED_OPTIM_HD U hash32(U x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The seed of stream `stream` of a param's step with rounding key `key` (state_formats.stream_seed).
FUSED_OPTIM_HD uint32_t stream_seed(int64_t key, int stream) {
  const auto k = static_cast<uint64_t>(key);
  const uint32_t mixed = hash32(static_cast<uint32_t>(k) ^ hash32(static_cast<uint32_t>(k >> 32)));
  return hash32(mixed ^ (static_cast<uint32_t>(stream) * 0x9E3779B9u));
}

// The random bits of element i of a stream: hash32(low 32 bits of i ^ seed ^ hash32(i >> 32)),
// where `seed_at` is seed ^ hash32(i >> 32) (constant over 2^32 elements).
FUSED_OPTIM_HD uint32_t random_bits(uint32_t seed_at, uint32_t i_low) { return hash32(i_low ^ seed_at) & 0xffffu; }

FUSED_OPTIM_HD uint32_t seed_at(uint32_t seed, int64_t i) {
  return seed ^ hash32(static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32));
}

FUSED_OPTIM_HD float bf16_value(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// To nearest even (c10::BFloat16's rounding; a NaN becomes 0x7fc0).
FUSED_OPTIM_HD uint16_t bf16_nearest(float x) {
  const uint32_t b = bits_of(x);
  return static_cast<uint16_t>(x != x ? 0x7fc0u : (b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// With 16 random bits added below the bf16 mantissa, then truncated; a NaN keeps its sign and high
// bits and becomes quiet.
FUSED_OPTIM_HD uint16_t bf16_stochastic(float x, uint32_t bits) {
  const uint32_t b = bits_of(x);
  return static_cast<uint16_t>(x != x ? ((b >> 16) | 0x40u) : (b + bits) >> 16);
}

// The format of a call's compact state lists (every compact list of a call has one): the values'
// dtype (plain), bf16, or 8-bit codes with their absmaxes.
enum class StateFormat { kPlain, kBf16, k8bit };

}  // namespace fused_optim
