// Layer-wise adaptive SGD: the SGD family kernel after every tensor's ||p|| and ||g|| (fixed-order
// sums), with per-tensor numbers from the trust ratio (sgd_family_after_norms, one two-pass launch:
// the update of a tensor follows its norms while it is in the cache). No host sync per tensor.
//   lars_          quadra LARS (+ timm's trust_clip / always_adapt), fused_optim/lars.py
//   colossal_lars_ ColossalLars (ColossalAI's Lars), fused_optim/lars.py
// Their trust ratios and constants: csrc/shared/trust_ratio.h (shared with the CUDA kernel).
// norm_sums / sums_only (two_pass.h: NormSums): S_p = sum p^2 and S_x = sum g^2 of the grads as
// stored (the trust ratio unscales the norm), written for every tensor when sums_only, whether or
// not the trust ratio is on.
#include "update_args.h"
#include "bucket.h"
#include "ops.h"
#include "sgd_family.h"
#include "../shared/trust_ratio.h"

namespace fused_optim {
namespace {

// lars_ (inputs: PlainState) and its compact twin (CompactInputs).
template <typename Inputs>
void lars_impl(at::TensorList model, at::TensorList grads_in, at::TensorList bufs, at::TensorList masters,
               const c10::List<bool>& first_step, double lr, double momentum, double dampening, double weight_decay,
               bool nesterov, double trust_coefficient, double eps, bool trust_clip, bool always_adapt,
               const std::optional<at::Tensor>& norm_sums, bool sums_only, const Inputs& inputs,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  const NormSums norm = norm_sums_of("lars_", norm_sums, sums_only, model);
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  const auto call = sgd_call("lars_", model, grads_in, bufs, masters, first_step, momentum, inputs,
                             amp.unscale_grads && !norm.sums_only);
  const size_t n = model.size();
  SgdFamily args{SgdDirection::kPlain, momentum, dampening, 0.0, nesterov, false,
                 std::vector<double>(n, amp.inv_scale), std::vector<double>(n, 0.0), std::vector<double>(n, lr), amp};
  // No trust ratio: the plain update, and the sums only when asked for (for every op, whatever its numbers).
  if (weight_decay == 0.0 && !always_adapt && !norm.sums_only) {
    return sgd_family(call.params, call.grads, bufs, first_step, args, call.states);
  }
  auto set = [&](size_t t, double pn, double stored_gn) {
    const LarsTensor numbers = lars_tensor(pn, stored_gn * amp.inv_scale, amp.inv_scale, lr, trust_coefficient,
                                           weight_decay, eps, trust_clip);
    args.grad_mul[t] = numbers.grad_mul;
    args.weight_decay[t] = numbers.weight_decay;
  };
  sgd_family_after_norms(call.params, call.grads, bufs, first_step, args, call.states, set, norm);
}

// colossal_lars_ and its compact twin.
template <typename Inputs>
void colossal_lars_impl(at::TensorList model, at::TensorList grads_in, at::TensorList bufs, at::TensorList masters,
                        const c10::List<bool>& first_step, double lr, double momentum, double eeta,
                        double weight_decay, double epsilon, bool lars, const std::optional<at::Tensor>& norm_sums,
                        bool sums_only, const Inputs& inputs, const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const NormSums norm = norm_sums_of("colossal_lars_", norm_sums, sums_only, model);
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  const auto call = sgd_call("colossal_lars_", model, grads_in, bufs, masters, first_step, momentum, inputs,
                             amp.unscale_grads && !norm.sums_only);
  const size_t n = model.size();
  SgdFamily args{SgdDirection::kClamp, momentum, 0.0, kColossalLarsGradClamp, false, false,
                 std::vector<double>(n, amp.inv_scale), std::vector<double>(n, lars ? weight_decay : 0.0),
                 std::vector<double>(n, lr), amp};
  if (!lars && !norm.sums_only) return sgd_family(call.params, call.grads, bufs, first_step, args, call.states);
  auto set = [&](size_t t, double pn, double stored_gn) {
    args.lr[t] = colossal_lars_lr(pn, stored_gn * amp.inv_scale, lr, eeta, weight_decay, epsilon);
  };
  sgd_family_after_norms(call.params, call.grads, bufs, first_step, args, call.states, set, norm);
}

}  // namespace

void lars_cpu(at::TensorList model, at::TensorList grads, at::TensorList bufs, at::TensorList masters,
              const c10::List<bool>& first_step, double lr, double momentum, double dampening, double weight_decay,
              bool nesterov, double trust_coefficient, double eps, bool trust_clip, bool always_adapt,
              const std::optional<at::Tensor>& norm_sums, bool sums_only, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  lars_impl(model, grads, bufs, masters, first_step, lr, momentum, dampening, weight_decay, nesterov,
            trust_coefficient, eps, trust_clip, always_adapt, norm_sums, sums_only, PlainState{}, lr_tensor,
            grad_scale, found_inf);
}

void lars_compact_cpu(at::TensorList model, at::TensorList grads, at::TensorList bufs, at::TensorList masters,
                      at::TensorList absmaxes, at::TensorList keys, const c10::List<bool>& first_step, double lr,
                      double momentum, double dampening, double weight_decay, bool nesterov,
                      double trust_coefficient, double eps, bool trust_clip, bool always_adapt,
                      const std::optional<at::Tensor>& norm_sums, bool sums_only, bool stochastic_state,
                      bool stochastic_params, c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  lars_impl(model, grads, bufs, masters, first_step, lr, momentum, dampening, weight_decay, nesterov,
            trust_coefficient, eps, trust_clip, always_adapt, norm_sums, sums_only,
            CompactInputs{absmaxes, keys, stochastic_state, stochastic_params, element_offsets},
            lr_tensor, grad_scale, found_inf);
}

void colossal_lars_cpu(at::TensorList model, at::TensorList grads, at::TensorList bufs, at::TensorList masters,
                       const c10::List<bool>& first_step, double lr, double momentum, double eeta, double weight_decay,
                       double epsilon, bool lars, const std::optional<at::Tensor>& norm_sums, bool sums_only,
                       const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  colossal_lars_impl(model, grads, bufs, masters, first_step, lr, momentum, eeta, weight_decay, epsilon, lars,
                     norm_sums, sums_only, PlainState{}, lr_tensor, grad_scale, found_inf);
}

void colossal_lars_compact_cpu(at::TensorList model, at::TensorList grads, at::TensorList bufs,
                               at::TensorList masters, at::TensorList absmaxes, at::TensorList keys,
                               const c10::List<bool>& first_step, double lr, double momentum, double eeta,
                               double weight_decay, double epsilon, bool lars,
                               const std::optional<at::Tensor>& norm_sums, bool sums_only, bool stochastic_state,
                               bool stochastic_params, c10::IntArrayRef element_offsets,
                               const std::optional<at::Tensor>& lr_tensor,
                               const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf) {
  colossal_lars_impl(model, grads, bufs, masters, first_step, lr, momentum, eeta, weight_decay, epsilon, lars,
                     norm_sums, sums_only,
                     CompactInputs{absmaxes, keys, stochastic_state, stochastic_params, element_offsets}, lr_tensor,
                     grad_scale, found_inf);
}

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("lars_", &lars_cpu);
  m.impl("lars_compact_", &lars_compact_cpu);
  m.impl("colossal_lars_", &colossal_lars_cpu);
  m.impl("colossal_lars_compact_", &colossal_lars_compact_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  impl_twin<&lars_cpu>(m, "lars_");
  impl_twin<&lars_compact_cpu>(m, "lars_compact_");
  impl_twin<&colossal_lars_cpu>(m, "colossal_lars_");
  impl_twin<&colossal_lars_compact_cpu>(m, "colossal_lars_compact_");
}

}  // namespace fused_optim
