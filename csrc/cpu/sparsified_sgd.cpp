// fused_optim::sparsified_sgd_: SGD with error feedback that applies only k coordinates per
// tensor each step (mlbench_core's SparsifiedSGD, for any param shape). Per tensor of D elements:
//   memory <- memory + lr*g/grad_scale                  (every element, one parallel pass)
//   p <- p - weight_decay*p                             (same pass; decay not multiplied by lr)
//   S <- k indices (host/sparse_indices.h: random, or a random block; the reference's draws; a
//        shard applies those of its whole tensor inside its box)
//   p[S] <- p[S] - memory[S] ; memory[S] <- 0
#include "../host/sparse_indices.h"
#include "update_args.h"
#include "bucket.h"
#include "ops.h"
#include "multi_tensor.h"

namespace fused_optim {
namespace {

// p[S] -= memory[S], memory[S] = 0 for the indices S of tensor t; with masters (S = float) on
// the master, and the param rounded from it.
template <typename T, typename S>
void apply_sparse(const UpdatedParams& params, int64_t t, const at::Tensor& memory, const at::Tensor& index) {
  S* pp = ptr<S>(params.values()[t]);
  S* mp = ptr<S>(memory);
  T* model = ptr<T>(params.model[t]);
  const int64_t* ip = ptr<int64_t>(index);
  for (int64_t j = 0; j < index.numel(); ++j) {
    const int64_t i = ip[j];
    pp[i] = static_cast<S>(static_cast<opmath_t<S>>(pp[i]) - static_cast<opmath_t<S>>(mp[i]));
    mp[i] = static_cast<S>(0);
    if constexpr (!std::is_same_v<T, S>) model[i] = static_cast<T>(pp[i]);
  }
}

}  // namespace

void sparsified_sgd_cpu(at::TensorList model, at::TensorList grads_in, at::TensorList memories,
                        at::TensorList masters, double lr,
                        double weight_decay, int64_t sparse_grad_size, bool random_sparse,
                        const std::optional<at::Generator>& generator, c10::IntArrayRef whole_shapes,
                        c10::IntArrayRef box_offsets, const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  TORCH_CHECK(sparse_grad_size > 0, "fused_optim::sparsified_sgd_: sparse_grad_size must be > 0");
  const UpdatedParams params = checked_params("sparsified_sgd_", model, masters);
  const auto grads = checked_grads("sparsified_sgd_", model, grads_in, amp.unscale_grads);
  check_mutable("sparsified_sgd_", "memories", params.values(), memories);
  const auto numels = numels_of(model);
  const auto indices =
      draw_sparse_indices(model, sparse_grad_size, random_sparse, generator, whole_shapes, box_offsets);
  dispatch_update(params, [&](auto types) {
    using T = typename decltype(types)::grad_t;
    using S = typename decltype(types)::state_t;
    using M = opmath_t<T>;
    using V = FVec<T>;
    const V step(static_cast<M>(lr * amp.inv_scale)), neg_wd(static_cast<M>(-weight_decay));
    multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
      for_each_block<T>(
          begin, end,
          [&](auto& p, auto& g, auto& m) {
            m = at::vec::fmadd(step, g, m);
            p = at::vec::fmadd(neg_wd, p, p);
          },
          param_stream<T, S>(params, t), grad_stream<T>(grads, t, amp), ptr<S>(memories[t]));
    });
    for (size_t t = 0; t < model.size(); ++t) apply_sparse<T, S>(params, t, memories[t], indices[t]);
  });
  finish_grads(grads, amp);
}

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("sparsified_sgd_", &sparsified_sgd_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  impl_twin<&sparsified_sgd_cpu>(m, "sparsified_sgd_");
}

}  // namespace fused_optim
