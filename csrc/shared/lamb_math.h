// LAMB's update per element (lamb_, colossal_lamb_), on the CPU (csrc/cpu/lamb.cpp: V =
// at::vec::Vectorized<float/double>) and on CUDA (csrc/cuda/lamb.cu: V = float/double), in
// opmath, and its per-tensor numbers, on double. Per element:
//   g^ <- grad_mul*g               (grad_mul = 1/(grad_scale*clip): lamb_grad_multiplier)
//   g^ <- g^ + wd*p                (L2 mode: lamb_ with adam_w_mode=False; only when wd != 0)
//   m <- beta1*m + beta3*g^        (beta3 = 1 - beta1, or 1 without grad averaging)
//   v <- beta2*v + (1 - beta2)*g^*g^
//   u <- (m*c1) / (sqrt(v)*c2 + eps) (+ wd*p in decoupled mode, when wd != 0)
//   p <- p - lr_t*r*u              (r: the trust ratio, lamb_trust_ratio in trust_ratio.h, or 1)
// Per tensor, with bc1, bc2 of its step (Adam's bias corrections, adam_math.h):
//   lamb_          (apex/ColossalAI FusedLAMB = timm Lamb): c1 = 1/bc1, c2 = 1/sqrt(bc2), lr_t = lr
//   colossal_lamb_ (ColossalAI Lamb):                       c1 = c2 = 1, lr_t = lr*sqrt(bc2)/bc1
// Each x*y + z above is one fused multiply-add (mul_add, primitives.h), (1 - beta2)*g^*g^ is
// ((1 - beta2)*g^)*g^.
#pragma once

#include "adam_math.h"
#include "primitives.h"

namespace fused_optim {

// Built by lamb_rule (below).
template <typename V>
struct LambRule {
  V grad_mul, wd, beta1, beta3, beta2, one_minus_beta2, eps;
  V c1, c2;  // per tensor
  bool has_wd, decoupled;

  // Updates m and v.
  FUSED_OPTIM_HD void moments(const V& p, const V& g, V& m, V& v) const {
    V gh = g * grad_mul;
    if (has_wd && !decoupled) gh = mul_add(wd, p, gh);
    m = mul_add(beta1, m, beta3 * gh);
    v = mul_add(beta2, v, one_minus_beta2 * gh * gh);
  }

  // u, from the updated m and v.
  FUSED_OPTIM_HD V direction(const V& p, const V& m, const V& v) const {
    V u = (m * c1) / mul_add(sqrt_of(v), c2, eps);
    if (has_wd && decoupled) u = mul_add(wd, p, u);
    return u;
  }

  // p <- p - lr_t*r*u, with neg_lr = -lr_t*r.
  static FUSED_OPTIM_HD void apply(V& p, const V& neg_lr, const V& u) { p = mul_add(neg_lr, u, p); }
};

// The options of lamb_ and colossal_lamb_ as both kernels use them (host side; the CPU kernel's
// Lamb and the CUDA launcher's LambArgs extend it).
struct LambOptions {
  double beta1 = 0.0, beta2 = 0.0, beta3 = 0.0, eps = 0.0, weight_decay = 0.0, max_grad_norm = 0.0;
  bool decoupled = false, trust_ratio = false, trust_clip = false, bias_correction = true;
  bool colossal = false;  // c1 = c2 = 1, bias corrections folded into the lr (lamb_tensor)
};

// lamb_ (apex/ColossalAI FusedLAMB, timm Lamb): its arguments as LambOptions.
inline LambOptions lamb_options(double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                                bool grad_averaging, bool adam_w_mode, double max_grad_norm, bool use_nvlamb,
                                bool trust_clip) {
  LambOptions o;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.beta3 = grad_averaging ? 1.0 - beta1 : 1.0;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.max_grad_norm = max_grad_norm;
  o.decoupled = adam_w_mode;
  o.trust_ratio = use_nvlamb || weight_decay != 0.0;
  o.trust_clip = trust_clip;
  o.bias_correction = bias_correction;
  return o;
}

// colossal_lamb_ (ColossalAI Lamb): decoupled decay, no clipping, the ratio unless `adam`.
inline LambOptions colossal_lamb_options(double beta1, double beta2, double eps, double weight_decay, bool adam,
                                         bool bias_correction) {
  LambOptions o;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.beta3 = 1.0 - beta1;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.decoupled = true;
  o.trust_ratio = !adam;
  o.bias_correction = bias_correction;
  o.colossal = true;
  return o;
}

struct LambTensor {
  double c1, c2, lr;
};

FUSED_OPTIM_HD LambTensor lamb_tensor(double lr, const BiasCorrection& bc, bool colossal) {
  if (colossal) return {1.0, 1.0, lr * sqrt_of(bc.bc2) / bc.bc1};
  return {1.0 / bc.bc1, 1.0 / sqrt_of(bc.bc2), lr};
}

// 1/(grad_scale*clip): clip = G/max_grad_norm when G > max_grad_norm > 0, else 1; G is the global
// gradient norm, unscaled (divided by grad_scale).
FUSED_OPTIM_HD double lamb_grad_multiplier(double inv_scale, double grad_norm, double max_grad_norm) {
  return max_grad_norm > 0.0 && grad_norm > max_grad_norm ? inv_scale * max_grad_norm / grad_norm : inv_scale;
}

// The rule of one tensor: the call's options, its gradient multiplier (lamb_grad_multiplier) and
// the tensor's numbers (lamb_tensor; their lr is the caller's, for apply).
template <typename V>
FUSED_OPTIM_HD LambRule<V> lamb_rule(const LambOptions& o, double grad_mul, const LambTensor& t) {
  LambRule<V> r;
  r.grad_mul = from_double<V>(grad_mul);
  r.wd = from_double<V>(o.weight_decay);
  r.beta1 = from_double<V>(o.beta1);
  r.beta3 = from_double<V>(o.beta3);
  r.beta2 = from_double<V>(o.beta2);
  r.one_minus_beta2 = from_double<V>(1.0 - o.beta2);
  r.eps = from_double<V>(o.eps);
  r.c1 = from_double<V>(t.c1);
  r.c2 = from_double<V>(t.c2);
  r.has_wd = o.weight_decay != 0.0;
  r.decoupled = o.decoupled;
  return r;
}

}  // namespace fused_optim
