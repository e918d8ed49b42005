// The SGD family: torch.optim.SGD's momentum update with per-tensor gradient multiplier, weight
// decay and lr, and a direction that is the momentum result itself (SGD, LARS), its sign
// (SignSGD), or computed from a clamped gradient (ColossalAI's Lars): the per-element rule of
// csrc/shared/sgd_math.h (SgdRule, shared with the CUDA kernel; the math is written there).
// sgd.cpp implements it; the ops that only differ in how they choose the per-tensor numbers
// (sgd_, sign_sgd_, lars_, colossal_lars_) call it after their own checks, LARS through
// sgd_family_after_norms, which has the numbers set from each tensor's ||p|| and ||g||.
#pragma once

#include "multi_tensor.h"  // before the shared rule (sgd_math.h)
#include "update_args.h"
#include "two_pass.h"
#include "../host/checks.h"
#include "../host/compact_args.h"
#include "../shared/sgd_math.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <functional>
#include <utility>
#include <vector>

namespace fused_optim {

struct SgdFamily {
  SgdDirection direction = SgdDirection::kPlain;
  double momentum = 0.0, dampening = 0.0, clamp = 0.0;
  bool nesterov = false, wd_after_momentum = false;
  std::vector<double> grad_mul, weight_decay, lr;  // one per tensor
  AmpArgs amp;  // whether the update writes the grads back unscaled (update_args.h)
};

// The checked inputs of an SGD-family op (States: PlainState, update_args.h) or its compact
// twin (CompactArgs: compact momentum buffers, stochastic rounding): params, contiguous grads, and
// the state arguments, the buffers checked.
template <typename States>
struct SgdCall {
  UpdatedParams params;
  ContiguousTensors grads;
  States states;
};

// sgd_call(..., PlainState{}) for a list op, (..., CompactInputs{...}) for its compact twin.
template <typename Inputs>
auto sgd_call(const char* op, at::TensorList model, at::TensorList grads_in, at::TensorList bufs,
              at::TensorList masters, const c10::List<bool>& first_step, double momentum, const Inputs& inputs,
              bool written) {
  const UpdatedParams params = checked_params(op, model, masters);
  ContiguousTensors grads = checked_grads(op, model, grads_in, written);
  auto states = state_args(op, params, bufs, inputs);
  if (momentum != 0.0) {
    check_state_list(op, "momentum_buffers", params, bufs, states, 0);
    TORCH_CHECK(first_step.size() == model.size() || first_step.empty(), "fused_optim::", op,
                ": first_step needs one flag per param (or none: no first steps)");
  } else {
    TORCH_CHECK(bufs.empty(), "fused_optim::", op, ": momentum_buffers must be empty when momentum == 0");
  }
  return SgdCall<decltype(states)>{params, std::move(grads), std::move(states)};
}

// The update, on inputs already checked by sgd_call (it advances the rounding keys). States:
// PlainState or CompactArgs (both instantiated in sgd.cpp).
template <typename States>
void sgd_family(const UpdatedParams& params, const ContiguousTensors& grads, at::TensorList momentum_buffers,
                const c10::List<bool>& first_step, const SgdFamily& args, const States& states);

// set(t, ||p[t]||, ||g[t]||) (p: the values updated, masters if any) changes args' numbers of tensor t (grads as stored: not unscaled).
using SetNumbers = std::function<void(size_t t, double param_norm, double grad_norm)>;

// The update after the norms: one two-pass launch (multi_tensor_two_pass) whose first pass sums
// ||p||^2 and ||g||^2 per tensor; set() runs once per non-empty tensor, before its update. The
// direction is kPlain or kClamp (LARS, ColossalAI's Lars). With `norm` (two_pass.h) the sums only
// (into norm.rows, nothing else written: no set(), no update), or set() from the rows given.
template <typename States>
void sgd_family_after_norms(const UpdatedParams& params, const ContiguousTensors& grads,
                            at::TensorList momentum_buffers, const c10::List<bool>& first_step, const SgdFamily& args,
                            const States& states, const SetNumbers& set, const NormSums& norm);

}  // namespace fused_optim
