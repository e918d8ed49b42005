// The coordinates sparsified_sgd_ applies each step, drawn on the CPU with the same ATen calls as
// the reference (fused_optim/_reference.py), so the CPU and CUDA kernels and the reference follow
// one generator: per tensor of D elements, in order, with k clamped to D, randperm(D)[:k] (random)
// or the block [b*k, min(b*k + k, D)) with b uniform in [0, ceil(D/k)); none (and no draw) for an
// empty tensor. int64 CPU tensors.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randperm.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace fused_optim {

inline std::vector<at::Tensor> draw_sparse_indices(at::TensorList params, int64_t k, bool random,
                                                   const std::optional<at::Generator>& generator) {
  const auto longs = at::TensorOptions().dtype(at::kLong);
  std::vector<at::Tensor> indices;
  for (const auto& p : params) {
    const int64_t d = p.numel();
    const int64_t kd = std::min(k, d);  // k >= d sends every coordinate
    if (d == 0) {
      indices.push_back(at::empty({0}, longs));  // nothing to send, nothing drawn
    } else if (random) {
      indices.push_back(at::randperm(d, generator, longs).narrow(0, 0, kd));
    } else {
      const int64_t start = at::randint((d + kd - 1) / kd, {1}, generator, longs).item<int64_t>() * kd;
      indices.push_back(at::arange(start, std::min(start + kd, d), at::kLong));
    }
  }
  return indices;
}

}  // namespace fused_optim
