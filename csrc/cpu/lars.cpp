// Layer-wise adaptive SGD: the SGD family kernel after every tensor's ||p|| and ||g|| (fixed-order
// sums), with per-tensor numbers from the trust ratio (sgd_family_after_norms, one two-pass launch:
// the update of a tensor follows its norms while it is in the cache). No host sync per tensor.
//   lars_          quadra LARS (+ timm's trust_clip / always_adapt), fused_optim/lars.py:
//                  r = tc*||p||/(||g|| + wd*||p|| + eps) (trust_clip: min(r/lr, 1)) when
//                  (wd != 0 or always_adapt) and both norms are non-zero: d = (g + wd*p)*r; else d = g
//   colossal_lars_ ColossalLars (ColossalAI's Lars), fused_optim/lars.py:
//                  r = clamp(eeta*||p||/(||g|| + wd*||p|| + eps), 0, 50) (1 if a norm is 0) scales the lr;
//                  d = clamp(g + wd*p, -10, 10); plain momentum
#include "op_args.h"
#include "ops.h"
#include "sgd_family.h"

#include <algorithm>
#include <cmath>

namespace fused_optim {

void lars_cpu(at::TensorList params, at::TensorList grads_in, at::TensorList bufs, const c10::List<bool>& first_step,
              double lr, double momentum, double dampening, double weight_decay, bool nesterov,
              double trust_coefficient, double eps, bool trust_clip, bool always_adapt,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || params.empty()) return;
  const auto grads = check_sgd_inputs("lars_", params, grads_in, bufs, first_step, momentum);
  const size_t n = params.size();
  SgdFamily args{Direction::kPlain, momentum, dampening, 0.0, nesterov, false,
                 std::vector<double>(n, amp.inv_scale), std::vector<double>(n, 0.0), std::vector<double>(n, lr)};
  if (weight_decay == 0.0 && !always_adapt) return sgd_family(params, grads, bufs, first_step, args);
  sgd_family_after_norms(params, grads, bufs, first_step, args, [&](size_t t, double pn, double stored_gn) {
    const double gn = stored_gn * amp.inv_scale;
    if (pn > 0.0 && gn > 0.0) {
      double r = trust_coefficient * pn / (gn + weight_decay * pn + eps);
      if (trust_clip) r = std::min(r / lr, 1.0);
      args.grad_mul[t] = amp.inv_scale * r;
      args.weight_decay[t] = weight_decay * r;
    }
  });
}

void colossal_lars_cpu(at::TensorList params, at::TensorList grads_in, at::TensorList bufs,
                       const c10::List<bool>& first_step, double lr, double momentum, double eeta, double weight_decay,
                       double epsilon, bool lars, const std::optional<at::Tensor>& lr_tensor,
                       const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  constexpr double kMaxTrustRatio = 50.0, kGradClamp = 10.0;
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || params.empty()) return;
  const auto grads = check_sgd_inputs("colossal_lars_", params, grads_in, bufs, first_step, momentum);
  const size_t n = params.size();
  SgdFamily args{Direction::kClamp, momentum, 0.0, kGradClamp, false, false,
                 std::vector<double>(n, amp.inv_scale), std::vector<double>(n, lars ? weight_decay : 0.0),
                 std::vector<double>(n, lr)};
  if (!lars) return sgd_family(params, grads, bufs, first_step, args);
  sgd_family_after_norms(params, grads, bufs, first_step, args, [&](size_t t, double pn, double stored_gn) {
    const double gn = stored_gn * amp.inv_scale;
    const double r = pn > 0.0 && gn > 0.0 ? eeta * pn / (gn + weight_decay * pn + epsilon) : 1.0;
    args.lr[t] = lr * std::clamp(r, 0.0, kMaxTrustRatio);
  });
}

}  // namespace fused_optim
