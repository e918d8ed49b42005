// The CPU implementations of the ops declared in fused_optim/_ops.py (same argument order as the
// schemas), defined in one .cpp per op family and registered in register.cpp, the only file that
// includes <torch/library.h> (6 s of compile time per file that includes it). The update ops'
// kernels are declared in ../host/update_ops.h, generated from their specs; their bucket twins
// are generated from them in register.cpp (bucket_twin, bucket.h).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../host/update_ops.h"

namespace fused_optim {

using OptTensor = std::optional<at::Tensor>;
using Flags = c10::List<bool>;

// bucket.cpp: tensor lists kept on the C++ side between steps.
int64_t bucket_new(at::TensorList tensors, c10::IntArrayRef lengths);
void bucket_free(int64_t bucket);
// Whether every param of the bucket has a dense grad of its shape and dtype (a twin call with them
// cannot fail on its grads).
bool bucket_grads_match(int64_t bucket);

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

// powersgd.cpp: PowerSGD's fused passes over the error memories (fused_optim/distributed/powersgd.py).
void powersgd_accumulate_cpu(at::TensorList memories, at::TensorList grads, at::TensorList qts, at::TensorList pts);
void powersgd_decompress_cpu(at::TensorList memories, at::TensorList grads, at::TensorList pts, at::TensorList qts);

}  // namespace fused_optim
