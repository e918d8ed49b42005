// The SGD family's update per element: sgd_, sign_sgd_, lars_ and colossal_lars_, on the CPU
// (csrc/cpu/sgd.cpp: V = at::vec::Vectorized<float/double>) and on CUDA (csrc/cuda/sgd.cu: V =
// float/double), in opmath. With the tensor's numbers grad_mul (±1/grad_scale, − when maximize,
// times LARS's ratio: trust_ratio.h), wd and lr:
//   d <- grad_mul*g
//   d <- d + wd*p                 (weight decay before momentum: unless wd_after_momentum)
//   d <- clamp(d, -c, c)          (kClamp: ColossalAI's Lars, c = kColossalLarsGradClamp)
//   with momentum:  buf <- d on the buffer's first step, else momentum*buf + (1 - dampening)*d
//                   d <- d + momentum*buf (nesterov), else d <- buf
//   d <- d + wd*p                 (wd_after_momentum)
//   p <- p - lr*sign(d) (kSign: SignSGD), else p <- p - lr*d
// Each x*y + z above is one fused multiply-add (mul_add, primitives.h); no weight-decay term
// when wd == 0.
#pragma once

#include "primitives.h"

namespace fused_optim {

enum class SgdDirection { kPlain, kSign, kClamp };

// A tensor's numbers: grad_mul, wd and lr above.
struct SgdTensor {
  double grad_mul, weight_decay, lr;
};

// Built by sgd_rule (below).
template <typename V, SgdDirection D>
struct SgdRule {
  V grad_mul, wd, momentum, one_minus_dampening, neg_lr;
  V bound;  // kClamp: c
  // has_wd: wd != 0. GCC unswitches the CPU loops on these four flags; with a flag per decay term
  // (before / after momentum) it kept a test inside them.
  bool has_wd, wd_after_momentum, nesterov, first_step;

  // Without momentum.
  FUSED_OPTIM_HD void apply(V& p, const V& g) const {
    V d = decayed(p, g);
    if (has_wd && wd_after_momentum) d = mul_add(wd, p, d);
    p = mul_add(neg_lr, step_of(d), p);
  }

  // With the momentum buffer buf.
  FUSED_OPTIM_HD void apply(V& p, const V& g, V& buf) const {
    V d = decayed(p, g);
    buf = first_step ? d : mul_add(momentum, buf, one_minus_dampening * d);
    d = nesterov ? mul_add(momentum, buf, d) : buf;
    if (has_wd && wd_after_momentum) d = mul_add(wd, p, d);
    p = mul_add(neg_lr, step_of(d), p);
  }

 private:
  FUSED_OPTIM_HD V decayed(const V& p, const V& g) const {
    V d = g * grad_mul;
    if (has_wd && !wd_after_momentum) d = mul_add(wd, p, d);
    if constexpr (D == SgdDirection::kClamp) d = clamp_of(d, V(0) - bound, bound);
    return d;
  }

  static FUSED_OPTIM_HD V step_of(const V& d) {
    if constexpr (D == SgdDirection::kSign) {
      return sign_of(d);
    } else {
      return d;
    }
  }
};

// The rule of one tensor: its numbers and the call's momentum, dampening, clamp bound (kClamp) and
// flags; first_step: the momentum buffer's first step (buf <- d).
template <typename V, SgdDirection D>
FUSED_OPTIM_HD SgdRule<V, D> sgd_rule(const SgdTensor& t, double momentum, double dampening, double clamp,
                                      bool nesterov, bool wd_after_momentum, bool first_step) {
  SgdRule<V, D> r;
  r.grad_mul = from_double<V>(t.grad_mul);
  r.wd = from_double<V>(t.weight_decay);
  r.momentum = from_double<V>(momentum);
  r.one_minus_dampening = from_double<V>(1.0 - dampening);
  r.neg_lr = from_double<V>(-t.lr);
  r.bound = from_double<V>(clamp);
  r.has_wd = t.weight_decay != 0.0;
  r.wd_after_momentum = wd_after_momentum;
  r.nesterov = nesterov;
  r.first_step = first_step;
  return r;
}

}  // namespace fused_optim
