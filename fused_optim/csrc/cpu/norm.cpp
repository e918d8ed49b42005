// fused_optim::l2norm: the L2 norm of every tensor of a list and of the whole list, in one
// parallel pass. Squares are accumulated in the math type (fp32 for fp16/bf16) within a work item
// and in double across items, tensors and the global sum, always in the same order: the result
// does not depend on the number of threads. Tensors may have different floating dtypes.
//   per_tensor[i] = sqrt(sum(x_i^2)) ; global = sqrt(sum_i per_tensor[i]^2)
// Both results are float32, or float64 when any input is float64.
#include "multi_tensor.h"
#include "ops.h"

#include <ATen/ops/empty.h>

#include <cmath>

namespace fused_optim {

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList tensors) {
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> numels;
  bool any_double = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& x = tensors[i];
    TORCH_CHECK(x.device().is_cpu(), "fused_optim::l2norm: tensors[", i, "] is on ", x.device(),
                "; the CPU kernel needs CPU tensors");
    TORCH_CHECK(at::isFloatingType(x.scalar_type()), "fused_optim::l2norm: tensors[", i, "] has dtype ",
                x.scalar_type(), "; only floating-point tensors are supported");
    any_double = any_double || x.scalar_type() == at::kDouble;
    inputs.push_back(x.contiguous());
    numels.push_back(x.numel());
  }
  const auto sums = multi_tensor_sums<1>(numels, [&](int64_t t, int64_t begin, int64_t end) {
    return FUSED_OPTIM_DISPATCH_FLOATING(inputs[t].scalar_type(), "fused_optim::l2norm", [&] {
      return std::array<double, 1>{sum_of_squares(cptr<scalar_t>(inputs[t]), begin, end)};
    });
  });
  at::Tensor per_tensor = at::empty({static_cast<int64_t>(sums.size())}, at::TensorOptions().dtype(at::kDouble));
  at::Tensor global = at::empty({}, at::TensorOptions().dtype(at::kDouble));
  double total = 0.0;
  for (size_t i = 0; i < sums.size(); ++i) {
    total += sums[i][0];
    ptr<double>(per_tensor)[i] = std::sqrt(sums[i][0]);
  }
  *ptr<double>(global) = std::sqrt(total);
  if (!any_double) return {global.to(at::kFloat), per_tensor.to(at::kFloat)};
  return {global, per_tensor};
}

}  // namespace fused_optim
