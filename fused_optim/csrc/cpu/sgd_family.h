// The SGD family: torch.optim.SGD's momentum update with per-tensor gradient multiplier, weight
// decay and lr, and a direction that is the momentum result itself (SGD, LARS), its sign
// (SignSGD), or computed from a clamped gradient (ColossalAI's Lars). Per element, in opmath:
//   d <- grad_mul[t]*g ; d <- d + wd[t]*p (unless wd_after_momentum) ; d <- clamp(d, -c, c) (kClamp)
//   buf <- d (first step) | momentum*buf + (1-dampening)*d ; d <- d + momentum*buf (nesterov) | buf
//   d <- d + wd[t]*p (wd_after_momentum) ; p <- p - lr[t]*(sign(d) (kSign) | d)
// sgd.cpp implements it; the ops that only differ in how they choose the per-tensor numbers
// (sgd_, sign_sgd_, lars_, colossal_lars_) call it after their own checks.
#pragma once

#include "multi_tensor.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <vector>

namespace fused_optim {

enum class Direction { kPlain, kSign, kClamp };

struct SgdFamily {
  Direction direction = Direction::kPlain;
  double momentum = 0.0, dampening = 0.0, clamp = 0.0;
  bool nesterov = false, wd_after_momentum = false;
  std::vector<double> grad_mul, weight_decay, lr;  // one per tensor
};

// The update of tensors [range.begin, range.end), on inputs already checked by check_sgd_inputs.
void sgd_family(at::TensorList params, const std::vector<at::Tensor>& grads, at::TensorList momentum_buffers,
                const c10::List<bool>& first_step, const SgdFamily& args, TensorRange range);

}  // namespace fused_optim
