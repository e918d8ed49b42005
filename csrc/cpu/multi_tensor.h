// The only CPU launcher of fused_optim.
//
// An op hands over every tensor of one (group, device, dtype) bucket at once, and the launcher
// runs ONE parallel region over all of them, so a model of many small tensors pays for one region
// per step instead of one per tensor. multi_tensor_apply shares the elements out between threads
// by count; multi_tensor_sums cuts them into kChunk-element work items whose partial sums are
// added in a fixed order. Inside a piece, for_each_block() walks the elements in SIMD blocks of
// at::vec::Vectorized converted to the op's math type (fp32 for fp16/bf16 storage, otherwise the
// storage type); the tail of a piece is staged through a zero-padded stack buffer so each op
// writes its math exactly once.
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

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../shared/checks.h"

namespace fused_optim {

// A work item of the sums: 16K elements, 64 KiB of fp32 per stream, whole cache lines for every dtype.
constexpr int64_t kChunk = 16384;
// Below this many elements in a bucket, one thread does everything (a parallel region costs more).
constexpr int64_t kSerialBelow = 32768;

template <typename T>
using opmath_t = at::opmath_type<T>;
template <typename T>
using FVec = at::vec::Vectorized<opmath_t<T>>;

// ---------------------------------------------------------------------------------------------
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

template <typename T>
C10_ALWAYS_INLINE Block<T> load_block(const T* p) {
  Block<T> b;
  if constexpr (kHalves<T> == 2) {
    at::vec::load_to_float(p, b.v[0], b.v[1]);
  } else {
    b.v[0] = FVec<T>::loadu(p);
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
#endif
    at::vec::convert_from_float<T>(b.v[0], b.v[1]).store(p);
  } else {
    b.v[0].store(p);
  }
}

// Read-only streams (const pointers) are never written back.
template <typename T>
C10_ALWAYS_INLINE void store_block(const T*, const Block<T>&) {}

template <typename T, typename Body, typename Tuple, size_t... I>
C10_ALWAYS_INLINE void run_block(const Body& body, const Tuple& ptrs, int64_t i, std::index_sequence<I...>) {
  auto vals = std::make_tuple(load_block(std::get<I>(ptrs) + i)...);
  for (int h = 0; h < kHalves<T>; ++h) body(std::get<I>(vals).v[h]...);
  (store_block(std::get<I>(ptrs) + i, std::get<I>(vals)), ...);
}

template <typename T>
inline void copy_back(T* dst, const T* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(T));
}

template <typename T>
inline void copy_back(const T*, const T*, int64_t) {}

// The tail of an item: staged through zero-padded buffers, same vector body, mutable ones copied back.
template <typename T, typename Body, typename Tuple, typename Staged, size_t... I>
inline void stage_tail(const Body& body, const Tuple& ptrs, Staged& staged, int64_t i, int64_t tail,
                       std::index_sequence<I...>) {
  (std::memcpy(staged[I].data(), std::get<I>(ptrs) + i, tail * sizeof(T)), ...);
  const auto staged_ptrs = std::make_tuple(
      static_cast<std::tuple_element_t<I, Tuple>>(staged[I].data())...);
  run_block<T>(body, staged_ptrs, 0, std::index_sequence<I...>{});
  (copy_back(std::get<I>(ptrs) + i, staged[I].data(), tail), ...);
}

// Calls body(v0, v1, ...) with one SIMD block of each stream, for elements [begin, end).
// body takes FVec<T>& for every stream and updates the mutable ones in place.
template <typename T, typename Body, typename... Ptr>
inline void for_each_block(int64_t begin, int64_t end, const Body& body, Ptr... streams) {
  constexpr int64_t L = kBlock<T>;
  constexpr size_t N = sizeof...(Ptr);
  using Seq = std::make_index_sequence<N>;
  const auto ptrs = std::make_tuple(streams...);
  int64_t i = begin;
  for (; i + L <= end; i += L) {
    run_block<T>(body, ptrs, i, Seq{});
  }
  const int64_t tail = end - i;
  if (tail == 0) return;
  std::array<std::array<T, L>, N> staged{};
  stage_tail<T>(body, ptrs, staged, i, tail, Seq{});
}

// ---------------------------------------------------------------------------------------------
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
// blocks: no false sharing, no staged tail inside a tensor), and a thread streams through each of
// its tensors in one call, as torch's per-tensor kernels do (16K-element items, one call each,
// measured 5-15% slower when memory-bound).
constexpr int64_t kAlign = 64;

template <typename F>
inline void multi_tensor_apply(const std::vector<int64_t>& numels, const F& fn) {
  const auto offsets = offsets_of(numels);
  const int64_t parts = parts_for(offsets.back());
  const auto starts = part_starts(offsets, parts, kAlign);
  run_parts(parts, [&](int64_t i) { for_each_segment(offsets, starts[i], starts[i + 1], fn); });
}

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

// Two-pass ops (LAMB, LARS): per-tensor sums of K quantities, then an update that needs them.
// sum(t, begin, end, where) returns one item's K partial sums (it may also update state of those
// elements: it runs once per item); finish(t, sums) gets tensor t's totals (as multi_tensor_sums
// has them) before update(t, begin, end, where) runs over the tensor. Both passes over a tensor
// run back to back, so the update finds it in the cache:
// - a tensor of up to kWhole elements: a thread runs both passes over each one it holds whole,
//   in one parallel region (Placement::kThread); the tensors shared between threads (at most one
//   per part boundary) are finished after it and updated in a second one (kSplit);
// - a larger one: all threads take it alone, the sums in one region, the update in the next, each
//   thread walking its piece backwards (update_backwards), so it starts with what the sums read
//   last (kAll). Two such tensors side by side would not fit the L3 cache (the update then reads
//   from memory: measured ~6% slower for LAMB on the ResNet-50 list).
// `where` tells an op what it may hand from a tensor's sums to its update (see Placement).
enum class Placement {
  kThread,  // both passes of the tensor on this thread, the update right after the last item
  kSplit,   // items summed on several threads, the update's pieces on others
  kAll,     // a tensor > kWhole: every thread sums items of it, then every thread updates a
            // piece of it, before the next tensor; [begin, end) are positions in the tensor
};

constexpr int64_t kWhole = int64_t{1} << 18;

// update(begin, end) over [begin, end) in 4-item steps, the last step first.
template <typename F>
inline void update_backwards(int64_t begin, int64_t end, const F& update) {
  constexpr int64_t kStep = 4 * kChunk;
  for (int64_t b = begin + (end - begin - 1) / kStep * kStep; b >= begin; b -= kStep) update(b, std::min(b + kStep, end));
}

template <size_t K, typename Sum, typename Finish, typename Update>
void multi_tensor_two_pass(const std::vector<int64_t>& numels, const Sum& sum, const Finish& finish,
                           const Update& update) {
  const size_t n = numels.size();
  std::vector<int64_t> small(numels);  // the large tensors as empty ones
  for (auto& numel : small) numel = numel > kWhole ? 0 : numel;
  ItemSums<K> items(small);
  std::vector<char> shared(n, 0);
  for (int64_t i = 1; i < items.parts(); ++i) {
    for_each_segment(items.offsets, items.starts[i], items.starts[i] + 1, [&](int64_t t, int64_t begin, int64_t) {
      if (begin > 0) shared[t] = 1;
    });
  }
  run_parts(items.parts(), [&](int64_t i) {
    items.for_each_segment_of(i, [&](int64_t t, int64_t begin, int64_t end) {
      const Placement where = shared[t] ? Placement::kSplit : Placement::kThread;
      items.sum_items(t, begin, end, [&](int64_t, int64_t b, int64_t e) { return sum(t, b, e, where); });
      if (shared[t]) return;
      finish(t, items.totals(t));
      update(t, int64_t{0}, numels[t], where);
    });
  });
  std::vector<int64_t> rest, rest_numels;
  for (size_t t = 0; t < n; ++t) {
    if (!shared[t]) continue;
    finish(static_cast<int64_t>(t), items.totals(static_cast<int64_t>(t)));
    rest.push_back(static_cast<int64_t>(t));
    rest_numels.push_back(numels[t]);
  }
  if (!rest.empty()) {
    multi_tensor_apply(rest_numels,
                       [&](int64_t k, int64_t begin, int64_t end) { update(rest[k], begin, end, Placement::kSplit); });
  }
  for (size_t i = 0; i < n; ++i) {
    if (numels[i] <= kWhole) continue;
    const auto t = static_cast<int64_t>(i);
    finish(t, multi_tensor_sums<K>({numels[i]}, [&](int64_t, int64_t begin, int64_t end) {
             return sum(t, begin, end, Placement::kAll);
           })[0]);
    multi_tensor_apply({numels[i]}, [&](int64_t, int64_t begin, int64_t end) {
      update_backwards(begin, end, [&](int64_t b, int64_t e) { update(t, b, e, Placement::kAll); });
    });
  }
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

// grad_scale / found_inf as set by torch.amp.GradScaler: skip everything when found_inf != 0,
// otherwise multiply grads by 1/grad_scale inside the kernel.
struct AmpArgs {
  bool skip = false;
  double inv_scale = 1.0;
};

inline AmpArgs read_amp(const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  AmpArgs amp;
  if (found_inf.has_value() && found_inf->defined()) {
    TORCH_CHECK(found_inf->numel() == 1, "fused_optim: found_inf must have one element");
    amp.skip = found_inf->item<double>() != 0.0;
  }
  if (grad_scale.has_value() && grad_scale->defined()) {
    TORCH_CHECK(grad_scale->numel() == 1, "fused_optim: grad_scale must have one element");
    amp.inv_scale = 1.0 / grad_scale->item<double>();
  }
  return amp;
}

// The learning rate: lr, or the value of lr_tensor when one is given (a Tensor lr of torch.optim).
inline double read_lr(double lr, const std::optional<at::Tensor>& lr_tensor) {
  if (!lr_tensor.has_value() || !lr_tensor->defined()) return lr;
  TORCH_CHECK(lr_tensor->numel() == 1, "fused_optim: lr_tensor must have one element, got ", lr_tensor->numel());
  return lr_tensor->item<double>();
}

template <typename T>
inline T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// A read-only stream (for_each_block never writes it back).
template <typename T>
inline const T* cptr(const at::Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}

// Float step counters (torch.optim's layout: 0-dim float32, or float64 under a float64 default),
// read and written through their data pointer: a dispatcher call per tensor would cost microseconds.
inline void check_steps(const char* op, at::TensorList params, at::TensorList steps) {
  check_same_size(op, "steps", params, steps);
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    TORCH_CHECK(s.numel() == 1 && s.device().is_cpu() &&
                    (s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble),
                "fused_optim::", op, ": steps[", i, "] must be a 1-element float32/float64 CPU tensor");
  }
}

inline double read_step(const at::Tensor& s) {
  return s.scalar_type() == at::kFloat ? static_cast<double>(*ptr<float>(s)) : *ptr<double>(s);
}

inline void write_step(const at::Tensor& s, double value) {
  if (s.scalar_type() == at::kFloat) {
    *ptr<float>(s) = static_cast<float>(value);
  } else {
    *ptr<double>(s) = value;
  }
}

// Adam's bias corrections {1 - beta1^step, 1 - beta2^step} ({1, 1} when disabled) for the step
// counts of a bucket's tensors in turn, recomputed only when a count differs from the previous
// one: a bucket's tensors usually share it, and std::pow was ~4% of a LAMB step of 200 small tensors.
class BiasCorrections {
 public:
  BiasCorrections(double beta1, double beta2, bool enabled) : beta1_(beta1), beta2_(beta2), enabled_(enabled) {}

  const std::array<double, 2>& at(double step) {
    if (step != step_ && enabled_) bc_ = {1.0 - std::pow(beta1_, step), 1.0 - std::pow(beta2_, step)};
    step_ = step;
    return bc_;
  }

 private:
  double beta1_, beta2_;
  bool enabled_;
  double step_ = -1.0;  // no step count: the first at() computes
  std::array<double, 2> bc_{1.0, 1.0};
};

#define FUSED_OPTIM_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

}  // namespace fused_optim
