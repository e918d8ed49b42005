// Layer-wise adaptive SGD: a pass computing every tensor's ||p|| and ||g|| (fixed-order sums, see
// multi_tensor_sums), per-tensor trust ratios on the host, then the SGD family kernel with
// per-tensor numbers (sgd_family.h), range by range (cache_ranges: the update finds p and g in
// the cache). No host sync per tensor: each pass is one parallel region over its range.
//   lars_          quadra LARS (+ timm's trust_clip / always_adapt), fused_optim/lars.py:
//                  r = tc*||p||/(||g|| + wd*||p|| + eps) (trust_clip: min(r/lr, 1)) when
//                  (wd != 0 or always_adapt) and both norms are non-zero: d = (g + wd*p)*r; else d = g
//   colossal_lars_ ColossalAI Lars, fused_optim/lars.py: r = clamp(eeta*||p||/(||g|| + wd*||p|| + eps), 0, 50)
//                  (1 if a norm is 0) scales the lr; d = clamp(g + wd*p, -10, 10); plain momentum
#include "bucket.h"
#include "multi_tensor.h"
#include "ops.h"
#include "sgd_family.h"

#include <algorithm>
#include <cmath>

namespace fused_optim {
namespace {

struct Norms {
  double param, grad;
};

// ||p|| and ||g * inv_scale|| of the tensors of `range`, in one parallel pass.
std::vector<Norms> param_grad_norms(at::TensorList params, const std::vector<at::Tensor>& grads, double inv_scale,
                                    TensorRange range) {
  std::vector<int64_t> numels;
  for (size_t t = range.begin; t < range.end; ++t) numels.push_back(params[t].numel());
  const auto sums = FUSED_OPTIM_DISPATCH_FLOATING(params[0].scalar_type(), "fused_optim::lars_norms", [&] {
    return multi_tensor_sums<2>(numels, [&](int64_t k, int64_t begin, int64_t end) {
      const size_t t = range.begin + k;
      return std::array<double, 2>{sum_of_squares(cptr<scalar_t>(params[t]), begin, end),
                                   sum_of_squares(cptr<scalar_t>(grads[t]), begin, end)};
    });
  });
  std::vector<Norms> norms;
  for (const auto& s : sums) norms.push_back({std::sqrt(s[0]), std::sqrt(s[1]) * inv_scale});
  return norms;
}

}  // namespace

// Norms, then the SGD family update with the per-tensor numbers set(t, norms) chooses, range by
// range (cache_ranges over p, g and the momentum buffer: the update finds p and g in the cache).
template <typename Set>
void two_passes(at::TensorList params, const std::vector<at::Tensor>& grads, at::TensorList bufs,
                const c10::List<bool>& first_step, SgdFamily& args, double inv_scale, const Set& set) {
  std::vector<int64_t> numels;
  for (const auto& p : params) numels.push_back(p.numel());
  for (const TensorRange range : cache_ranges(numels, 3 * params[0].element_size())) {
    const auto norms = param_grad_norms(params, grads, inv_scale, range);
    for (size_t t = range.begin; t < range.end; ++t) set(t, norms[t - range.begin]);
    sgd_family(params, grads, bufs, first_step, args, range);
  }
}

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
  if (weight_decay == 0.0 && !always_adapt) return sgd_family(params, grads, bufs, first_step, args, {0, n});
  two_passes(params, grads, bufs, first_step, args, amp.inv_scale, [&](size_t t, Norms norms) {
    const auto [pn, gn] = norms;
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
  if (!lars) return sgd_family(params, grads, bufs, first_step, args, {0, n});
  two_passes(params, grads, bufs, first_step, args, amp.inv_scale, [&](size_t t, Norms norms) {
    const auto [pn, gn] = norms;
    const double r = pn > 0.0 && gn > 0.0 ? eeta * pn / (gn + weight_decay * pn + epsilon) : 1.0;
    args.lr[t] = lr * std::clamp(r, 0.0, kMaxTrustRatio);
  });
}

// The bucket twins: lists {params, momentum_buffers}; grads read from the params.
int64_t lars_bucket(int64_t bucket, const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                    double weight_decay, bool nesterov, double trust_coefficient, double eps, bool trust_clip,
                    bool always_adapt, const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  return step_bucket("lars_bucket", bucket, 2, [&](const TensorLists& l, const std::vector<at::Tensor>& grads) {
    run_on_device("fused_optim::lars_", lars_cpu, l[0], grads, l[1], first_step, lr, momentum, dampening, weight_decay,
                  nesterov, trust_coefficient, eps, trust_clip, always_adapt, lr_tensor, grad_scale, found_inf);
  });
}

int64_t colossal_lars_bucket(int64_t bucket, const c10::List<bool>& first_step, double lr, double momentum, double eeta,
                             double weight_decay, double epsilon, bool lars, const std::optional<at::Tensor>& lr_tensor,
                             const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  return step_bucket("colossal_lars_bucket", bucket, 2,
                     [&](const TensorLists& l, const std::vector<at::Tensor>& grads) {
                       run_on_device("fused_optim::colossal_lars_", colossal_lars_cpu, l[0], grads, l[1], first_step,
                                     lr, momentum, eeta, weight_decay, epsilon, lars, lr_tensor, grad_scale, found_inf);
                     });
}

}  // namespace fused_optim
