// fused_optim::adam_ on the CPU: torch.optim.Adam / AdamW over a whole bucket in one parallel
// region, step counters incremented here. The math: csrc/shared/adam_math.h (per element, shared
// with the CUDA kernel) and bias_correction.h (per tensor); fused_optim/adam.py documents the class.
#include "simd_blocks.h"  // before the shared rule (adam_math.h)
#include "multi_tensor.h"
#include "op_args.h"
#include "ops.h"
#include "../shared/adam_math.h"
#include "../shared/bias_correction.h"

namespace fused_optim {
void adam_cpu(at::TensorList params, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool amsgrad, bool decoupled, bool maximize, bool bias_correction,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || params.empty()) return;
  const auto grads = check_moment_inputs("adam_", params, grads_in, exp_avgs, exp_avg_sqs);
  if (amsgrad) {
    check_mutable("adam_", "max_exp_avg_sqs", params, max_exp_avg_sqs);
  } else {
    TORCH_CHECK(max_exp_avg_sqs.empty(), "fused_optim::adam_: max_exp_avg_sqs must be empty without amsgrad");
  }
  check_steps("adam_", params, steps);

  // Per-tensor step and bias corrections, computed once on the host in double.
  const size_t n = params.size();
  std::vector<int64_t> numels(n);
  std::vector<double> new_step(n);
  std::vector<AdamStep> adam_steps(n);
  BiasCorrections corrections(beta1, beta2, bias_correction);
  for (size_t i = 0; i < n; ++i) {
    numels[i] = params[i].numel();
    new_step[i] = read_step(steps[i]) + 1.0;
    adam_steps[i] = adam_step(lr, corrections.at(new_step[i]));
  }

  FUSED_OPTIM_DISPATCH_FLOATING(params[0].scalar_type(), "fused_optim::adam_", [&] {
    using M = opmath_t<scalar_t>;
    using V = FVec<scalar_t>;
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
      scalar_t* p = ptr<scalar_t>(params[t]);
      const scalar_t* g = ptr<scalar_t>(grads[t]);
      scalar_t* m = ptr<scalar_t>(exp_avgs[t]);
      scalar_t* v = ptr<scalar_t>(exp_avg_sqs[t]);
      if (amsgrad) {
        for_each_block<scalar_t>(
            begin, end,
            [&](auto& pv, auto& gv, auto& mv, auto& vv, auto& vmax) { rule.apply(pv, gv, mv, vv, vmax); },
            p, g, m, v, ptr<scalar_t>(max_exp_avg_sqs[t]));
      } else {
        for_each_block<scalar_t>(
            begin, end,
            [&](auto& pv, auto& gv, auto& mv, auto& vv) { rule.apply(pv, gv, mv, vv); },
            p, g, m, v);
      }
    });
  });
  for (size_t i = 0; i < n; ++i) write_step(steps[i], new_step[i]);
}

}  // namespace fused_optim
