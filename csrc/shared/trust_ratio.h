// The per-tensor trust ratios of the layer-wise optimizers, on double, shared by the CPU
// (csrc/cpu/lars.cpp, lamb.cpp) and CUDA (csrc/cuda/sgd.cu, lamb.cu). Norms are of the unscaled
// gradient (divided by grad_scale).
//
// lars_ (quadra LARS, timm's trust_clip): when ||p|| > 0 and ||g|| > 0,
//   r = trust_coefficient*||p|| / (||g|| + wd*||p|| + eps), with trust_clip r <- min(r/lr, 1),
//   and the direction is (g + wd*p)*r: grad multiplier times r, weight decay wd*r;
//   else the direction is g (no weight decay). It adapts when wd != 0 or always_adapt, else it
//   is plain SGD without weight decay (the callers decide).
// colossal_lars_ (ColossalAI's Lars): lr_t = lr*clamp(r, 0, 50) with
//   r = eeta*||p|| / (||g|| + wd*||p|| + epsilon) (1 if a norm is 0); its direction is
//   clamp(g + wd*p, -10, 10) before plain momentum (sgd_math.h, SgdDirection::kClamp).
// lamb_, colossal_lamb_: r = ||p||/||u|| (1 if a norm is 0), with trust_clip min(r, 1)
//   (u: lamb_math.h).
#pragma once

#include "primitives.h"

namespace fused_optim {

constexpr double kColossalLarsMaxTrust = 50.0;
constexpr double kColossalLarsGradClamp = 10.0;

struct LarsTensor {
  double grad_mul, weight_decay;
};

// grad_mul: the gradient multiplier before the ratio (1/grad_scale).
FUSED_OPTIM_HD LarsTensor lars_tensor(double param_norm, double grad_norm, double grad_mul, double lr,
                                      double trust_coefficient, double weight_decay, double eps, bool trust_clip) {
  if (!(param_norm > 0.0 && grad_norm > 0.0)) return {grad_mul, 0.0};
  double r = trust_coefficient * param_norm / (grad_norm + weight_decay * param_norm + eps);
  if (trust_clip) r = min_of(r / lr, 1.0);
  return {grad_mul * r, weight_decay * r};
}

// The tensor's lr.
FUSED_OPTIM_HD double colossal_lars_lr(double param_norm, double grad_norm, double lr, double eeta,
                                       double weight_decay, double epsilon) {
  const double r = param_norm > 0.0 && grad_norm > 0.0
                       ? eeta * param_norm / (grad_norm + weight_decay * param_norm + epsilon)
                       : 1.0;
  return lr * clamp_of(r, 0.0, kColossalLarsMaxTrust);
}

FUSED_OPTIM_HD double lamb_trust_ratio(double param_norm, double update_norm, bool trust_clip) {
  const double r = param_norm > 0.0 && update_norm > 0.0 ? param_norm / update_norm : 1.0;
  return trust_clip ? min_of(r, 1.0) : r;
}

}  // namespace fused_optim
