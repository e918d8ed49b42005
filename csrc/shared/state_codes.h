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
//
// Each format is one template over its word types: a float and its bits as a uint32_t (the CUDA
// kernels and the CPU's chunk tails), or SIMD lanes of them (csrc/cpu/state_code_lanes.h: GCC
// vector types, one instruction per operation for all lanes), so every lane's result is bit for
// bit the scalar one. The operations are written once for both: integer and fp32 arithmetic with a
// scalar operand broadcast (`U{} + c` is a constant as a word), comparisons, `c ? a : b` where
// both sides are integer words (a min or max), and select_bits where a side is fp32 arithmetic.
#pragma once

#include "primitives.h"

#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace fused_optim {

// The word types of the formats' functions: F the floats, U their fp32 bits. float and uint32_t
// here; state_code_lanes.h adds its lanes.
template <typename T>
struct Words;

template <>
struct Words<float> {
  using F = float;
  using U = uint32_t;
};

template <>
struct Words<uint32_t> : Words<float> {};

template <typename F>
FUSED_OPTIM_HD typename Words<F>::U bits_of(F x) {
  typename Words<F>::U b;
  memcpy(&b, &x, sizeof b);
  return b;
}

template <typename U>
FUSED_OPTIM_HD typename Words<U>::F float_of(U b) {
  typename Words<U>::F x;
  memcpy(&x, &b, sizeof x);
  return x;
}

// a if c else b, word by word (c a bool, or a lane mask of comparisons: -1 / 0 per lane). On a
// uint32_t written as masks: GCC vectorizes it where a ?: whose one side is fp32 arithmetic
// becomes a branch (the AVX2 loops). On lanes GCC's vector ?: (one blend).
template <typename C, typename U>
FUSED_OPTIM_HD U select_bits(C c, U a, U b) {
  if constexpr (std::is_same_v<U, uint32_t>) {
    const uint32_t mask = 0u - static_cast<uint32_t>(c);
    return (a & mask) | (b & ~mask);
  } else {
    return c ? a : b;
  }
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
  static constexpr uint32_t kSubnormalBase = (127u + 8u - kMantissa) << 23;  // the fp32 bits of 2^(8-M)
};

// The byte of x in a block whose encode scale is kTop / absmax (0 for absmax 0). Two steps are
// arranged to save an instruction (same result): the bias subtracted before the shift (no wrap
// where the normal code is taken: b >= 2^-15's bits > kBias << kShift), and the byte 1 of a
// non-zero unsigned value as max(m, min(|x|'s bits, 1)).
template <bool Signed, typename F>
FUSED_OPTIM_HD typename Words<F>::U q8_encode(F x, float inv_scale) {
  using C = Q8Code<Signed>;
  using U = typename Words<F>::U;
  const U magnitude = bits_of(x) & 0x7fffffffu;
  const F y = float_of(magnitude) * inv_scale;
  const U b = bits_of(y);
  // normal: round the fp32 bits to kMantissa mantissa bits, nearest even (a carry moves a binade up)
  const U normal =
      (b + ((1u << (C::kShift - 1)) - 1u - (C::kBias << C::kShift)) + ((b >> C::kShift) & 1u)) >> C::kShift;
  // subnormal: y / step < 2^M rounded to an integer, nearest even, by the fp32 addition of 2^23
  const U subnormal = bits_of(y * (1.0f / C::kSubnormalStep) + 8388608.0f) - 0x4b000000u;
  U m = select_bits(b < kQ8SmallestNormal, subnormal, normal);
  m = m < C::kMaxMagnitude ? m : U{} + C::kMaxMagnitude;  // (y a few fp32 ulps above kTop, or NaN)
  if constexpr (Signed) {
    return m | ((bits_of(x) >> 24) & 0x80u);
  } else {
    const U nonzero = magnitude < 1u ? magnitude : U{} + 1u;
    return m > nonzero ? m : nonzero;
  }
}

// The entry of a byte (before the block's scale absmax / kTop). A subnormal m's entry m * step as
// the encoder's addition of 2^23 undone: m added to the bits of 2^23 * step = 2^(8-M), whose ulp is
// step, minus 2^(8-M) (exact: no int-to-float conversion, a slow one on GPUs).
template <bool Signed, typename U>
FUSED_OPTIM_HD typename Words<U>::F q8_entry(U code) {
  using C = Q8Code<Signed>;
  using F = typename Words<U>::F;
  const U m = Signed ? code & 0x7fu : code;
  const F normal = float_of((m + C::kBias) << C::kShift);
  const F subnormal = float_of(m + C::kSubnormalBase) - float_of(C::kSubnormalBase);
  const U magnitude = select_bits(m < (1u << C::kMantissa), bits_of(subnormal), bits_of(normal));
  if constexpr (Signed) {
    return float_of(magnitude | ((code << 24) & 0x80000000u));
  } else {
    return float_of(magnitude);
  }
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

// The bijective 32-bit mix of the random bits (state_formats.hash32), of a uint32_t or of lanes.
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

// To nearest even (c10::BFloat16's rounding; a NaN becomes 0x7fc0): the bf16 bits in the low half.
template <typename F>
FUSED_OPTIM_HD typename Words<F>::U bf16_nearest(F x) {
  using U = typename Words<F>::U;
  const U b = bits_of(x);
  return select_bits(x != x, U{} + 0x7fc0u, (b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// With 16 random bits added below the bf16 mantissa, then truncated; a NaN keeps its sign and high
// bits and becomes quiet.
template <typename F>
FUSED_OPTIM_HD typename Words<F>::U bf16_stochastic(F x, typename Words<F>::U bits) {
  const typename Words<F>::U b = bits_of(x);
  return select_bits(x != x, (b >> 16) | 0x40u, (b + bits) >> 16);
}

// The format of a call's compact state lists (every compact list of a call has one): the values'
// dtype (plain), bf16, 8-bit codes with their absmaxes, or fp32 beside fp16 / bf16 values.
enum class StateFormat { kPlain, kBf16, k8bit, kFp32 };

}  // namespace fused_optim
