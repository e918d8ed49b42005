// fused_optim::sgd_ on the CPU: torch.optim.SGD's update over a whole bucket in one parallel
// region. Math (per element, in opmath; see fused_optim/sgd.py for the documented rule):
//   g <- ±g / grad_scale ; g <- g + wd*p (unless wd_after_momentum)
//   buf <- g (first step) | momentum*buf + (1-dampening)*g ; g <- g + momentum*buf (nesterov) | buf
//   g <- g + wd*p (wd_after_momentum) ; p <- p - lr*g
#include "bucket.h"
#include "multi_tensor.h"

#include <torch/library.h>

namespace fused_optim {
namespace {

template <typename T>
struct SgdMath {
  using V = FVec<T>;
  V grad_mul, wd, momentum, one_minus_damp, neg_lr;
  bool has_wd, wd_after, has_momentum, nesterov, first;

  void apply(V& p, V& g) const {
    g = g * grad_mul;
    if (has_wd) g = at::vec::fmadd(wd, p, g);  // without momentum, before == after
    p = at::vec::fmadd(neg_lr, g, p);
  }

  void apply(V& p, V& g, V& buf) const {
    g = g * grad_mul;
    if (has_wd && !wd_after) g = at::vec::fmadd(wd, p, g);
    buf = first ? g : at::vec::fmadd(momentum, buf, one_minus_damp * g);
    g = nesterov ? at::vec::fmadd(momentum, buf, g) : buf;
    if (has_wd && wd_after) g = at::vec::fmadd(wd, p, g);
    p = at::vec::fmadd(neg_lr, g, p);
  }
};

void sgd_cpu(at::TensorList params, at::TensorList grads_in, at::TensorList momentum_buffers,
             const c10::List<bool>& first_step, double lr, double momentum, double dampening,
             double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum,
             const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  if (amp.skip || params.empty()) return;
  check_mutable("sgd_", "params", params, params);
  const auto grads = checked_grads("sgd_", params, grads_in);
  const bool has_momentum = momentum != 0.0;
  if (has_momentum) {
    check_mutable("sgd_", "momentum_buffers", params, momentum_buffers);
    TORCH_CHECK(first_step.size() == params.size() || first_step.empty(),
                "fused_optim::sgd_: first_step needs one flag per param (or none: no first steps)");
  } else {
    TORCH_CHECK(momentum_buffers.empty(), "fused_optim::sgd_: momentum_buffers must be empty when momentum == 0");
  }
  std::vector<int64_t> numels;
  numels.reserve(params.size());
  for (const auto& p : params) numels.push_back(p.numel());

  FUSED_OPTIM_DISPATCH_FLOATING(params[0].scalar_type(), "fused_optim::sgd_", [&] {
    using M = opmath_t<scalar_t>;
    SgdMath<scalar_t> base{
        FVec<scalar_t>(static_cast<M>(maximize ? -amp.inv_scale : amp.inv_scale)),
        FVec<scalar_t>(static_cast<M>(weight_decay)),
        FVec<scalar_t>(static_cast<M>(momentum)),
        FVec<scalar_t>(static_cast<M>(1.0 - dampening)),
        FVec<scalar_t>(static_cast<M>(-lr)),
        weight_decay != 0.0, wd_after_momentum, has_momentum, nesterov, false};
    multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
      scalar_t* p = ptr<scalar_t>(params[t]);
      const scalar_t* g = ptr<scalar_t>(grads[t]);
      if (has_momentum) {
        SgdMath<scalar_t> math = base;
        math.first = !first_step.empty() && first_step[t];
        for_each_block<scalar_t>(
            begin, end, [&](auto& pv, auto& gv, auto& bv) { math.apply(pv, gv, bv); }, p, g,
            ptr<scalar_t>(momentum_buffers[t]));
      } else {
        for_each_block<scalar_t>(begin, end, [&](auto& pv, auto& gv) { base.apply(pv, gv); }, p, g);
      }
    });
  });
}

// The bucket twin: lists {params, momentum_buffers} registered once (see bucket.h); the grads
// are read from the params. Returns kMissingGrad, changing nothing, when a param has no grad.
int64_t sgd_bucket(int64_t bucket, const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum,
                   const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  return step_bucket("sgd_bucket", bucket, 2, [&](const TensorLists& l, const std::vector<at::Tensor>& grads) {
    sgd_cpu(l[0], grads, l[1], first_step, lr, momentum, dampening, weight_decay, nesterov, maximize,
            wd_after_momentum, grad_scale, found_inf);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("sgd_", &sgd_cpu);
}

// The twin may take no tensor argument at all: CompositeExplicitAutograd serves it.
TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  m.impl("sgd_bucket", &sgd_bucket);
}

}  // namespace fused_optim
