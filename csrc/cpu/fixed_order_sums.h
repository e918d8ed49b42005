// Sums whose result does not depend on the number of threads: multi_tensor_sums (per-tensor sums
// of K quantities over fixed work items, added in item order) and the in-item reductions the ops
// sum with (lane_sum, sum_of_squares: fixed accumulator and lane order).
#pragma once

#include "simd_blocks.h"
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
    for (int64_t b = begin; b < end; b += kChunk) partial[first[t] + b / kChunk] = fn(t, b, std::min(b + kChunk, end));
  }

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

// Sum of x^2 over [begin, end) in the math type, in four independent accumulators (a single
// FMA chain would bound the loop by the FMA latency), the remainder through for_each_block.
template <typename T>
inline double sum_of_squares(const T* x, int64_t begin, int64_t end) {
  using V = FVec<T>;
  constexpr int64_t L = kBlock<T>;
  constexpr int kAcc = 4 * kHalves<T>;  // every half of every block of an iteration its own chain
  V acc[kAcc];
  for (auto& a : acc) a = V(0);
  int64_t i = begin;
  for (; i + 4 * L <= end; i += 4 * L) {
    for (int u = 0; u < 4; ++u) {
      const Block<T> b = load_block(x + i + u * L);
      for (int h = 0; h < kHalves<T>; ++h) acc[u * kHalves<T> + h] = at::vec::fmadd(b.v[h], b.v[h], acc[u * kHalves<T> + h]);
    }
  }
  for_each_block<T>(i, end, [&](auto& v) { acc[0] = at::vec::fmadd(v, v, acc[0]); }, x);
  for (int k = 1; k < kAcc; ++k) acc[0] = acc[0] + acc[k];
  return lane_sum(acc[0]);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bf16: one vdpbf16ps per 32 elements (x[2i]^2 + x[2i+1]^2 added to fp32 lanes) and no conversion.
// The products of bf16 values are exact in fp32; only inputs whose squares underflow fp32 anyway
// are flushed. Same fixed order, so still independent of the thread count.
inline double sum_of_squares(const c10::BFloat16* x, int64_t begin, int64_t end) {
  constexpr int64_t L = 32;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = begin;
  for (; i + 4 * L <= end; i += 4 * L) {
    for (int u = 0; u < 4; ++u) {
      const auto v = (__m512bh)_mm512_loadu_si512(x + i + u * L);
      acc[u] = _mm512_dpbf16_ps(acc[u], v, v);
    }
  }
  FVec<c10::BFloat16> rest(0);
  for_each_block<c10::BFloat16>(i, end, [&](auto& v) { rest = at::vec::fmadd(v, v, rest); }, x);
  return lane_sum(FVec<c10::BFloat16>(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))) +
                  rest);
}
#endif

}  // namespace fused_optim
