// The coordinates sparsified_sgd_ applies each step, drawn on the CPU with the same ATen calls as
// the reference (fused_optim/_reference.py), so the CPU and CUDA kernels and the reference follow
// one generator: per tensor of D elements, in order, with k clamped to D, randperm(D)[:k] (random)
// or the block [b*k, min(b*k + k, D)) with b uniform in [0, ceil(D/k)); none (and no draw) for an
// empty tensor. int64 CPU tensors.
//
// A shard (a DTensor's local tensor: a box of its whole tensor, [o_d, o_d + n_d) in each dimension d)
// draws the indices of its whole tensor (its shape: whole_shapes), as every rank does with the
// same generator state, and applies those inside its box (box_offsets: the o_d), as its own flat
// indices: the shards together apply the whole tensor's k coordinates. The two lists hold the
// params' dimensions one after another (each param its dim() entries).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/masked_select.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/accumulate.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randperm.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace fused_optim {

// The flat indices of `index` (of a contiguous tensor of shape `whole`) inside the box at `offsets`
// of the shape of `local`, as flat indices of `local`.
inline at::Tensor indices_in_box(at::Tensor index, const at::Tensor& local, c10::IntArrayRef whole,
                                 c10::IntArrayRef offsets) {
  at::Tensor inside = at::ones_like(index, at::kBool), flat = at::zeros_like(index);
  int64_t stride = 1;
  for (int64_t d = local.dim() - 1; d >= 0; --d) {
    const at::Tensor coordinate = index.remainder(whole[d]).sub_(offsets[d]);
    index = index.div(whole[d], "floor");
    inside.logical_and_(coordinate.ge(0)).logical_and_(coordinate.lt(local.size(d)));
    flat.add_(coordinate.mul(stride));
    stride *= local.size(d);
  }
  return at::masked_select(flat, inside);
}

inline std::vector<at::Tensor> draw_sparse_indices(at::TensorList params, int64_t k, bool random,
                                                   const std::optional<at::Generator>& generator,
                                                   c10::IntArrayRef whole_shapes = {},
                                                   c10::IntArrayRef box_offsets = {}) {
  const bool shards = !whole_shapes.empty();
  size_t dims = 0;
  for (const auto& p : params) dims += static_cast<size_t>(p.dim());
  TORCH_CHECK(whole_shapes.size() == box_offsets.size() && (!shards || whole_shapes.size() == dims),
              "fused_optim::sparsified_sgd_: whole_shapes and box_offsets need one entry per dimension of each "
              "param, or none (", whole_shapes.size(), " and ", box_offsets.size(), " for ", dims, " dimensions)");
  for (size_t t = 0, first = 0; shards && t < params.size(); first += static_cast<size_t>(params[t].dim()), ++t) {
    for (int64_t d = 0; d < params[t].dim(); ++d) {  // (checked before anything is drawn or written)
      const int64_t o = box_offsets[first + d], n = params[t].size(d), w = whole_shapes[first + d];
      TORCH_CHECK(o >= 0 && o + n <= w, "fused_optim::sparsified_sgd_: param ", t, " (", params[t].sizes(),
                  ") at box_offsets ", box_offsets.slice(first, params[t].dim()), " does not lie in its whole tensor ",
                  whole_shapes.slice(first, params[t].dim()));
    }
  }
  const auto longs = at::TensorOptions().dtype(at::kLong);
  std::vector<at::Tensor> indices;
  for (size_t t = 0, first = 0; t < params.size(); first += static_cast<size_t>(params[t].dim()), ++t) {
    const auto whole = shards ? whole_shapes.slice(first, params[t].dim()) : params[t].sizes();
    const int64_t d = c10::multiply_integers(whole);
    const int64_t kd = std::min(k, d);  // k >= d sends every coordinate
    at::Tensor index;
    if (d == 0) {
      index = at::empty({0}, longs);  // nothing to send, nothing drawn
    } else if (random) {
      index = at::randperm(d, generator, longs).narrow(0, 0, kd);
    } else {
      const int64_t start = at::randint((d + kd - 1) / kd, {1}, generator, longs).item<int64_t>() * kd;
      index = at::arange(start, std::min(start + kd, d), at::kLong);
    }
    indices.push_back(shards ? indices_in_box(index, params[t], whole, box_offsets.slice(first, params[t].dim()))
                             : index);
  }
  return indices;
}

}  // namespace fused_optim
