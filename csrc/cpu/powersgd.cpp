// PowerSGD's two passes over the error memories, each one parallel pass over the rows of every
// compressed matrix of a step (the math and its torch-op reference: fused_optim/distributed/powersgd.py,
// accumulate_project_ and decompress_). Per matrix i, E and G n × m, Qᵀ r × m, Pᵀ r × n (r ≤ 4),
// all contiguous, one float dtype:
//   fused_optim::powersgd_accumulate_(memories, grads, qts, pts):
//       E ← E + G ;  Pᵀ[k, j] = Σ_l Qᵀ[k, l] · E[j, l]
//   fused_optim::powersgd_decompress_(memories, grads, pts, qts):
//       G[j, l] = Σ_k Pᵀ[k, j] · Qᵀ[k, l] ;  E[j, l] ← E[j, l] − G[j, l]
// Summation orders (fixed: a row is one thread's, so no result depends on the thread count):
//   the dot product over l: W-lane SIMD blocks l = 0, W, 2W, … (the tail zero-padded), block b
//   fused-multiply-added into accumulator b mod 2 lane by lane; then the two accumulators added,
//   then their W lanes summed from lane 0 up.
//   the sum over k: p₀·q₀, then fma(p_k, q_k, ·) for k = 1, …, r − 1 (for r = 1 one rounded product,
//   as torch's matmul).
#include "multi_tensor.h"

#include "ops.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

namespace fused_optim {
namespace {

constexpr int64_t kPowerSgdMaxRank = 4;
constexpr int64_t kPowerSgdRowGrain = 8;

// Checks one call's lists (names of the op's arguments in errors) and returns each matrix's rank r.
std::vector<int64_t> powersgd_ranks(const char* op, at::TensorList memories, at::TensorList grads,
                                    at::TensorList pts, at::TensorList qts) {
  TORCH_CHECK(grads.size() == memories.size() && pts.size() == memories.size() && qts.size() == memories.size(),
              "fused_optim::", op, ": memories, grads, pts and qts must have one tensor per matrix, got ",
              memories.size(), ", ", grads.size(), ", ", pts.size(), " and ", qts.size());
  std::vector<int64_t> ranks(memories.size());
  for (size_t i = 0; i < memories.size(); ++i) {
    const auto& e = memories[i];
    TORCH_CHECK(e.dim() == 2 && e.device().is_cpu() && e.is_contiguous() &&
                    (e.scalar_type() == at::kFloat || e.scalar_type() == at::kDouble),
                "fused_optim::", op, ": memories[", i, "] must be a contiguous float32/float64 CPU matrix, got ",
                e.scalar_type(), " of shape ", e.sizes(), " on ", e.device());
    const int64_t n = e.size(0), m = e.size(1), r = pts[i].dim() == 2 ? pts[i].size(0) : -1;
    TORCH_CHECK(r >= 1 && r <= kPowerSgdMaxRank, "fused_optim::", op, ": pts[", i, "] must be r × ", n,
                " with 1 ≤ r ≤ ", kPowerSgdMaxRank, ", got shape ", pts[i].sizes());
    const std::pair<const at::Tensor*, std::vector<int64_t>> expected[] = {
        {&grads[i], {n, m}}, {&pts[i], {r, n}}, {&qts[i], {r, m}}};
    const char* names[] = {"grads", "pts", "qts"};
    for (int w = 0; w < 3; ++w) {
      const auto& t = *expected[w].first;
      TORCH_CHECK(t.sizes() == c10::IntArrayRef(expected[w].second) && t.scalar_type() == e.scalar_type() &&
                      t.device().is_cpu() && t.is_contiguous(),
                  "fused_optim::", op, ": ", names[w], "[", i, "] must be a contiguous ", e.scalar_type(),
                  " CPU tensor of shape ", c10::IntArrayRef(expected[w].second), " (memories[", i, "] is ", n,
                  " × ", m, "), got ", t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
    }
    TORCH_CHECK(e.scalar_type() == memories[0].scalar_type(), "fused_optim::", op, ": memories[", i,
                "] has dtype ", e.scalar_type(), " but memories[0] has ", memories[0].scalar_type(),
                "; one call takes one dtype");
    ranks[i] = r;
  }
  return ranks;
}

// fn(i, j) for every row j of every matrix i, the rows shared between threads.
template <typename F>
void for_each_row(at::TensorList memories, const F& fn) {
  std::vector<int64_t> first_row(memories.size() + 1, 0);
  for (size_t i = 0; i < memories.size(); ++i) first_row[i + 1] = first_row[i] + memories[i].size(0);
  at::parallel_for(0, first_row.back(), kPowerSgdRowGrain, [&](int64_t begin, int64_t end) {
    int64_t i = std::upper_bound(first_row.begin(), first_row.end(), begin) - first_row.begin() - 1;
    for (int64_t row = begin; row < end; ++row) {
      while (row >= first_row[i + 1]) ++i;
      fn(i, row - first_row[i]);
    }
  });
}

template <typename T>
T row_lane_sum(const at::vec::Vectorized<T>& v) {
  __at_align__ T lanes[at::vec::Vectorized<T>::size()];
  v.store(lanes);
  T sum = lanes[0];
  for (int64_t w = 1; w < at::vec::Vectorized<T>::size(); ++w) sum += lanes[w];
  return sum;
}

// c ≤ W elements at x as one block (a tail zero-padded), and the first c lanes of v stored to x.
template <typename V, typename T>
C10_ALWAYS_INLINE V load_first(const T* x, int64_t c) {
  return c == V::size() ? V::loadu(x) : V::loadu(x, c);
}
template <typename V, typename T>
C10_ALWAYS_INLINE void store_first(const V& v, T* x, int64_t c) {
  if (c == V::size()) {
    v.store(x);
  } else {
    v.store(x, c);
  }
}

// The two passes on row j of one matrix: e, g its rows of E and G, p[k·n] (k < R) column j of Pᵀ.
// Row j of E ← E + G, and its R dot products with the rows of Qᵀ, stored to p[k·n].
struct Accumulate {
  template <typename T, int R>
  static void row(T* e, T* g, T* p, int64_t n, const T* qt, int64_t m) {
    using V = at::vec::Vectorized<T>;
    constexpr int64_t W = V::size();
    V acc[R][2];
    for (int k = 0; k < R; ++k) acc[k][0] = acc[k][1] = V(T(0));
    int u = 0;
    for (int64_t l = 0; l < m; l += W, u ^= 1) {
      const int64_t c = std::min(W, m - l);
      const V s = load_first<V>(e + l, c) + load_first<V>(g + l, c);
      store_first(s, e + l, c);
      for (int k = 0; k < R; ++k) acc[k][u] = at::vec::fmadd(load_first<V>(qt + k * m + l, c), s, acc[k][u]);
    }
    for (int k = 0; k < R; ++k) p[k * n] = row_lane_sum(acc[k][0] + acc[k][1]);
  }
};

// Row j of G = P·Qᵀ and E ← E − G.
struct Decompress {
  template <typename T, int R>
  static void row(T* e, T* g, T* p, int64_t n, const T* qt, int64_t m) {
    using V = at::vec::Vectorized<T>;
    constexpr int64_t W = V::size();
    V pk[R];
    for (int k = 0; k < R; ++k) pk[k] = V(p[k * n]);
    for (int64_t l = 0; l < m; l += W) {
      const int64_t c = std::min(W, m - l);
      V u = pk[0] * load_first<V>(qt + l, c);
      for (int k = 1; k < R; ++k) u = at::vec::fmadd(pk[k], load_first<V>(qt + k * m + l, c), u);
      store_first(u, g + l, c);
      store_first(load_first<V>(e + l, c) - u, e + l, c);
    }
  }
};

// Pass::row on every row of every matrix, r = each matrix's rank (checked: 1 … kPowerSgdMaxRank).
template <typename Pass>
void powersgd_pass(const char* op, at::TensorList memories, at::TensorList grads, at::TensorList pts,
                   at::TensorList qts) {
  const auto ranks = powersgd_ranks(op, memories, grads, pts, qts);
  if (memories.empty()) return;
  AT_DISPATCH_FLOATING_TYPES(memories[0].scalar_type(), "fused_optim powersgd", [&] {
    using T = scalar_t;
    constexpr void (*rows[])(T*, T*, T*, int64_t, const T*, int64_t) = {
        Pass::template row<T, 1>, Pass::template row<T, 2>, Pass::template row<T, 3>, Pass::template row<T, 4>};
    static_assert(sizeof(rows) / sizeof(rows[0]) == kPowerSgdMaxRank);
    for_each_row(memories, [&](int64_t i, int64_t j) {
      const int64_t n = memories[i].size(0), m = memories[i].size(1);
      rows[ranks[i] - 1](ptr<T>(memories[i]) + j * m, ptr<T>(grads[i]) + j * m, ptr<T>(pts[i]) + j, n,
                         cptr<T>(qts[i]), m);
    });
  });
}

void powersgd_accumulate_cpu(at::TensorList memories, at::TensorList grads, at::TensorList qts, at::TensorList pts) {
  powersgd_pass<Accumulate>("powersgd_accumulate_", memories, grads, pts, qts);
}

void powersgd_decompress_cpu(at::TensorList memories, at::TensorList grads, at::TensorList pts, at::TensorList qts) {
  powersgd_pass<Decompress>("powersgd_decompress_", memories, grads, pts, qts);
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("powersgd_accumulate_", &powersgd_accumulate_cpu);
  m.impl("powersgd_decompress_", &powersgd_decompress_cpu);
}

}  // namespace fused_optim
