// fused_optim::adam_ on the CPU: torch.optim.Adam / AdamW over a whole bucket in one parallel
// region, step counters incremented here. Math (per element, in opmath; see fused_optim/adam.py):
//   g <- ±g / grad_scale ; p <- p*(1 - lr*wd) (decoupled) | g <- g + wd*p (L2)
//   m <- m + (1-beta1)*(g - m) ; v <- beta2*v + (1-beta2)*g*g ; vmax <- max(vmax, v) (amsgrad)
//   p <- p - (lr/bc1) * m / (sqrt(v or vmax)/sqrt(bc2) + eps),  bc_i = 1 - beta_i^step (or 1)
#include "multi_tensor.h"
#include "op_args.h"
#include "ops.h"
#include "simd_blocks.h"

#include <cmath>

namespace fused_optim {
namespace {

template <typename T>
struct AdamMath {
  using V = FVec<T>;
  V grad_mul, wd, decay_mul, one_minus_b1, b2, one_minus_b2, eps;
  bool has_wd, decoupled;
  // Per tensor (its own step count).
  V neg_step_size, inv_bc2_sqrt;

  V moments(V& p, V& g, V& m, V& v) const {
    g = g * grad_mul;
    if (has_wd) {
      if (decoupled) {
        p = p * decay_mul;
      } else {
        g = at::vec::fmadd(wd, p, g);
      }
    }
    m = at::vec::fmadd(one_minus_b1, g - m, m);
    v = at::vec::fmadd(b2, v, one_minus_b2 * g * g);
    return v;
  }

  void update(V& p, const V& m, const V& v_used) const {
    const V denom = at::vec::fmadd(v_used.sqrt(), inv_bc2_sqrt, eps);
    p = at::vec::fmadd(neg_step_size, m / denom, p);
  }
};

}  // namespace

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
  std::vector<double> new_step(n), step_size(n), inv_bc2_sqrt(n);
  BiasCorrections corrections(beta1, beta2, bias_correction);
  for (size_t i = 0; i < n; ++i) {
    numels[i] = params[i].numel();
    new_step[i] = read_step(steps[i]) + 1.0;
    const auto& [bc1, bc2] = corrections.at(new_step[i]);
    step_size[i] = lr / bc1;
    inv_bc2_sqrt[i] = 1.0 / std::sqrt(bc2);
  }

  FUSED_OPTIM_DISPATCH_FLOATING(params[0].scalar_type(), "fused_optim::adam_", [&] {
    using M = opmath_t<scalar_t>;
    using V = FVec<scalar_t>;
    const AdamMath<scalar_t> base{
        V(static_cast<M>(maximize ? -amp.inv_scale : amp.inv_scale)),
        V(static_cast<M>(weight_decay)),
        V(static_cast<M>(1.0 - lr * weight_decay)),
        V(static_cast<M>(1.0 - beta1)),
        V(static_cast<M>(beta2)),
        V(static_cast<M>(1.0 - beta2)),
        V(static_cast<M>(eps)),
        weight_decay != 0.0,
        decoupled,
        V(0),
        V(0)};
    multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
      AdamMath<scalar_t> math = base;
      math.neg_step_size = V(static_cast<M>(-step_size[t]));
      math.inv_bc2_sqrt = V(static_cast<M>(inv_bc2_sqrt[t]));
      scalar_t* p = ptr<scalar_t>(params[t]);
      const scalar_t* g = ptr<scalar_t>(grads[t]);
      scalar_t* m = ptr<scalar_t>(exp_avgs[t]);
      scalar_t* v = ptr<scalar_t>(exp_avg_sqs[t]);
      if (amsgrad) {
        for_each_block<scalar_t>(
            begin, end,
            [&](auto& pv, auto& gv, auto& mv, auto& vv, auto& vmax) {
              vmax = at::vec::maximum(vmax, math.moments(pv, gv, mv, vv));
              math.update(pv, mv, vmax);
            },
            p, g, m, v, ptr<scalar_t>(max_exp_avg_sqs[t]));
      } else {
        for_each_block<scalar_t>(
            begin, end,
            [&](auto& pv, auto& gv, auto& mv, auto& vv) { math.update(pv, mv, math.moments(pv, gv, mv, vv)); },
            p, g, m, v);
      }
    });
  });
  for (size_t i = 0; i < n; ++i) write_step(steps[i], new_step[i]);
}

}  // namespace fused_optim
