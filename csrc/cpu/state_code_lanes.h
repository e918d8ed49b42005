// SIMD lanes for the element formats of compact state (../shared/state_codes.h, whose templates
// the CPU kernels instantiate on them): GCC vector types as wide as at::vec::Vectorized<float> (16
// on AVX-512, 8 on AVX2), on which the compiler emits one instruction per operation at that
// width, no per-element loop for the auto-vectorizer to miss (the scalar code's selects and clamps
// it left scalar); and the lane plumbing: loads and stores of bytes and bf16 halves by the ISA's
// widening and narrowing moves, the running absmax of a block, the lane indices.
#pragma once

#include "multi_tensor.h"
#include "../shared/state_codes.h"

#include <cstdint>
#include <cstring>

namespace fused_optim {

constexpr int kLanes = at::vec::Vectorized<float>::size();

typedef float FLanes __attribute__((vector_size(4 * kLanes)));
typedef uint32_t ULanes __attribute__((vector_size(4 * kLanes)));
typedef uint16_t HLanes __attribute__((vector_size(2 * kLanes)));
typedef uint8_t BLanes __attribute__((vector_size(kLanes)));

// The word types of state_codes.h's templates on lanes.
struct LaneWords {
  using F = FLanes;
  using U = ULanes;
};

template <>
struct Words<FLanes> : LaneWords {};

template <>
struct Words<ULanes> : LaneWords {};

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

// ---- 8-bit ----------------------------------------------------------------------------------

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

// ---- bf16 -----------------------------------------------------------------------------------

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
