// The scalar inputs every update op reads the same way: GradScaler's grad_scale / found_inf, the
// Tensor lr, the float step counters, and the bias corrections of their step counts.
#pragma once

#include "simd_blocks.h"
#include "../shared/bias_correction.h"
#include "../host/checks.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace fused_optim {

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

// The bias corrections (csrc/shared/bias_correction.h) of the step counts of a bucket's tensors in
// turn, recomputed only when a count differs from the previous one: a bucket's tensors usually
// share it, and pow was ~4% of a LAMB step of 200 small tensors.
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

}  // namespace fused_optim
