// The norm ops, both on one parallel pass of per-tensor sums of squares. Squares are accumulated
// in the math type (fp32 for fp16/bf16) within a work item and in double across items, tensors
// and the global sum, always in the same order: results do not depend on the number of threads.
// Tensors may have different floating dtypes.
//   fused_optim::l2norm:        per_tensor[i] = sqrt(sum(x_i^2)) ; global = sqrt(sum_i per_tensor[i]^2)
//                               (float32, or float64 when any input is float64)
//   fused_optim::sum_squares_:  sums[index[i]] += sum(x_i^2)   (sums: float64, in tensor order)
#include "../host/checks.h"
#include "fixed_order_sums.h"
#include "ops.h"
#include "multi_tensor.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

namespace fused_optim {
namespace {

// sum(x^2) of every tensor, in double; `op` names the caller in errors.
std::vector<double> squares_per_tensor(at::TensorList tensors, const char* op) {
  std::vector<int64_t> numels;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& x = tensors[i];
    TORCH_CHECK(x.device().is_cpu(), op, ": tensors[", i, "] is on ", x.device(),
                "; the CPU kernel needs CPU tensors");
    TORCH_CHECK(x.layout() == at::kStrided, op, ": tensors[", i, "] is sparse; only dense tensors are supported");
    TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": tensors[", i, "] has dtype ", x.scalar_type(),
                "; only floating-point tensors are supported");
    numels.push_back(x.numel());
  }
  const ContiguousTensors inputs(tensors);
  auto one = [&](int64_t t, int64_t begin, int64_t end) {
    return FUSED_OPTIM_DISPATCH_FLOATING(inputs[t].scalar_type(), "fused_optim norm",
                                         [&] { return sum_of_squares(cptr<scalar_t>(inputs[t]), begin, end); });
  };
  return multi_tensor_squares(
      numels, one, [&](int64_t t, int64_t b, int64_t e, int64_t u, int64_t c, int64_t f) -> std::array<double, 2> {
        if (inputs[t].scalar_type() != inputs[u].scalar_type()) return {one(t, b, e), one(u, c, f)};
        return FUSED_OPTIM_DISPATCH_FLOATING(inputs[t].scalar_type(), "fused_optim norm", [&] {
          return sums_of_squares(cptr<scalar_t>(inputs[t]) + b, e - b, cptr<scalar_t>(inputs[u]) + c, f - c);
        });
      });
}

}  // namespace

double squares_cpu(const at::Tensor& x, const char* op) {
  if (x.numel() <= kChunk && x.layout() == at::kStrided && x.device().is_cpu() && x.is_contiguous() &&
      at::isFloatingType(x.scalar_type())) {
    return FUSED_OPTIM_DISPATCH_FLOATING(x.scalar_type(), "fused_optim norm",
                                         [&] { return sum_of_squares(cptr<scalar_t>(x), 0, x.numel()); });
  }
  return squares_per_tensor(x, op)[0];
}

namespace {

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList tensors) {
  const auto squares = squares_per_tensor(tensors, "fused_optim::l2norm");
  bool any_double = false;
  for (const auto& x : tensors) any_double = any_double || x.scalar_type() == at::kDouble;
  at::Tensor per_tensor = at::empty({static_cast<int64_t>(squares.size())}, at::TensorOptions().dtype(at::kDouble));
  at::Tensor global = at::empty({}, at::TensorOptions().dtype(at::kDouble));
  double total = 0.0;
  for (size_t i = 0; i < squares.size(); ++i) {
    total += squares[i];
    ptr<double>(per_tensor)[i] = std::sqrt(squares[i]);
  }
  *ptr<double>(global) = std::sqrt(total);
  if (!any_double) return {global.to(at::kFloat), per_tensor.to(at::kFloat)};
  return {global, per_tensor};
}

void sum_squares_cpu(const at::Tensor& sums, at::TensorList tensors, c10::IntArrayRef index) {
  const char* op = "fused_optim::sum_squares_";
  TORCH_CHECK(sums.device().is_cpu() && sums.scalar_type() == at::kDouble && sums.dim() == 1 && sums.is_contiguous(),
              op, ": sums must be a contiguous 1-D float64 CPU tensor, got ", sums.scalar_type(), " of shape ",
              sums.sizes(), " on ", sums.device());
  check_sums_index(op, "tensor", tensors.size(), index, sums.numel());
  const auto squares = squares_per_tensor(tensors, op);
  double* out = ptr<double>(sums);
  for (size_t i = 0; i < squares.size(); ++i) out[index[i]] += squares[i];
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("l2norm", &l2norm_cpu);
  m.impl("sum_squares_", &sum_squares_cpu);
}

}  // namespace fused_optim
