// Lion's update per element (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms";
// the order of operations of lion-pytorch), on the CPU (csrc/cpu/lion.cpp: V =
// at::vec::Vectorized<float/double>) and on CUDA (csrc/cuda/lion.cu: V = float/double), in opmath:
//   g <- grad_mul*g                          (grad_mul = 1/grad_scale)
//   c <- (1 - beta1)*g + beta1*m             (the direction; beta1*m rounded first)
//   p <- p*(1 - lr*wd)                       (decoupled weight decay, only when wd != 0)
//   p <- p - lr*sign(c)                      (sign(0) = sign(NaN) = 0, as torch.sign)
//   m <- (1 - beta2)*g + beta2*m             (beta2*m rounded first)
// Each x*y + z above is one fused multiply-add (mul_add, primitives.h), the rounding of torch's
// `m.mul(beta).add(g, alpha=1 - beta)` and `p.add(sign, alpha=-lr)` on the CPU.
#pragma once

#include "adam_math.h"  // decoupled_decay
#include "primitives.h"

namespace fused_optim {

// Built by lion_rule (below).
template <typename V>
struct LionRule {
  V grad_mul, decay_mul, neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2;
  bool has_wd;

  FUSED_OPTIM_HD void apply(V& p, V g, V& m) const {
    g = g * grad_mul;
    const V c = mul_add(one_minus_beta1, g, beta1 * m);
    if (has_wd) p = p * decay_mul;
    p = mul_add(neg_lr, sign_of(c), p);
    m = mul_add(one_minus_beta2, g, beta2 * m);
  }
};

// The rule of one lion_ call from its arguments (inv_scale: 1/grad_scale).
template <typename V>
FUSED_OPTIM_HD LionRule<V> lion_rule(double lr, double beta1, double beta2, double weight_decay, double inv_scale) {
  LionRule<V> r;
  r.grad_mul = from_double<V>(inv_scale);
  r.decay_mul = from_double<V>(decoupled_decay(lr, weight_decay));
  r.neg_lr = from_double<V>(-lr);
  r.beta1 = from_double<V>(beta1);
  r.one_minus_beta1 = from_double<V>(1.0 - beta1);
  r.beta2 = from_double<V>(beta2);
  r.one_minus_beta2 = from_double<V>(1.0 - beta2);
  r.has_wd = weight_decay != 0.0;
  return r;
}

}  // namespace fused_optim
