// Adagrad's update per element (torch.optim.Adagrad's order of operations), on the CPU
// (csrc/cpu/adagrad.cpp: V = at::vec::Vectorized<float/double>) and on CUDA (csrc/cuda/adagrad.cu:
// V = float/double), in opmath. With the tensor's step size clr (adagrad_step_size, per tensor):
//   g <- grad_mul*g                          (grad_mul = ±1/grad_scale, − when maximize)
//   g <- g + wd*p                            (L2 weight decay, only when wd != 0)
//   s <- s + g*g                             (the sum of squares, state "sum")
//   p <- p + (-clr*g) / (sqrt(s) + eps)
// g + wd*p and s + g*g are one fused multiply-add each (mul_add, primitives.h), as torch's
// `g.add(p, alpha=wd)` and `s.addcmul_(g, g)` round on the CPU; the last line rounds -clr*g, the
// quotient and the sum, as torch's `p.addcdiv_(g, std, value=-clr)`.
#pragma once

#include "primitives.h"

namespace fused_optim {

// clr = lr / (1 + (step - 1)*lr_decay), on double; step counts this step (1 on the first).
FUSED_OPTIM_HD double adagrad_step_size(double lr, double lr_decay, double step) {
  return lr / (1.0 + (step - 1.0) * lr_decay);
}

// Built by adagrad_rule (the call's numbers), then for_tensor (a tensor's step size).
template <typename V>
struct AdagradRule {
  V grad_mul, wd, eps;
  V neg_clr;  // per tensor
  bool has_wd;

  // This rule with a tensor's step size clr (adagrad_step_size).
  FUSED_OPTIM_HD AdagradRule for_tensor(double clr) const {
    AdagradRule r = *this;
    r.neg_clr = from_double<V>(-clr);
    return r;
  }

  FUSED_OPTIM_HD void apply(V& p, V g, V& s) const {
    g = g * grad_mul;
    if (has_wd) g = mul_add(wd, p, g);
    s = mul_add(g, g, s);
    p = p + (neg_clr * g) / (sqrt_of(s) + eps);
  }
};

// The rule of one adagrad_ call from its arguments (inv_scale: 1/grad_scale), without the
// per-tensor step size (zero until for_tensor sets it).
template <typename V>
FUSED_OPTIM_HD AdagradRule<V> adagrad_rule(double eps, double weight_decay, bool maximize, double inv_scale) {
  AdagradRule<V> r;
  r.grad_mul = from_double<V>(maximize ? -inv_scale : inv_scale);
  r.wd = from_double<V>(weight_decay);
  r.eps = from_double<V>(eps);
  r.neg_clr = from_double<V>(0.0);
  r.has_wd = weight_decay != 0.0;
  return r;
}

}  // namespace fused_optim
