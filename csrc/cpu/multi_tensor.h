// The loop of every CPU kernel, from a bucket of tensors down to SIMD blocks of their elements.
//
// The launcher: an op hands over every tensor of one (group, device, dtype) bucket at once, and
// multi_tensor_apply runs ONE parallel region over all of them, so a model of many small tensors
// pays for one region per step instead of one per tensor; it shares the elements out between
// threads by count. The fixed-order sums (fixed_order_sums.h) and the two-pass ops (two_pass.h)
// cut them into work items on the same parts.
//
// Inside a piece, for_each_block() walks elements [begin, end) of one or more streams (a tensor's
// data: ptr / cptr) in SIMD blocks of at::vec::Vectorized converted to the op's math type (fp32
// for fp16/bf16 storage, otherwise the storage type); the tail of a piece is staged through a
// zero-padded stack buffer so each op writes its math exactly once. Also the primitives of the
// shared update rules on those blocks, and the dtype dispatch of the kernels
// (FUSED_OPTIM_DISPATCH_FLOATING).
//
// Include this header before any other that could include ATen/cpu/vec (the capability macros
// below must come first), and before the shared update rules (csrc/shared/*_math.h: the
// primitives below must be declared where the rules are defined).
#pragma once

// at::vec picks its SIMD implementation from CPU_CAPABILITY_* macros that torch's own build sets
// per dispatch copy. This library is built with -march=native, so take the widest set the
// compiler enables (without one, Vectorized<T> is a plain array and bf16/fp16 crawl).
#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif
#endif

#include "../shared/primitives.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fused_optim {

template <typename T>
using opmath_t = at::opmath_type<T>;
template <typename T>
using FVec = at::vec::Vectorized<opmath_t<T>>;

// The primitives of the shared update rules (their meaning: csrc/shared/primitives.h, which has
// the scalar overloads) on at::vec::Vectorized<float/double>. mul_add is one instruction with one
// rounding where the target has FMA (every AVX2 and AVX-512 CPU); on x86-64 without it, at::vec
// rounds the product and then the sum (not std::fma per lane: a libm call each), so there the
// results differ from FMA builds' and the CUDA kernels' in the last bits.
template <typename M>
C10_ALWAYS_INLINE at::vec::Vectorized<M> mul_add(const at::vec::Vectorized<M>& a, const at::vec::Vectorized<M>& b,
                                                 const at::vec::Vectorized<M>& c) {
  return at::vec::fmadd(a, b, c);
}

template <typename M>
C10_ALWAYS_INLINE at::vec::Vectorized<M> sqrt_of(const at::vec::Vectorized<M>& x) {
  return x.sqrt();
}

template <typename M>
C10_ALWAYS_INLINE at::vec::Vectorized<M> max_of(const at::vec::Vectorized<M>& a, const at::vec::Vectorized<M>& b) {
  return at::vec::maximum(a, b);
}

template <typename M>
C10_ALWAYS_INLINE at::vec::Vectorized<M> clamp_of(const at::vec::Vectorized<M>& x, const at::vec::Vectorized<M>& lo,
                                                  const at::vec::Vectorized<M>& hi) {
  return at::vec::clamp(x, lo, hi);
}

template <typename M>
C10_ALWAYS_INLINE at::vec::Vectorized<M> sign_of(const at::vec::Vectorized<M>& x) {
  const at::vec::Vectorized<M> zero(0);
  return x.gt(zero) - x.lt(zero);  // gt / lt: 1 where true, else 0
}

// from_double<Vectorized<M>>: the number rounded to M once, in every lane.
template <typename M>
struct FromDouble<at::vec::Vectorized<M>> {
  static C10_ALWAYS_INLINE at::vec::Vectorized<M> of(double x) { return at::vec::Vectorized<M>(static_cast<M>(x)); }
};

// A block is what one iteration loads from each stream: one Vectorized of the math type, or for
// fp16/bf16 storage one full Vectorized<T> (2x the fp32 lanes) converted into two fp32 halves.
template <typename T>
constexpr int kHalves = at::vec::is_reduced_floating_point_v<T> ? 2 : 1;
template <typename T>
constexpr int64_t kBlock = kHalves<T> * FVec<T>::size();

template <typename T>
struct Block {
  FVec<T> v[kHalves<T>];
};

#if defined(CPU_CAPABILITY_AVX2)
// bf16 <-> fp32 on AVX2, always inlined: ATen's fp32 -> bf16 (at::vec::AVX2::cvtfp32_bf16) is a
// plain `inline` that GCC leaves out of line in the kernels' loops, a call per block with its
// vectors passed through memory (one thread: bf16 SGD on 25.6M params at 0.65 of the probe
// bandwidth, 0.9-1.0 inlined).

// bf16 -> fp32 is exact: the 16 bits of a bf16 are the high half of the fp32 with its value.
C10_ALWAYS_INLINE void load_bf16(const c10::BFloat16* p, at::vec::Vectorized<float>& lo,
                                 at::vec::Vectorized<float>& hi) {
  const auto widen = [](const c10::BFloat16* q) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  };
  lo = widen(p);
  hi = widen(p + 8);
}

// fp32 -> bf16 bits (in the low half of each 32-bit lane), rounded to nearest even as
// c10::BFloat16 does: (bits + 0x7fff + lsb) >> 16, lsb the last bit kept. The integer add carries
// into the exponent exactly where the value rounds up to the next binade or to inf, and leaves
// denormals denormal (never flushed). A NaN would round to inf or wrap: it becomes 0xffff (a quiet
// NaN, ATen's choice).
C10_ALWAYS_INLINE __m256i bf16_bits(const __m256& x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0xffff), nan);
}

C10_ALWAYS_INLINE void store_bf16(c10::BFloat16* p, const __m256& lo, const __m256& hi) {
  // packus interleaves the 128-bit lanes (lo0 hi0 lo1 hi1); the permute puts lo before hi.
  const __m256i packed = _mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xd8));
}
#endif

template <typename T>
C10_ALWAYS_INLINE Block<T> load_block(const T* p) {
  Block<T> b;
  if constexpr (kHalves<T> == 1) {
    b.v[0] = FVec<T>::loadu(p);
#if defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    load_bf16(p, b.v[0], b.v[1]);
#endif
  } else {
    at::vec::load_to_float(p, b.v[0], b.v[1]);
  }
  return b;
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// fp32 -> bf16 in one instruction per 32 lanes (round to nearest even, like ATen's conversion),
// used when no lane is an fp32 denormal: the instruction flushes those to zero, ATen keeps them.
C10_ALWAYS_INLINE bool store_bf16_fast(c10::BFloat16* p, const __m512& lo, const __m512& hi) {
  constexpr int kDenormal = 0x20;  // vfpclassps category: denormal
  if (_mm512_fpclass_ps_mask(lo, kDenormal) | _mm512_fpclass_ps_mask(hi, kDenormal)) return false;
  _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  return true;
}

// The rare block with a denormal lane: ATen's conversion, out of line. Inlined, its size stops the
// compiler from inlining the block loop, which then spills every block to the stack (3x slower).
C10_NOINLINE inline void store_bf16_denormal(c10::BFloat16* p, const __m512& lo, const __m512& hi) {
  at::vec::convert_from_float<c10::BFloat16>(lo, hi).store(p);
}
#endif

template <typename T>
C10_ALWAYS_INLINE void store_block(T* p, const Block<T>& b) {
  if constexpr (kHalves<T> == 2) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (C10_LIKELY(store_bf16_fast(p, b.v[0], b.v[1]))) return;
      return store_bf16_denormal(p, b.v[0], b.v[1]);
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16>) return store_bf16(p, b.v[0], b.v[1]);
#endif
    at::vec::convert_from_float<T>(b.v[0], b.v[1]).store(p);
  } else {
    b.v[0].store(p);
  }
}

// A stream of for_each_block is a pointer to its elements (a const pointer: read-only, never
// written back) or a MasterStream. Each is read and written as blocks of the loop's lead type T
// (the grads' dtype): a float stream under fp16/bf16 grads (fp32 state, or fp32 master weights)
// moves kHalves<T> fp32 vectors per block, so every stream of a block holds the same elements.
template <typename T, typename U>
C10_ALWAYS_INLINE Block<T> load_as(const U* p) {
  if constexpr (std::is_same_v<U, T>) {
    return load_block(p);
  } else {
    static_assert(std::is_same_v<U, float> && kHalves<T> == 2, "a stream is of the lead type, or fp32 under fp16/bf16");
    Block<T> b;
    b.v[0] = FVec<T>::loadu(p);
    b.v[1] = FVec<T>::loadu(p + FVec<T>::size());
    return b;
  }
}

template <typename T, typename U>
C10_ALWAYS_INLINE void store_as(U* p, const Block<T>& b) {
  if constexpr (std::is_same_v<U, T>) {
    store_block(p, b);
  } else {
    b.v[0].store(p);
    b.v[1].store(p + FVec<T>::size());
  }
}

template <typename T, typename U>
C10_ALWAYS_INLINE void store_as(const U*, const Block<T>&) {}

// Master weights: the update reads and writes the fp32 master; each stored block is also written,
// rounded to nearest even, to the fp16/bf16 param (never read: the master is the value).
template <typename T>
struct MasterStream {
  float* master;
  T* model;
};

template <typename U>
C10_ALWAYS_INLINE U* advance(U* p, int64_t i) {
  return p + i;
}

template <typename T>
C10_ALWAYS_INLINE MasterStream<T> advance(const MasterStream<T>& s, int64_t i) {
  return {s.master + i, s.model + i};
}

template <typename T, typename U>
C10_ALWAYS_INLINE Block<T> load_as(const MasterStream<U>& s) {
  return load_as<T>(s.master);
}

template <typename T, typename U>
C10_ALWAYS_INLINE void store_as(const MasterStream<U>& s, const Block<T>& b) {
  store_as<T>(s.master, b);
  store_block(s.model, b);
}

// The grads of an update's last pass over them: read as a const stream, and after a scaled step
// (`out` set) also written back unscaled in the same pass, g * inv_scale in the math type rounded
// to the grads' dtype, which is what GradScaler.unscale_ makes of them (torch's fused optimizers
// leave p.grad so). The update still reads the grads as stored. Without write-back `out` is
// null and a block pays one untaken branch.
template <typename T>
struct GradStream {
  const T* in;
  T* out;  // the grads again, or nullptr: no write-back
  opmath_t<T> inv_scale;
};

template <typename T>
C10_ALWAYS_INLINE GradStream<T> advance(const GradStream<T>& s, int64_t i) {
  return {s.in + i, s.out != nullptr ? s.out + i : nullptr, s.inv_scale};
}

template <typename T, typename U>
C10_ALWAYS_INLINE Block<T> load_as(const GradStream<U>& s) {
  static_assert(std::is_same_v<U, T>, "the grads are of the lead type");
  const Block<T> b = load_block(s.in);
  if (s.out != nullptr) {
    Block<T> unscaled;
    for (int h = 0; h < kHalves<T>; ++h) unscaled.v[h] = b.v[h] * FVec<T>(s.inv_scale);
    store_block(s.out, unscaled);
  }
  return b;
}

template <typename T, typename U>
C10_ALWAYS_INLINE void store_as(const GradStream<U>&, const Block<T>&) {}

template <typename T, typename Body, typename... Stream, size_t... I>
C10_ALWAYS_INLINE void run_block(const Body& body, int64_t i, std::index_sequence<I...>, const Stream&... streams) {
  auto vals = std::make_tuple(load_as<T>(advance(streams, i))...);
  for (int h = 0; h < kHalves<T>; ++h) body(std::get<I>(vals).v[h]...);
  (store_as<T>(advance(streams, i), std::get<I>(vals)), ...);
}

// The tail of a piece, staged through zero-padded buffers of L elements: `in` copies n elements
// of a stream in and returns the stream over the buffer; `out` copies them back (mutable streams).
template <typename Stream, int64_t L>
struct Staging;

template <typename U, int64_t L>
struct Staging<U*, L> {
  std::array<U, L> buf{};
  U* in(U* p, int64_t n) {
    std::memcpy(buf.data(), p, n * sizeof(U));
    return buf.data();
  }
  void out(U* p, int64_t n) const { std::memcpy(p, buf.data(), n * sizeof(U)); }
};

template <typename U, int64_t L>
struct Staging<const U*, L> {
  std::array<U, L> buf{};
  const U* in(const U* p, int64_t n) {
    std::memcpy(buf.data(), p, n * sizeof(U));
    return buf.data();
  }
  void out(const U*, int64_t) const {}
};

template <typename T, int64_t L>
struct Staging<MasterStream<T>, L> {
  Staging<float*, L> master;
  std::array<T, L> model{};  // written only
  MasterStream<T> in(const MasterStream<T>& s, int64_t n) { return {master.in(s.master, n), model.data()}; }
  void out(const MasterStream<T>& s, int64_t n) const {
    master.out(s.master, n);
    std::memcpy(s.model, model.data(), n * sizeof(T));
  }
};

template <typename T, int64_t L>
struct Staging<GradStream<T>, L> {
  std::array<T, L> read{}, unscaled{};
  GradStream<T> in(const GradStream<T>& s, int64_t n) {
    std::memcpy(read.data(), s.in, n * sizeof(T));
    return {read.data(), s.out != nullptr ? unscaled.data() : nullptr, s.inv_scale};
  }
  void out(const GradStream<T>& s, int64_t n) const {
    if (s.out != nullptr) std::memcpy(s.out, unscaled.data(), n * sizeof(T));
  }
};

template <typename T, typename Body, typename... Stream, size_t... I>
inline void stage_tail(const Body& body, int64_t tail, std::index_sequence<I...> seq, const Stream&... streams) {
  std::tuple<Staging<Stream, kBlock<T>>...> staged;
  run_block<T>(body, 0, seq, std::get<I>(staged).in(streams, tail)...);
  (std::get<I>(staged).out(streams, tail), ...);
}

// Calls body(v0, v1, ...) with one SIMD block of each stream, for elements [begin, end); T, the
// lead type, sets the block (kBlock<T> elements). body takes FVec<T>& for every stream and
// updates the mutable ones in place.
template <typename T, typename Body, typename... Stream>
inline void for_each_block(int64_t begin, int64_t end, const Body& body, Stream... streams) {
  constexpr int64_t L = kBlock<T>;
  using Seq = std::make_index_sequence<sizeof...(Stream)>;
  int64_t i = begin;
  for (; i + L <= end; i += L) {
    run_block<T>(body, i, Seq{}, streams...);
  }
  const int64_t tail = end - i;
  if (tail == 0) return;
  stage_tail<T>(body, tail, Seq{}, advance(streams, i)...);
}

// The data of tensor t as a stream of for_each_block.
template <typename T>
inline T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// A read-only stream (for_each_block never writes it back).
template <typename T>
inline const T* cptr(const at::Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}

#define FUSED_OPTIM_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// ---- the launcher ------------------------------------------------------------------------------

// Below this many elements in a bucket, one thread does everything (a parallel region costs more).
constexpr int64_t kSerialBelow = 32768;

// Threads share a bucket's elements by count, not by tensor: part i of n is the elements
// [i*total/n, (i+1)*total/n) of the tensors laid end to end (moved to a piece boundary), one part
// per thread, all in one parallel region. A model mixing 64-element and 2M-element tensors keeps
// both threads busy to the end.
inline int64_t parts_for(int64_t total) { return total < kSerialBelow ? 1 : at::get_num_threads(); }

// run(i) for every part i, one part per thread (inline when there is one part).
template <typename F>
inline void run_parts(int64_t parts, const F& run) {
  auto each = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) run(i);
  };
  if (parts == 1) {
    each(0, 1);
  } else {
    at::parallel_for(0, parts, 1, each);
  }
}

inline std::vector<int64_t> numels_of(at::TensorList tensors) {
  std::vector<int64_t> numels;
  numels.reserve(tensors.size());
  for (const auto& t : tensors) numels.push_back(t.numel());
  return numels;
}

// offsets[t]: where tensor t starts among the tensors laid end to end; offsets.back(): the total.
inline std::vector<int64_t> offsets_of(const std::vector<int64_t>& numels) {
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t t = 0; t < numels.size(); ++t) offsets[t + 1] = offsets[t] + numels[t];
  return offsets;
}

// The start of each part (parts + 1 entries, the last = total): its share of the elements, moved
// down to a multiple of `align` elements of the tensor it falls in.
inline std::vector<int64_t> part_starts(const std::vector<int64_t>& offsets, int64_t parts, int64_t align) {
  const int64_t total = offsets.back();
  std::vector<int64_t> starts(parts + 1, total);
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t s = total * i / parts;
    const int64_t base = *(std::upper_bound(offsets.begin(), offsets.end(), s) - 1);
    starts[i] = base + (s - base) / align * align;
  }
  return starts;
}

// fn(tensor, begin, end) for each tensor's piece of the elements [s, end) (empty tensors skipped).
template <typename F>
inline void for_each_segment(const std::vector<int64_t>& offsets, int64_t s, int64_t end, const F& fn) {
  while (s < end) {
    // the last tensor that starts at or before s: a non-empty one, as s < total
    const auto t = static_cast<int64_t>(std::upper_bound(offsets.begin(), offsets.end(), s) - offsets.begin() - 1);
    const int64_t stop = std::min(end, offsets[t + 1]);
    fn(t, s - offsets[t], stop - offsets[t]);
    s = stop;
  }
}

// The launcher: fn(tensor_index, begin, end) over every element of every tensor. A part's ends
// are moved down to a multiple of kAlign elements of their tensor (whole cache lines and SIMD
// blocks: no false sharing, no staged tail inside a tensor; whole 256-element blocks of 8-bit
// state, compact_state.h, which only the thread owning a block may encode), and a thread streams through each of
// its tensors in one call, as torch's per-tensor kernels do (16K-element items, one call each,
// measured 5-15% slower when memory-bound).
constexpr int64_t kAlign = 256;

template <typename F>
inline void multi_tensor_apply(const std::vector<int64_t>& numels, const F& fn) {
  const auto offsets = offsets_of(numels);
  const int64_t parts = parts_for(offsets.back());
  const auto starts = part_starts(offsets, parts, kAlign);
  run_parts(parts, [&](int64_t i) { for_each_segment(offsets, starts[i], starts[i + 1], fn); });
}

}  // namespace fused_optim
