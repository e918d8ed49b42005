// fused_optim::sparsified_sgd_: SGD with error feedback that applies only k coordinates per
// tensor each step (mlbench_core's SparsifiedSGD, for any param shape). Per tensor of D elements:
//   memory <- memory + lr*g/grad_scale                  (every element, one parallel pass)
//   p <- p - weight_decay*p                             (same pass; decay not multiplied by lr)
//   S <- k indices (shared/sparse_indices.h: random, or a random block; the reference's draws)
//   p[S] <- p[S] - memory[S] ; memory[S] <- 0
#include "../shared/sparse_indices.h"
#include "multi_tensor.h"
#include "op_args.h"
#include "ops.h"
#include "simd_blocks.h"

namespace fused_optim {
namespace {

template <typename T>
void apply_sparse(const at::Tensor& p, const at::Tensor& memory, const at::Tensor& index) {
  T* pp = ptr<T>(p);
  T* mp = ptr<T>(memory);
  const int64_t* ip = ptr<int64_t>(index);
  for (int64_t j = 0; j < index.numel(); ++j) {
    const int64_t i = ip[j];
    pp[i] = static_cast<T>(static_cast<opmath_t<T>>(pp[i]) - static_cast<opmath_t<T>>(mp[i]));
    mp[i] = static_cast<T>(0);
  }
}

}  // namespace

void sparsified_sgd_cpu(at::TensorList params, at::TensorList grads_in, at::TensorList memories, double lr,
                        double weight_decay, int64_t sparse_grad_size, bool random_sparse,
                        const std::optional<at::Generator>& generator, const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || params.empty()) return;
  TORCH_CHECK(sparse_grad_size > 0, "fused_optim::sparsified_sgd_: sparse_grad_size must be > 0");
  check_mutable("sparsified_sgd_", "params", params, params);
  const auto grads = checked_grads("sparsified_sgd_", params, grads_in);
  check_mutable("sparsified_sgd_", "memories", params, memories);
  const auto numels = numels_of(params);
  const auto indices = draw_sparse_indices(params, sparse_grad_size, random_sparse, generator);
  FUSED_OPTIM_DISPATCH_FLOATING(params[0].scalar_type(), "fused_optim::sparsified_sgd_", [&] {
    using M = opmath_t<scalar_t>;
    using V = FVec<scalar_t>;
    const V step(static_cast<M>(lr * amp.inv_scale)), neg_wd(static_cast<M>(-weight_decay));
    multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
      for_each_block<scalar_t>(
          begin, end,
          [&](auto& p, auto& g, auto& m) {
            m = at::vec::fmadd(step, g, m);
            p = at::vec::fmadd(neg_wd, p, p);
          },
          ptr<scalar_t>(params[t]), cptr<scalar_t>(grads[t]), ptr<scalar_t>(memories[t]));
    });
    for (size_t t = 0; t < params.size(); ++t) apply_sparse<scalar_t>(params[t], memories[t], indices[t]);
  });
}

}  // namespace fused_optim
