// How a CPU update op reads its arguments: the scalar inputs every op reads the same way
// (GradScaler's grad_scale / found_inf, the Tensor lr, the float step counters), and the streams
// of its tensors that the update reads and writes (grads, params or their masters, plain state;
// compact state: compact_state.h).
//
// Master weights (UpdatedParams: csrc/host/checks.h): an update over fp16 or bf16 params with
// fp32 masters reads the half grads, updates the fp32 masters and the fp32 state in opmath, and
// writes each param as its master rounded to nearest even: one pass, no fp32 grad copy. Kernels
// are instantiated for (T, S): T the dtype of the params and grads, which leads the SIMD blocks
// (multi_tensor.h), and S that of the values updated and of the state: T, or float with masters.
//
// The state of an update op is PlainState (its list op: every state tensor in S, a stream of
// for_each_block is its data pointer) or CompactArgs (its compact twin, compact_state.h). A
// kernel is written once over both: state_args, check_state_list, dispatch_streams and
// advance_keys are overloaded on them, and the streams object dispatch_streams hands the loop
// opens each tensor's param and state streams and walks their elements.
#pragma once

#include "multi_tensor.h"
#include "../host/checks.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <type_traits>

namespace fused_optim {

// ---- scalar inputs ------------------------------------------------------------------------------

// grad_scale / found_inf as set by torch.amp.GradScaler: skip everything when found_inf != 0,
// otherwise multiply grads by 1/grad_scale inside the kernel and, when that is not 1, write the
// grads back unscaled in the update's last pass over them (grad_stream), as torch's fused
// optimizers do: after scaler.step(opt), p.grad holds what scaler.unscale_(opt) would have made.
struct AmpArgs {
  bool skip = false;
  double inv_scale = 1.0;
  bool unscale_grads = false;
};

inline AmpArgs read_amp(const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  AmpArgs amp;
  if (found_inf.has_value() && found_inf->defined()) {
    TORCH_CHECK(found_inf->numel() == 1, "fused_optim: found_inf must have one element");
    amp.skip = found_inf->item<double>() != 0.0;
  }
  if (grad_scale.has_value() && grad_scale->defined()) {
    TORCH_CHECK(grad_scale->numel() == 1, "fused_optim: grad_scale must have one element");
    amp.inv_scale = 1.0 / grad_scale->item<double>();
    amp.unscale_grads = !amp.skip && amp.inv_scale != 1.0;
  }
  return amp;
}

// The grads of tensor t as the update's last pass over them reads them: written back unscaled
// when `amp` says so (the caller then ends with grads.copy_back(), for grads it was given
// non-contiguous); passes that only read them (norms, sums-only calls) take cptr.
template <typename T>
GradStream<T> grad_stream(const ContiguousTensors& grads, int64_t t, const AmpArgs& amp) {
  return {cptr<T>(grads[t]), amp.unscale_grads ? ptr<T>(grads[t]) : nullptr,
          static_cast<opmath_t<T>>(amp.inv_scale)};
}

// The end of an update that wrote its grads back: the caller's non-contiguous grads get the
// unscaled values of their contiguous copies.
inline void finish_grads(const ContiguousTensors& grads, const AmpArgs& amp) {
  if (amp.unscale_grads) grads.copy_back();
}

// The learning rate: lr, or the value of lr_tensor when one is given (a Tensor lr of torch.optim).
inline double read_lr(double lr, const std::optional<at::Tensor>& lr_tensor) {
  if (!lr_tensor.has_value() || !lr_tensor->defined()) return lr;
  TORCH_CHECK(lr_tensor->numel() == 1, "fused_optim: lr_tensor must have one element, got ", lr_tensor->numel());
  return lr_tensor->item<double>();
}

// Float step counters (torch.optim's layout: 0-dim float32, or float64 under a float64 default),
// read and written through their data pointer: a dispatcher call per tensor would cost microseconds.
inline void check_steps(const char* op, at::TensorList params, at::TensorList steps) {
  check_same_size(op, "steps", params, steps);
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    TORCH_CHECK(s.numel() == 1 && s.device().is_cpu() &&
                    (s.scalar_type() == at::kFloat || s.scalar_type() == at::kDouble),
                "fused_optim::", op, ": steps[", i, "] must be a 1-element float32/float64 CPU tensor");
  }
}

inline double read_step(const at::Tensor& s) {
  return s.scalar_type() == at::kFloat ? static_cast<double>(*ptr<float>(s)) : *ptr<double>(s);
}

inline void write_step(const at::Tensor& s, double value) {
  if (s.scalar_type() == at::kFloat) {
    *ptr<float>(s) = static_cast<float>(value);
  } else {
    *ptr<double>(s) = value;
  }
}

// ---- streams -----------------------------------------------------------------------------------

template <typename T, typename S>
struct UpdateTypes {
  using grad_t = T;
  using state_t = S;
};

// f(UpdateTypes<T, S>{}) for the params' dtype T and, with masters, S = float (else S = T).
template <typename F>
void dispatch_update(const UpdatedParams& params, const F& f) {
  FUSED_OPTIM_DISPATCH_FLOATING(params.model[0].scalar_type(), "fused_optim update", [&] {
    if constexpr (kHalves<scalar_t> == 2) {
      if (!params.masters.empty()) return f(UpdateTypes<scalar_t, float>{});
    }
    return f(UpdateTypes<scalar_t, scalar_t>{});
  });
}

// The stream of param t that an update reads and writes: the param's data, or its master's
// (MasterStream, which also writes the rounded param).
template <typename T, typename S>
auto param_stream(const UpdatedParams& params, int64_t t) {
  if constexpr (std::is_same_v<T, S>) {
    return ptr<T>(params.model[t]);
  } else {
    return MasterStream<T>{ptr<float>(params.masters[t]), ptr<T>(params.model[t])};
  }
}

// The state of a list op: every state tensor has the dtype of the values it belongs to (the
// params, or their masters).
struct PlainState {};

// A list op's state as its kernel takes it (the compact twin's overload: compact_args.h).
inline PlainState state_args(const char*, const UpdatedParams&, at::TensorList, const PlainState&) { return {}; }

// Checks state list `what` (one dense contiguous tensor per value, of its dtype and size, on the
// values' device); returns `slot`, the next free 8-bit absmax slot of the compact overload (plain
// state takes none).
inline int check_state_list(const char* op, const char* what, const UpdatedParams& params, at::TensorList ts,
                            const PlainState&, int slot) {
  check_mutable(op, what, params.values(), ts, true);
  return slot;
}

// A plain stream that is read, never written back (LAMB's second pass reads the moments its first
// pass stored): read through const (compact streams: compact_state.h's overload).
template <typename U>
const U* read_only(U* stream) {
  return stream;
}

// The streams of a plain update: each state tensor's and param's data as for_each_block takes it.
// state()'s position arguments (k, slot, is_signed) are those of the compact streams'
// (CompactStreams, compact_state.h, which a kernel's loop takes as well).
template <typename T, typename S>
struct PlainStreams {
  static constexpr bool kPlainState = true;
  const UpdatedParams& params;

  S* state(at::TensorList list, int64_t t, int, int, bool) const { return ptr<S>(list[t]); }
  template <typename F>
  void with_param(int64_t t, const F& f) const {
    f(param_stream<T, S>(params, t));
  }
  template <typename Body, typename... Stream>
  void for_each(int64_t begin, int64_t end, const Body& body, Stream... streams) const {
    for_each_block<T>(begin, end, body, streams...);
  }
};

// f(streams) for an update of types (T, S) on plain state.
template <typename T, typename S, typename F>
void dispatch_streams(const UpdatedParams& params, const PlainState&, const F& f) {
  f(PlainStreams<T, S>{params});
}

// After the update: nothing to advance (compact state's rounding keys: compact_args.h).
inline void advance_keys(const PlainState&) {}

}  // namespace fused_optim
