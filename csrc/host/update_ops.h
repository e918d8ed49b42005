// Generated from the op specs (fused_optim/specs.py) by `python -m fused_optim.cpp_header`: do not
// edit. The CPU kernel of every update op (csrc/cpu), with the schema's arguments in its order.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

// X(name) for every update op `name_`: binding.cpp registers its CUDA kernels.
#define FUSED_OPTIM_UPDATE_OPS(X) \
  X(sgd) \
  X(sign_sgd) \
  X(lars) \
  X(colossal_lars) \
  X(sparsified_sgd) \
  X(adam) \
  X(lamb) \
  X(colossal_lamb) \
  X(lion) \
  X(adagrad)

// X(name) for every update op with a compact twin `name_compact_` (binding.cpp).
#define FUSED_OPTIM_COMPACT_OPS(X) \
  X(sgd) \
  X(sign_sgd) \
  X(lars) \
  X(colossal_lars) \
  X(adam) \
  X(lamb) \
  X(colossal_lamb) \
  X(lion) \
  X(adagrad)

namespace fused_optim {

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
             at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
             double dampening, double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum,
             const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
             const std::optional<at::Tensor>& found_inf);
void sign_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, const std::optional<at::Tensor>& lr_tensor,
                  const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void lars_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
              at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, double trust_coefficient, double eps,
              bool trust_clip, bool always_adapt, const std::optional<at::Tensor>& norm_sums, bool sums_only,
              const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf);
void colossal_lars_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                       at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
                       double eeta, double weight_decay, double epsilon, bool lars,
                       const std::optional<at::Tensor>& norm_sums, bool sums_only,
                       const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf);
void sparsified_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList memories,
                        at::TensorList master_params, double lr, double weight_decay, int64_t sparse_grad_size,
                        bool random_sparse, const std::optional<at::Generator>& generator,
                        c10::IntArrayRef whole_shapes, c10::IntArrayRef box_offsets,
                        const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf);
void adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList master_params, double lr,
              double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool decoupled,
              bool maximize, bool bias_correction, double div_scale, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList steps, at::TensorList master_params, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode, double max_grad_norm,
              bool use_nvlamb, bool trust_clip, const std::optional<at::Tensor>& global_grad_norm,
              const std::optional<at::Tensor>& norm_sums, bool sums_only, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void colossal_lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params, double lr,
                       double beta1, double beta2, double eps, double weight_decay, bool adam, bool bias_correction,
                       const std::optional<at::Tensor>& norm_sums, bool sums_only,
                       const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf);
void lion_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList master_params,
              double lr, double beta1, double beta2, double weight_decay, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void adagrad_cpu(at::TensorList params, at::TensorList grads, at::TensorList sums, at::TensorList steps,
                 at::TensorList master_params, double lr, double lr_decay, double weight_decay, double eps,
                 bool maximize, const std::optional<at::Tensor>& lr_tensor,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void sgd_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                     at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                     const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                     double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum, bool stochastic_state,
                     bool stochastic_params, c10::IntArrayRef element_offsets,
                     const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf);
void sign_sgd_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                          at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                          const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                          double weight_decay, bool nesterov, bool stochastic_state, bool stochastic_params,
                          c10::IntArrayRef element_offsets, const std::optional<at::Tensor>& lr_tensor,
                          const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void lars_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                      at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                      const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                      double weight_decay, bool nesterov, double trust_coefficient, double eps, bool trust_clip,
                      bool always_adapt, const std::optional<at::Tensor>& norm_sums, bool sums_only,
                      bool stochastic_state, bool stochastic_params, c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf);
void colossal_lars_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                               at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                               const c10::List<bool>& first_step, double lr, double momentum, double eeta,
                               double weight_decay, double epsilon, bool lars,
                               const std::optional<at::Tensor>& norm_sums, bool sums_only, bool stochastic_state,
                               bool stochastic_params, c10::IntArrayRef element_offsets,
                               const std::optional<at::Tensor>& lr_tensor,
                               const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf);
void adam_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps,
                      at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys, double lr,
                      double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool decoupled,
                      bool maximize, bool bias_correction, double div_scale, bool stochastic_state,
                      bool stochastic_params, c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf);
void lamb_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params,
                      at::TensorList absmaxes, at::TensorList rounding_keys, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode,
                      double max_grad_norm, bool use_nvlamb, bool trust_clip,
                      const std::optional<at::Tensor>& global_grad_norm, const std::optional<at::Tensor>& norm_sums,
                      bool sums_only, bool stochastic_state, bool stochastic_params, c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf);
void colossal_lamb_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params,
                               at::TensorList absmaxes, at::TensorList rounding_keys, double lr, double beta1,
                               double beta2, double eps, double weight_decay, bool adam, bool bias_correction,
                               const std::optional<at::Tensor>& norm_sums, bool sums_only, bool stochastic_state,
                               bool stochastic_params, c10::IntArrayRef element_offsets,
                               const std::optional<at::Tensor>& lr_tensor,
                               const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf);
void lion_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys, double lr,
                      double beta1, double beta2, double weight_decay, bool stochastic_state, bool stochastic_params,
                      c10::IntArrayRef element_offsets, const std::optional<at::Tensor>& lr_tensor,
                      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);
void adagrad_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList sums, at::TensorList steps,
                         at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                         double lr, double lr_decay, double weight_decay, double eps, bool maximize,
                         bool stochastic_state, bool stochastic_params, c10::IntArrayRef element_offsets,
                         const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf);

}  // namespace fused_optim
