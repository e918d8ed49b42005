// Adam / AdamW's math: the bias corrections of a tensor's step count (per tensor, on double; LAMB's
// too, lamb_math.h) and the update per element (torch.optim.Adam's order of operations), on the
// CPU (csrc/cpu/adam.cpp: V = at::vec::Vectorized<float/double>) and on CUDA (csrc/cuda/adam.cu:
// V = float/double), in opmath. Per tensor, `step` its count after this step's increment:
//   bc1 = 1 - beta1^step,  bc2 = 1 - beta2^step     (both 1 without bias correction)
//   step size lr/bc1, and 1/sqrt(bc2)                (AdamStep)
// Per element, with the tensor's numbers:
//   g <- grad_mul*g                          (grad_mul = ±1/grad_scale, − when maximize)
//   p <- p*(1 - lr*wd) (decoupled: AdamW), or g <- g + wd*p (L2: Adam)      (only when wd != 0)
//   m <- m + (1 - beta1)*(g - m)
//   v <- beta2*v + (1 - beta2)*g*g
//   vmax <- max(vmax, v)                     (amsgrad; the update then reads vmax for v)
//   p <- p - step_size * m / (sqrt(v)*inv_bc2_sqrt + eps)
// Each x*y + z above is one fused multiply-add (mul_add, primitives.h), (1 - beta2)*g*g is
// ((1 - beta2)*g)*g.
#pragma once

#include "primitives.h"

#include <math.h>

namespace fused_optim {

struct BiasCorrection {
  double bc1 = 1.0, bc2 = 1.0;
};

// step: the step count after this step's increment (1 on the first step).
FUSED_OPTIM_HD BiasCorrection bias_correction(double beta1, double beta2, double step, bool enabled) {
  if (!enabled) return {};
  return {1.0 - pow(beta1, step), 1.0 - pow(beta2, step)};
}

// The bias corrections of the step counts of a bucket's tensors in turn (on the host), recomputed
// only when a count differs from the previous one: a bucket's tensors usually share it, and pow
// was ~4% of a LAMB step of 200 small tensors.
class BiasCorrections {
 public:
  BiasCorrections(double beta1, double beta2, bool enabled) : beta1_(beta1), beta2_(beta2), enabled_(enabled) {}

  const BiasCorrection& at(double step) {
    if (step != step_) bc_ = bias_correction(beta1_, beta2_, step, enabled_);
    step_ = step;
    return bc_;
  }

 private:
  double beta1_, beta2_;
  bool enabled_;
  double step_ = -1.0;  // no step count: the first at() computes
  BiasCorrection bc_;
};

struct AdamStep {
  double step_size;     // lr/bc1
  double inv_bc2_sqrt;  // 1/sqrt(bc2)
};

FUSED_OPTIM_HD AdamStep adam_step(double lr, const BiasCorrection& bc) { return {lr / bc.bc1, 1.0 / sqrt_of(bc.bc2)}; }

// The decoupled decay factor 1 - lr*wd, on double.
FUSED_OPTIM_HD double decoupled_decay(double lr, double weight_decay) { return 1.0 - lr * weight_decay; }

// Built by adam_rule (the call's numbers), then for_tensor (a tensor's).
template <typename V>
struct AdamRule {
  V grad_mul, wd, decay_mul, one_minus_beta1, beta2, one_minus_beta2, eps;
  V neg_step_size, inv_bc2_sqrt;  // per tensor
  bool has_wd, decoupled;

  // This rule with the per-tensor numbers of a tensor's step (adam_step).
  FUSED_OPTIM_HD AdamRule for_tensor(const AdamStep& s) const {
    AdamRule r = *this;
    r.neg_step_size = from_double<V>(-s.step_size);
    r.inv_bc2_sqrt = from_double<V>(s.inv_bc2_sqrt);
    return r;
  }

  FUSED_OPTIM_HD void apply(V& p, V g, V& m, V& v) const { update(p, m, moments(p, g, m, v)); }

  // amsgrad: vmax is the running maximum of v.
  FUSED_OPTIM_HD void apply(V& p, V g, V& m, V& v, V& vmax) const {
    vmax = max_of(vmax, moments(p, g, m, v));
    update(p, m, vmax);
  }

 private:
  // Decays p or g and updates m and v; returns v.
  FUSED_OPTIM_HD V moments(V& p, V& g, V& m, V& v) const {
    g = g * grad_mul;
    if (has_wd) {
      if (decoupled) {
        p = p * decay_mul;
      } else {
        g = mul_add(wd, p, g);
      }
    }
    m = mul_add(one_minus_beta1, g - m, m);
    v = mul_add(beta2, v, one_minus_beta2 * g * g);
    return v;
  }

  FUSED_OPTIM_HD void update(V& p, const V& m, const V& v_used) const {
    const V denom = mul_add(sqrt_of(v_used), inv_bc2_sqrt, eps);
    p = mul_add(neg_step_size, m / denom, p);
  }
};

// The rule of one adam_ call from its arguments (inv_scale: 1/grad_scale), without the per-tensor
// numbers (zero until for_tensor sets them).
template <typename V>
FUSED_OPTIM_HD AdamRule<V> adam_rule(double lr, double beta1, double beta2, double eps, double weight_decay,
                                     bool decoupled, bool maximize, double inv_scale) {
  AdamRule<V> r;
  r.grad_mul = from_double<V>(maximize ? -inv_scale : inv_scale);
  r.wd = from_double<V>(weight_decay);
  r.decay_mul = from_double<V>(decoupled_decay(lr, weight_decay));
  r.one_minus_beta1 = from_double<V>(1.0 - beta1);
  r.beta2 = from_double<V>(beta2);
  r.one_minus_beta2 = from_double<V>(1.0 - beta2);
  r.eps = from_double<V>(eps);
  r.neg_step_size = from_double<V>(0.0);
  r.inv_bc2_sqrt = from_double<V>(0.0);
  r.has_wd = weight_decay != 0.0;
  r.decoupled = decoupled;
  return r;
}

}  // namespace fused_optim
