// fused_optim::adagrad_ on the CPU: torch.optim.Adagrad over a whole bucket in one parallel region,
// step counters incremented here. The math: csrc/shared/adagrad_math.h (per element and the
// per-tensor step size, shared with the CUDA kernel); fused_optim/adagrad.py documents the class.
// adagrad_compact_ is the same update on compact state (compact_state.h).
#include "multi_tensor.h"  // before the shared rule (adagrad_math.h)
#include "compact_state.h"  // the compact twin
#include "update_args.h"
#include "bucket.h"
#include "ops.h"
#include "../shared/adagrad_math.h"

namespace fused_optim {
namespace {

// adagrad_ (inputs: PlainState, update_args.h) and its compact twin (CompactInputs, compact_args.h).
template <typename Inputs>
void adagrad_impl(at::TensorList model, at::TensorList grads_in, at::TensorList sums, at::TensorList steps,
                  at::TensorList masters, double lr, double lr_decay, double weight_decay, double eps, bool maximize,
                  const Inputs& inputs, const std::optional<at::Tensor>& lr_tensor,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  const UpdatedParams params = checked_params("adagrad_", model, masters);
  const auto grads = checked_grads("adagrad_", params.model, grads_in, amp.unscale_grads);
  const auto c = state_args("adagrad_", params, sums, inputs);
  check_state_list("adagrad_", "sums", params, sums, c, 0);
  check_steps("adagrad_", model, steps);

  // Per-tensor step and step size, computed once on the host in double.
  const size_t n = model.size();
  std::vector<int64_t> numels(n);
  std::vector<double> new_step(n), step_size(n);
  for (size_t i = 0; i < n; ++i) {
    numels[i] = model[i].numel();
    new_step[i] = read_step(steps[i]) + 1.0;
    step_size[i] = adagrad_step_size(lr, lr_decay, new_step[i]);
  }

  dispatch_update(params, [&](auto types) {
    using T = typename decltype(types)::grad_t;
    using S = typename decltype(types)::state_t;
    const auto base = adagrad_rule<FVec<T>>(eps, weight_decay, maximize, amp.inv_scale);
    dispatch_streams<T, S>(params, c, [&](const auto& s) {
      multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
        const auto rule = base.for_tensor(step_size[t]);
        const auto g = grad_stream<T>(grads, t, amp);
        s.with_param(t, [&](auto p) {
          s.for_each(begin, end, [&](auto& pv, auto& gv, auto& sv) { rule.apply(pv, gv, sv); }, p, g,
                     s.state(sums, t, 0, 0, false));
        });
      });
    });
  });
  for (size_t i = 0; i < n; ++i) write_step(steps[i], new_step[i]);
  advance_keys(c);
  finish_grads(grads, amp);
}

}  // namespace

void adagrad_cpu(at::TensorList model, at::TensorList grads, at::TensorList sums, at::TensorList steps,
                 at::TensorList masters, double lr, double lr_decay, double weight_decay, double eps, bool maximize,
                 const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf) {
  adagrad_impl(model, grads, sums, steps, masters, lr, lr_decay, weight_decay, eps, maximize, PlainState{}, lr_tensor,
               grad_scale, found_inf);
}

void adagrad_compact_cpu(at::TensorList model, at::TensorList grads, at::TensorList sums, at::TensorList steps,
                         at::TensorList masters, at::TensorList absmaxes, at::TensorList keys, double lr,
                         double lr_decay, double weight_decay, double eps, bool maximize, bool stochastic_state,
                         bool stochastic_params, c10::IntArrayRef element_offsets,
                         const std::optional<at::Tensor>& lr_tensor,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  adagrad_impl(model, grads, sums, steps, masters, lr, lr_decay, weight_decay, eps, maximize,
               CompactInputs{absmaxes, keys, stochastic_state, stochastic_params, element_offsets}, lr_tensor,
               grad_scale, found_inf);
}

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("adagrad_", &adagrad_cpu);
  m.impl("adagrad_compact_", &adagrad_compact_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  impl_twin<&adagrad_cpu>(m, "adagrad_");
  impl_twin<&adagrad_compact_cpu>(m, "adagrad_compact_");
}

}  // namespace fused_optim
