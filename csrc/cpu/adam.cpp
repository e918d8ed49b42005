// fused_optim::adam_ on the CPU: torch.optim.Adam / AdamW over a whole bucket in one parallel
// region, step counters incremented here. The math: csrc/shared/adam_math.h (per element, shared
// with the CUDA kernel) and bias_correction.h (per tensor); fused_optim/adam.py documents the class.
#include "simd_blocks.h"  // before the shared rule (adam_math.h)
#include "master_weights.h"
#include "multi_tensor.h"
#include "op_args.h"
#include "ops.h"
#include "../shared/adam_math.h"
#include "../shared/bias_correction.h"

namespace fused_optim {
void adam_cpu(at::TensorList model, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList masters, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool amsgrad, bool decoupled, bool maximize, bool bias_correction,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  const UpdatedParams params = checked_params("adam_", model, masters);
  const auto grads = check_moment_inputs("adam_", params, grads_in, exp_avgs, exp_avg_sqs);
  if (amsgrad) {
    check_mutable("adam_", "max_exp_avg_sqs", params.values(), max_exp_avg_sqs);
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
    using M = opmath_t<T>;
    using V = FVec<T>;
    const AdamRule<V> base{V(static_cast<M>(maximize ? -amp.inv_scale : amp.inv_scale)),
                           V(static_cast<M>(weight_decay)),
                           V(static_cast<M>(decoupled_decay(lr, weight_decay))),
                           V(static_cast<M>(1.0 - beta1)),
                           V(static_cast<M>(beta2)),
                           V(static_cast<M>(1.0 - beta2)),
                           V(static_cast<M>(eps)),
                           V(0),
                           V(0),
                           weight_decay != 0.0,
                           decoupled};
    multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
      AdamRule<V> rule = base;
      rule.neg_step_size = V(static_cast<M>(-adam_steps[t].step_size));
      rule.inv_bc2_sqrt = V(static_cast<M>(adam_steps[t].inv_bc2_sqrt));
      const auto p = param_stream<T, S>(params, t);
      const T* g = ptr<T>(grads[t]);
      S* m = ptr<S>(exp_avgs[t]);
      S* v = ptr<S>(exp_avg_sqs[t]);
      if (amsgrad) {
        for_each_block<T>(
            begin, end,
            [&](auto& pv, auto& gv, auto& mv, auto& vv, auto& vmax) { rule.apply(pv, gv, mv, vv, vmax); },
            p, g, m, v, ptr<S>(max_exp_avg_sqs[t]));
      } else {
        for_each_block<T>(
            begin, end,
            [&](auto& pv, auto& gv, auto& mv, auto& vv) { rule.apply(pv, gv, mv, vv); },
            p, g, m, v);
      }
    });
  });
  for (size_t i = 0; i < n; ++i) write_step(steps[i], new_step[i]);
}

}  // namespace fused_optim
