// The CPU functions one kernel file calls of another. Each file registers the ops it implements
// (TORCH_LIBRARY_IMPL at its end, for the schemas of fused_optim/_ops.py): the update ops' kernels
// and, through impl_twin (bucket.h), their bucket twins. The kernels' declarations are generated
// from the specs into ../host/update_ops.h, included here so that each update kernel's definition
// is compiled against its schema's signature.
#pragma once

#include <ATen/core/Tensor.h>

#include "../host/update_ops.h"

namespace fused_optim {

// norm.cpp: sum(x^2) of one CPU tensor, the value sum_squares_ adds for it; a tensor of one work
// item is summed without the launcher's allocations (AdaScale's hooks, grad_norms.cpp, call this
// once per param and pass).
double squares_cpu(const at::Tensor& x, const char* op);

}  // namespace fused_optim
