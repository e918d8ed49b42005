// Sums whose result does not depend on the number of threads: multi_tensor_sums (per-tensor sums
// of K quantities over fixed work items, added in item order) and the in-item reductions the ops
// sum with (lane_sum, sum_of_squares: fixed accumulator and lane order).
#pragma once

#include "multi_tensor.h"

#include <algorithm>
#include <array>
#include <vector>

namespace fused_optim {

// A work item of the sums: 16K elements, 64 KiB of fp32 per stream, whole cache lines for every dtype.
constexpr int64_t kChunk = 16384;

// Fixed-order sums. Item j of tensor t is its elements [j*kChunk, (j+1)*kChunk); each item's K
// partial sums go to their own slot, and a tensor's totals add its slots in item order, so they
// do not depend on how many threads share the items. Parts end on item boundaries.
template <size_t K>
struct ItemSums {
  using Sums = std::array<double, K>;
  std::vector<int64_t> offsets, starts;
  std::vector<int64_t> first;  // the slots of tensor t: [first[t], first[t + 1])
  std::vector<Sums> partial;

  explicit ItemSums(const std::vector<int64_t>& numels)
      : offsets(offsets_of(numels)), starts(part_starts(offsets, parts_for(offsets.back()), kChunk)),
        first(numels.size() + 1, 0) {
    for (size_t t = 0; t < numels.size(); ++t) first[t + 1] = first[t] + (numels[t] + kChunk - 1) / kChunk;
    partial.resize(first.back());
  }

  int64_t parts() const { return static_cast<int64_t>(starts.size()) - 1; }

  // segment(t, begin, end) for each tensor piece of part i.
  template <typename F>
  void for_each_segment_of(int64_t i, const F& segment) const {
    for_each_segment(offsets, starts[i], starts[i + 1], segment);
  }

  // The partial sums fn(t, b, e) of the items of [begin, end) of tensor t (begin on an item boundary).
  template <typename F>
  void sum_items(int64_t t, int64_t begin, int64_t end, const F& fn) {
    for (int64_t b = begin; b < end; b += kChunk) slot(t, b) = fn(t, b, std::min(b + kChunk, end));
  }

  // The slot of the item of tensor t that starts at `begin`.
  Sums& slot(int64_t t, int64_t begin) { return partial[first[t] + begin / kChunk]; }

  Sums totals(int64_t t) const {
    Sums s{};
    for (int64_t k = first[t]; k < first[t + 1]; ++k) {
      for (size_t j = 0; j < K; ++j) s[j] += partial[k][j];
    }
    return s;
  }
};

// Per-tensor sums of K quantities: fn(tensor_index, begin, end) returns an item's K partial sums
// (see ItemSums: the result does not depend on the number of threads).
template <size_t K, typename F>
inline std::vector<std::array<double, K>> multi_tensor_sums(const std::vector<int64_t>& numels, const F& fn) {
  ItemSums<K> items(numels);
  run_parts(items.parts(), [&](int64_t i) {
    items.for_each_segment_of(i, [&](int64_t t, int64_t begin, int64_t end) { items.sum_items(t, begin, end, fn); });
  });
  std::vector<std::array<double, K>> sums(numels.size());
  for (size_t t = 0; t < numels.size(); ++t) sums[t] = items.totals(static_cast<int64_t>(t));
  return sums;
}

// The lanes of a vector added in lane order, in double.
template <typename V>
inline double lane_sum(const V& v) {
  using M = typename V::value_type;
  std::array<M, V::size()> lanes;
  v.store(lanes.data());
  double sum = 0.0;
  for (const M x : lanes) sum += static_cast<double>(x);
  return sum;
}

// The in-item sum of squares: step() adds x^2 of one kStep-element run to four independent
// accumulators (a single FMA chain would bound the loop by the FMA latency), finish(s, ...) the
// rest of [i, end) through for_each_block, then returns the total in double. The same calls in the
// same order give the same bits, whichever other stream a thread reads in between. finish takes
// a copy: a Squares whose address escaped to an out-of-line call would keep its accumulators on
// the stack through the loop (GCC 12 did so for the second of two).
template <typename T>
struct Squares {
  using V = FVec<T>;
  static constexpr int64_t kStep = 4 * kBlock<T>;
  static constexpr int kAcc = 4 * kHalves<T>;  // every half of every block of a step its own chain
  V acc[kAcc];

  Squares() {
    for (auto& a : acc) a = V(0);
  }

  C10_ALWAYS_INLINE void step(const T* x) {
    for (int u = 0; u < 4; ++u) {
      const Block<T> b = load_block(x + u * kBlock<T>);
      for (int h = 0; h < kHalves<T>; ++h) acc[u * kHalves<T> + h] = at::vec::fmadd(b.v[h], b.v[h], acc[u * kHalves<T> + h]);
    }
  }

  static double finish(Squares s, const T* x, int64_t i, int64_t end) {
    for_each_block<T>(i, end, [&](auto& v) { s.acc[0] = at::vec::fmadd(v, v, s.acc[0]); }, x);
    for (int k = 1; k < kAcc; ++k) s.acc[0] = s.acc[0] + s.acc[k];
    return lane_sum(s.acc[0]);
  }
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16: one vdpbf16ps per 32 elements (x[2i]^2 + x[2i+1]^2 added to fp32 lanes) and no conversion.
// The products of bf16 values are exact in fp32; only inputs whose squares underflow fp32 anyway
// are flushed. Same fixed order, so still independent of the thread count.
template <>
struct Squares<c10::BFloat16> {
  static constexpr int64_t kStep = 128;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};

  C10_ALWAYS_INLINE void step(const c10::BFloat16* x) {
    for (int u = 0; u < 4; ++u) {
      const auto v = (__m512bh)_mm512_loadu_si512(x + u * 32);
      acc[u] = _mm512_dpbf16_ps(acc[u], v, v);
    }
  }

  static double finish(Squares s, const c10::BFloat16* x, int64_t i, int64_t end) {
    FVec<c10::BFloat16> rest(0);
    for_each_block<c10::BFloat16>(i, end, [&](auto& v) { rest = at::vec::fmadd(v, v, rest); }, x);
    return lane_sum(
        FVec<c10::BFloat16>(_mm512_add_ps(_mm512_add_ps(s.acc[0], s.acc[1]), _mm512_add_ps(s.acc[2], s.acc[3]))) + rest);
  }
};
#endif

// Sum of x^2 over [begin, end) in the math type (Squares).
template <typename T>
inline double sum_of_squares(const T* x, int64_t begin, int64_t end) {
  constexpr int64_t kStep = Squares<T>::kStep;
  Squares<T> s;
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) s.step(x + i);
  return Squares<T>::finish(s, x, i, end);
}

// {sum_of_squares(x, 0, nx), sum_of_squares(y, 0, ny)}, the same bits, read side by side while
// both have whole steps: two memory streams in flight, which one thread reads faster than one
// stream at a time (bf16 on AVX-512, one thread: two 25.6M-element streams 1.3-1.4x faster side by
// side than item by item, one stream's two halves 1.7x faster than the stream in order).
template <typename T>
inline std::array<double, 2> sums_of_squares(const T* x, int64_t nx, const T* y, int64_t ny) {
  constexpr int64_t kStep = Squares<T>::kStep;
  Squares<T> a, b;
  int64_t i = 0;
  for (; i + kStep <= std::min(nx, ny); i += kStep) {
    a.step(x + i);
    b.step(y + i);
  }
  int64_t j = i;
  for (; i + kStep <= nx; i += kStep) a.step(x + i);
  for (; j + kStep <= ny; j += kStep) b.step(y + j);
  return {Squares<T>::finish(a, x, i, nx), Squares<T>::finish(b, y, j, ny)};
}

// The sums of squares of x and y over [begin, end): side by side when they have the same type.
template <typename A, typename B>
inline std::array<double, 2> sums_of_squares(const A* x, const B* y, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<A, B>) {
    return sums_of_squares(x + begin, end - begin, y + begin, end - begin);
  } else {
    return {sum_of_squares(x, begin, end), sum_of_squares(y, begin, end)};
  }
}

// Per-tensor sums of squares, the bits of multi_tensor_sums<1> with sum_of_squares per item, each
// thread reading the items of its part two at a time, one from each half (two memory streams in
// flight, see sums_of_squares). one(t, begin, end) sums one item; two(t, b, e, u, c, f) the items
// [b, e) of tensor t and [c, f) of tensor u.
template <typename One, typename Two>
inline std::vector<double> multi_tensor_squares(const std::vector<int64_t>& numels, const One& one, const Two& two) {
  ItemSums<1> items(numels);
  run_parts(items.parts(), [&](int64_t i) {
    std::vector<std::array<int64_t, 3>> list;  // the items of part i: tensor, begin, end
    items.for_each_segment_of(i, [&](int64_t t, int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; b += kChunk) list.push_back({t, b, std::min(b + kChunk, end)});
    });
    const size_t half = (list.size() + 1) / 2;
    for (size_t k = 0; k < half; ++k) {
      const auto [t, b, e] = list[k];
      if (k + half == list.size()) {
        items.slot(t, b)[0] = one(t, b, e);
        continue;
      }
      const auto [u, c, f] = list[k + half];
      const std::array<double, 2> sums = two(t, b, e, u, c, f);
      items.slot(t, b)[0] = sums[0];
      items.slot(u, c)[0] = sums[1];
    }
  });
  std::vector<double> sums(numels.size());
  for (size_t t = 0; t < numels.size(); ++t) sums[t] = items.totals(static_cast<int64_t>(t))[0];
  return sums;
}

}  // namespace fused_optim
