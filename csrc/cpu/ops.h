// The CPU implementations of the ops declared in fused_optim/_ops.py (same argument order as the
// schemas), defined in one .cpp per op family and registered in register.cpp, the only file that
// includes <torch/library.h> (6 s of compile time per file that includes it). The update ops'
// bucket twins are generated from them there (bucket_twin, bucket.h).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fused_optim {

using OptTensor = std::optional<at::Tensor>;
using Flags = c10::List<bool>;

// bucket.cpp: tensor lists kept on the C++ side between steps.
int64_t bucket_new(at::TensorList tensors, c10::IntArrayRef lengths);
void bucket_free(int64_t bucket);

// grad_norms.cpp: AdaScale's gradient norms (micro-batch hooks, sums of the params' .grad).
std::vector<int64_t> grad_norm_hooks(at::TensorList params, c10::IntArrayRef index, const at::Tensor& sums,
                                     const at::Tensor& counts);
void remove_grad_hooks(at::TensorList params, c10::IntArrayRef positions);
void grad_sum_squares_(const at::Tensor& sums, at::TensorList params, c10::IntArrayRef index);

// norm.cpp
std::tuple<at::Tensor, at::Tensor> l2norm_cpu(at::TensorList tensors);
void sum_squares_cpu(const at::Tensor& sums, at::TensorList tensors, c10::IntArrayRef index);
// sum(x^2) of one CPU tensor, the value sum_squares_cpu adds for it; a tensor of one work item is
// summed without the launcher's allocations (AdaScale's hooks call this once per param and pass).
double squares_cpu(const at::Tensor& x, const char* op);

// sgd.cpp
void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, const Flags& first_step,
             double lr, double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
             bool wd_after_momentum, const OptTensor& lr_tensor, const OptTensor& grad_scale,
             const OptTensor& found_inf);
void sign_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, const Flags& first_step,
                  double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                  const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf);

// lars.cpp
void lars_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, const Flags& first_step,
              double lr, double momentum, double dampening, double weight_decay, bool nesterov,
              double trust_coefficient, double eps, bool trust_clip, bool always_adapt, const OptTensor& lr_tensor,
              const OptTensor& grad_scale, const OptTensor& found_inf);
void colossal_lars_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                       const Flags& first_step, double lr, double momentum, double eeta, double weight_decay,
                       double epsilon, bool lars, const OptTensor& lr_tensor, const OptTensor& grad_scale,
                       const OptTensor& found_inf);

// sparsified_sgd.cpp
void sparsified_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList memories, double lr,
                        double weight_decay, int64_t sparse_grad_size, bool random_sparse,
                        const std::optional<at::Generator>& generator, const OptTensor& lr_tensor,
                        const OptTensor& grad_scale, const OptTensor& found_inf);

// adam.cpp
void adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool amsgrad, bool decoupled, bool maximize, bool bias_correction,
              const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf);

// lamb.cpp
void lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay,
              bool bias_correction, bool grad_averaging, bool adam_w_mode, double max_grad_norm, bool use_nvlamb,
              bool trust_clip, const OptTensor& global_grad_norm, const OptTensor& lr_tensor,
              const OptTensor& grad_scale, const OptTensor& found_inf);
void colossal_lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                       at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool adam, bool bias_correction, const OptTensor& lr_tensor, const OptTensor& grad_scale,
                       const OptTensor& found_inf);

}  // namespace fused_optim
