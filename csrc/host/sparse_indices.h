// The coordinates sparsified_sgd_ applies each step, drawn on the CPU with the same ATen calls as
// the reference (fused_optim/_reference.py), so the CPU and CUDA kernels and the reference follow
// one generator: per tensor of D elements, in order, with k clamped to D, randperm(D)[:k] (random)
// or the block [b*k, min(b*k + k, D)) with b uniform in [0, ceil(D/k)); none (and no draw) for an
// empty tensor. int64 CPU tensors.
//
// A shard (a DTensor's local tensor, a contiguous range of its whole tensor: FSDP2's Shard(0))
// draws the indices of its whole tensor, of whole_numels[t] elements, as every rank does with
// the same generator state, and applies those in [element_offsets[t], + its numel), shifted to
// its own indices: the shards together apply the whole tensor's k coordinates.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/masked_select.h>
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

inline std::vector<at::Tensor> draw_sparse_indices(at::TensorList params, int64_t k, bool random,
                                                   const std::optional<at::Generator>& generator,
                                                   c10::IntArrayRef whole_numels = {},
                                                   c10::IntArrayRef element_offsets = {}) {
  const bool shards = !whole_numels.empty();
  TORCH_CHECK(whole_numels.size() == element_offsets.size() && (!shards || whole_numels.size() == params.size()),
              "fused_optim::sparsified_sgd_: whole_numels and element_offsets need one entry per param, or none (",
              whole_numels.size(), " and ", element_offsets.size(), " for ", params.size(), " params)");
  const auto longs = at::TensorOptions().dtype(at::kLong);
  std::vector<at::Tensor> indices;
  for (size_t t = 0; t < params.size(); ++t) {
    const int64_t n = params[t].numel();
    const int64_t d = shards ? whole_numels[t] : n;
    const int64_t offset = shards ? element_offsets[t] : 0;
    TORCH_CHECK(offset >= 0 && offset + n <= d, "fused_optim::sparsified_sgd_: param ", t, " of ", n,
                " elements at element_offsets ", offset, " does not lie in its whole tensor of ", d);
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
    indices.push_back(shards ? at::masked_select(index, index.ge(offset).logical_and(index.lt(offset + n))).sub_(offset)
                             : index);
  }
  return indices;
}

}  // namespace fused_optim
