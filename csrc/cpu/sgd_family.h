// The SGD family: torch.optim.SGD's momentum update with per-tensor gradient multiplier, weight
// decay and lr, and a direction that is the momentum result itself (SGD, LARS), its sign
// (SignSGD), or computed from a clamped gradient (ColossalAI's Lars): the per-element rule of
// csrc/shared/sgd_math.h (SgdRule, shared with the CUDA kernel; the math is written there).
// sgd.cpp implements it; the ops that only differ in how they choose the per-tensor numbers
// (sgd_, sign_sgd_, lars_, colossal_lars_) call it after their own checks, LARS through
// sgd_family_after_norms, which has the numbers set from each tensor's ||p|| and ||g||.
#pragma once

#include "simd_blocks.h"  // before the shared rule (sgd_math.h)
#include "compact_state.h"
#include "op_args.h"
#include "two_pass.h"
#include "../host/checks.h"
#include "../shared/sgd_math.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace fused_optim {

struct SgdFamily {
  SgdDirection direction = SgdDirection::kPlain;
  double momentum = 0.0, dampening = 0.0, clamp = 0.0;
  bool nesterov = false, wd_after_momentum = false;
  std::vector<double> grad_mul, weight_decay, lr;  // one per tensor
  CompactArgs compact;  // compact momentum buffers / stochastic rounding (the compact twins)
  AmpArgs amp;  // whether the update writes the grads back unscaled (op_args.h)
};

// The checked inputs of an SGD-family op or its compact twin (absmaxes and keys empty for the
// plain op): params, contiguous grads, and the compact arguments, the buffers checked.
struct SgdCall {
  UpdatedParams params;
  ContiguousTensors grads;
  CompactArgs compact;
};

SgdCall sgd_call(const char* op, at::TensorList model, at::TensorList grads_in, at::TensorList bufs,
                 at::TensorList masters, const c10::List<bool>& first_step, double momentum, at::TensorList absmaxes,
                 at::TensorList keys, bool stochastic_state, bool stochastic_params, c10::IntArrayRef element_offsets,
                 bool written);

// The update, on inputs already checked by sgd_call (it advances the rounding keys).
void sgd_family(const UpdatedParams& params, const ContiguousTensors& grads, at::TensorList momentum_buffers,
                const c10::List<bool>& first_step, const SgdFamily& args);

// set(t, ||p[t]||, ||g[t]||) (p: the values updated, masters if any) changes args' numbers of tensor t (grads as stored: not unscaled).
using SetNumbers = std::function<void(size_t t, double param_norm, double grad_norm)>;

// The update after the norms: one two-pass launch (multi_tensor_two_pass) whose first pass sums
// ||p||^2 and ||g||^2 per tensor; set() runs once per non-empty tensor, before its update. The
// direction is kPlain or kClamp (LARS, ColossalAI's Lars). With `norm` (two_pass.h) the sums only
// (into norm.rows, nothing else written: no set(), no update), or set() from the rows given.
void sgd_family_after_norms(const UpdatedParams& params, const ContiguousTensors& grads,
                            at::TensorList momentum_buffers, const c10::List<bool>& first_step, const SgdFamily& args,
                            const SetNumbers& set, const NormSums& norm);

}  // namespace fused_optim
