// The launcher of the two-pass ops (LAMB, LARS): per-tensor sums, then an update that needs them,
// each tensor's update right after its sums (multi_tensor_two_pass).
#pragma once

#include "fixed_order_sums.h"
#include "multi_tensor.h"
#include "../host/checks.h"

#include <algorithm>
#include <array>
#include <optional>
#include <vector>

namespace fused_optim {

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
// Given totals (`given`, a sharded step's second call: see NormSums), finish(t, ·) gets row t of
// them in place of those summed; the sums still run (they may update state, as LAMB's do).
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
                           const Update& update, const double* given = nullptr) {
  const size_t n = numels.size();
  auto finish_with = [&](int64_t t, const std::array<double, K>& summed) {
    if (given == nullptr) return finish(t, summed);
    std::array<double, K> row;
    std::copy_n(given + t * static_cast<int64_t>(K), K, row.begin());
    finish(t, row);
  };
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
      finish_with(t, items.totals(t));
      update(t, int64_t{0}, numels[t], where);
    });
  });
  std::vector<int64_t> rest, rest_numels;
  for (size_t t = 0; t < n; ++t) {
    if (!shared[t]) continue;
    finish_with(static_cast<int64_t>(t), items.totals(static_cast<int64_t>(t)));
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
    finish_with(t, multi_tensor_sums<K>({numels[i]}, [&](int64_t, int64_t begin, int64_t end) {
             return sum(t, begin, end, Placement::kAll);
           })[0]);
    multi_tensor_apply({numels[i]}, [&](int64_t, int64_t begin, int64_t end) {
      update_backwards(begin, end, [&](int64_t b, int64_t e) { update(t, b, e, Placement::kAll); });
    });
  }
}

// The first pass alone: each tensor's K totals, the bits multi_tensor_two_pass hands finish()
// (the same work items, added in the same order), written to rows[t*K, t*K + K) (zeros for an
// empty tensor). sum(t, begin, end, Placement::kSplit) as there: it hands nothing to an update.
template <size_t K, typename Sum>
void two_pass_sums(const std::vector<int64_t>& numels, const Sum& sum, double* rows) {
  const auto totals = multi_tensor_sums<K>(
      numels, [&](int64_t t, int64_t begin, int64_t end) { return sum(t, begin, end, Placement::kSplit); });
  for (size_t t = 0; t < numels.size(); ++t) std::copy(totals[t].begin(), totals[t].end(), rows + t * K);
}

// The norm_sums / sums_only arguments of a layer-wise op, for a sharded param's whole-tensor norms
// (fused_optim/sharding.py calls the op twice): sums_only, the local per-tensor sums (||p||^2 and
// the op's second quantity squared) into `rows` and nothing else written; then the update with
// the all-reduced rows as the totals (multi_tensor_two_pass's `given`). rows null: one call.
struct NormSums {
  double* rows = nullptr;  // the [n, 2] float64 norm_sums, row t for tensor t
  bool sums_only = false;
};

// The checked arguments (csrc/host/checks.h: checked_norm_sums).
inline NormSums norm_sums_of(const char* op, const std::optional<at::Tensor>& norm_sums, bool sums_only,
                             at::TensorList params) {
  return {checked_norm_sums(op, norm_sums, sums_only, params), sums_only};
}

}  // namespace fused_optim
