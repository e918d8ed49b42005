// fused_optim::adam_ on the CPU: torch.optim.Adam / AdamW over a whole bucket in one parallel
// region, step counters incremented here. The math: csrc/shared/adam_math.h (per tensor and per
// element, shared with the CUDA kernel); fused_optim/adam.py documents the class.
// adam_compact_ is the same update on compact state (compact_state.h).
#include "multi_tensor.h"  // before the shared rule (adam_math.h)
#include "compact_state.h"  // the compact twin
#include "update_args.h"
#include "bucket.h"
#include "ops.h"
#include "../shared/adam_math.h"

#include <cmath>

namespace fused_optim {
namespace {

// adam_ (inputs: PlainState, update_args.h) and its compact twin (CompactInputs, compact_args.h).
template <typename Inputs>
void adam_impl(at::TensorList model, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList masters, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
               bool bias_correction, double div_scale, const Inputs& inputs,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  TORCH_CHECK(std::isfinite(div_scale) && div_scale > 0.0, "fused_optim::adam_: div_scale must be a finite number > 0, "
              "got ", div_scale);
  const UpdatedParams params = checked_params("adam_", model, masters);
  const auto grads = checked_grads("adam_", params.model, grads_in, amp.unscale_grads);
  const auto c = state_args("adam_", params, exp_avgs, inputs);
  int slot = check_state_list("adam_", "exp_avgs", params, exp_avgs, c, 0);
  slot = check_state_list("adam_", "exp_avg_sqs", params, exp_avg_sqs, c, slot);
  if (amsgrad) {
    check_state_list("adam_", "max_exp_avg_sqs", params, max_exp_avg_sqs, c, slot);
  } else {
    TORCH_CHECK(max_exp_avg_sqs.empty(), "fused_optim::adam_: max_exp_avg_sqs must be empty without amsgrad");
  }
  check_steps("adam_", model, steps);

  // Per-tensor step and bias corrections, computed once on the host in double.
  const size_t n = model.size();
  std::vector<int64_t> numels(n);
  std::vector<double> new_step(n);
  std::vector<AdamStep> adam_steps(n);
  BiasCorrections corrections(beta1, beta2, bias_correction);
  for (size_t i = 0; i < n; ++i) {
    numels[i] = model[i].numel();
    new_step[i] = read_step(steps[i]) + 1.0;
    adam_steps[i] = adam_step(lr, corrections.at(new_step[i]));
  }

  dispatch_update(params, [&](auto types) {
    using T = typename decltype(types)::grad_t;
    using S = typename decltype(types)::state_t;
    using V = FVec<T>;
    // grad_scale and ColossalAI's div_scale divide the grads in the update; only grad_scale is taken
    // out of the grads written back (grad_stream)
    const auto base = adam_rule<V>(lr, beta1, beta2, eps, weight_decay, decoupled, maximize, amp.inv_scale / div_scale);
    dispatch_streams<T, S>(params, c, [&](const auto& s) {
      multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
        const AdamRule<V> rule = base.for_tensor(adam_steps[t]);
        const auto g = grad_stream<T>(grads, t, amp);
        const auto m = s.state(exp_avgs, t, 0, 0, true);
        const auto v = s.state(exp_avg_sqs, t, 1, 1, false);
        s.with_param(t, [&](auto p) {
          if (amsgrad) {
            s.for_each(
                begin, end,
                [&](auto& pv, auto& gv, auto& mv, auto& vv, auto& vmax) { rule.apply(pv, gv, mv, vv, vmax); },
                p, g, m, v, s.state(max_exp_avg_sqs, t, 2, 2, false));
          } else {
            s.for_each(begin, end, [&](auto& pv, auto& gv, auto& mv, auto& vv) { rule.apply(pv, gv, mv, vv); }, p,
                       g, m, v);
          }
        });
      });
    });
  });
  for (size_t i = 0; i < n; ++i) write_step(steps[i], new_step[i]);
  advance_keys(c);
  finish_grads(grads, amp);
}

}  // namespace

void adam_cpu(at::TensorList model, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList masters, double lr, double beta1,
              double beta2, double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
              bool bias_correction, double div_scale, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  adam_impl(model, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, lr, beta1, beta2, eps, weight_decay,
            amsgrad, decoupled, maximize, bias_correction, div_scale, PlainState{}, lr_tensor, grad_scale, found_inf);
}

void adam_compact_cpu(at::TensorList model, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                      at::TensorList masters, at::TensorList absmaxes, at::TensorList keys, double lr, double beta1,
                      double beta2, double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                      bool bias_correction, double div_scale, bool stochastic_state, bool stochastic_params,
                      c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  adam_impl(model, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters, lr, beta1, beta2, eps, weight_decay,
            amsgrad, decoupled, maximize, bias_correction, div_scale,
            CompactInputs{absmaxes, keys, stochastic_state, stochastic_params, element_offsets}, lr_tensor,
            grad_scale, found_inf);
}

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("adam_", &adam_cpu);
  m.impl("adam_compact_", &adam_compact_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  impl_twin<&adam_cpu>(m, "adam_");
  impl_twin<&adam_compact_cpu>(m, "adam_compact_");
}

}  // namespace fused_optim
