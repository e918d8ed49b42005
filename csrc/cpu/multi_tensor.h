// The only CPU launcher of fused_optim.
//
// An op hands over every tensor of one (group, device, dtype) bucket at once, and the launcher
// runs ONE parallel region over all of them, so a model of many small tensors pays for one region
// per step instead of one per tensor. multi_tensor_apply shares the elements out between threads
// by count; the fixed-order sums (fixed_order_sums.h) and the two-pass ops (two_pass.h) cut them
// into work items on the same parts. Inside a piece, an op walks the elements with
// for_each_block() (simd_blocks.h).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

namespace fused_optim {

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
