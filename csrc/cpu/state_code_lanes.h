// The element formats of compact state (../shared/state_codes.h) on SIMD lanes: the same integer
// and fp32 operations as the scalar definitions, lane by lane, so every lane's result is bit for
// bit the scalar function's (tests/test_state_dtype.py checks every byte and rounding boundary).
// The lanes are GCC vector types as wide as at::vec::Vectorized<float> (16 on AVX-512, 8 on
// AVX2): the compiler emits one instruction per operation at that width, no per-element loop for
// the auto-vectorizer to miss (the scalar code's selects and clamps it left scalar).
#pragma once

#include "simd_blocks.h"
#include "../shared/state_codes.h"

#include <cstdint>
#include <cstring>

namespace fused_optim {

constexpr int kLanes = at::vec::Vectorized<float>::size();

typedef float FLanes __attribute__((vector_size(4 * kLanes)));
typedef uint32_t ULanes __attribute__((vector_size(4 * kLanes)));
typedef uint16_t HLanes __attribute__((vector_size(2 * kLanes)));
typedef uint8_t BLanes __attribute__((vector_size(kLanes)));

// Bit casts and a lane mask (comparisons give -1 / 0 per lane) as unsigned lanes.
C10_ALWAYS_INLINE ULanes bits_of(FLanes x) { return reinterpret_cast<ULanes>(x); }
C10_ALWAYS_INLINE FLanes float_of(ULanes b) { return reinterpret_cast<FLanes>(b); }
template <typename Mask>
C10_ALWAYS_INLINE ULanes mask_of(Mask m) { return reinterpret_cast<ULanes>(m); }
C10_ALWAYS_INLINE ULanes splat(uint32_t x) { return ULanes{} + x; }

template <typename Lanes, typename Scalar>
C10_ALWAYS_INLINE Lanes load_lanes(const Scalar* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

template <typename Lanes, typename Scalar>
C10_ALWAYS_INLINE void store_lanes(Scalar* p, Lanes x) {
  std::memcpy(p, &x, sizeof x);
}

// ---- 8-bit (q8_encode, q8_entry) ------------------------------------------------------------

// The scalar steps rearranged where that saves an instruction, same result in every lane: the
// bias subtracted before the shift (no wrap where the normal code is taken: b >= 2^-15's bits >
// kBias << kShift), and the byte 1 of a non-zero unsigned value as max(m, min(|x|'s bits, 1)).
template <bool Signed>
C10_ALWAYS_INLINE ULanes q8_encode(FLanes x, float inv_scale) {
  using C = Q8Code<Signed>;
  const ULanes magnitude = bits_of(x) & 0x7fffffffu;
  const FLanes y = float_of(magnitude) * inv_scale;
  const ULanes b = bits_of(y);
  const ULanes normal = (b + ((1u << (C::kShift - 1)) - 1u - (C::kBias << C::kShift)) + ((b >> C::kShift) & 1u)) >> C::kShift;
  const ULanes subnormal = bits_of(y * (1.0f / C::kSubnormalStep) + 8388608.0f) - 0x4b000000u;
  ULanes m = b < kQ8SmallestNormal ? subnormal : normal;
  m = m < C::kMaxMagnitude ? m : splat(C::kMaxMagnitude);
  if constexpr (Signed) {
    return m | ((bits_of(x) >> 24) & 0x80u);
  } else {
    const ULanes nonzero = magnitude < 1u ? magnitude : splat(1u);
    return m > nonzero ? m : nonzero;
  }
}

// The largest of the magnitudes of x and of the lanes of `most` (fp32 bits: for non-negative
// floats the integer order is the float order, and a NaN is above every number).
C10_ALWAYS_INLINE ULanes max_magnitude(ULanes most, FLanes x) {
  const ULanes magnitude = bits_of(x) & 0x7fffffffu;
  return most > magnitude ? most : magnitude;
}

C10_ALWAYS_INLINE float max_lane(ULanes most) {
  uint32_t m = 0;
  for (int k = 0; k < kLanes; ++k) m = m > most[k] ? m : most[k];
  return float_of(m);
}

// A subnormal m's entry as m * step (the scalar code's difference of two fp32 values is that
// product, exact either way): fewer instructions.
template <bool Signed>
C10_ALWAYS_INLINE FLanes q8_entry(ULanes code) {
  using C = Q8Code<Signed>;
  typedef int32_t ILanes __attribute__((vector_size(4 * kLanes)));
  const ULanes m = Signed ? code & 0x7fu : code;
  const FLanes normal = float_of((m + C::kBias) << C::kShift);
  const FLanes subnormal = __builtin_convertvector(reinterpret_cast<ILanes>(m), FLanes) * C::kSubnormalStep;
  const FLanes magnitude = m < (1u << C::kMantissa) ? subnormal : normal;
  if constexpr (Signed) return float_of(bits_of(magnitude) | ((code << 24) & 0x80000000u));
  return magnitude;
}

// kLanes bytes <-> lanes, by the ISA's widening / narrowing moves (GCC 12 builds
// __builtin_convertvector's widening from one insert per lane).
C10_ALWAYS_INLINE ULanes load_codes(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return reinterpret_cast<ULanes>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return reinterpret_cast<ULanes>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(load_lanes<BLanes>(p), ULanes);
#endif
}

C10_ALWAYS_INLINE void store_codes(uint8_t* p, ULanes codes) {  // every code < 256
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(reinterpret_cast<__m512i>(codes)));
#elif defined(CPU_CAPABILITY_AVX2)
  const auto x = reinterpret_cast<__m256i>(codes);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
#else
  store_lanes(p, __builtin_convertvector(codes, BLanes));
#endif
}

// ---- bf16 (bf16_nearest, bf16_stochastic; hash32 is state_codes.h's template) -------------------

C10_ALWAYS_INLINE ULanes bf16_nearest(FLanes x) {
  const ULanes b = bits_of(x);
  const ULanes nan = mask_of(x != x);
  return (splat(0x7fc0u) & nan) | (((b + 0x7fffu + ((b >> 16) & 1u)) >> 16) & ~nan);
}

C10_ALWAYS_INLINE ULanes bf16_stochastic(FLanes x, ULanes bits) {
  const ULanes b = bits_of(x);
  const ULanes nan = mask_of(x != x);
  return (((b >> 16) | 0x40u) & nan) | (((b + bits) >> 16) & ~nan);
}

C10_ALWAYS_INLINE FLanes load_bf16_lanes(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  const ULanes x = __builtin_convertvector(load_lanes<HLanes>(p), ULanes);
#endif
  return float_of(reinterpret_cast<ULanes>(x) << 16);
}

C10_ALWAYS_INLINE void store_bf16_lanes(c10::BFloat16* p, ULanes bits) {  // every value < 2^16
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(bits)));
#elif defined(CPU_CAPABILITY_AVX2)
  const auto x = reinterpret_cast<__m256i>(bits);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
#else
  store_lanes(p, __builtin_convertvector(bits, HLanes));
#endif
}

// The lane offsets 0, 1, ..., kLanes - 1.
C10_ALWAYS_INLINE ULanes lane_index() {
  ULanes i;
  for (int k = 0; k < kLanes; ++k) i[k] = static_cast<uint32_t>(k);
  return i;
}

}  // namespace fused_optim
