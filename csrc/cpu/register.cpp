// Registration of every CPU implementation (declared in ops.h) for the schemas of
// fused_optim/_ops.py: the update ops and the norm for the CPU key; the bucket twins, the
// bucket registry and AdaScale's gradient norms for CompositeExplicitAutograd, because a twin may
// take no tensor argument at all, and the norms call sum_squares_ for their tensors' device.
#include "ops.h"

#include <torch/library.h>

namespace fused_optim {

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("l2norm", &l2norm_cpu);
  m.impl("sum_squares_", &sum_squares_cpu);
  m.impl("sgd_", &sgd_cpu);
  m.impl("sign_sgd_", &sign_sgd_cpu);
  m.impl("lars_", &lars_cpu);
  m.impl("colossal_lars_", &colossal_lars_cpu);
  m.impl("sparsified_sgd_", &sparsified_sgd_cpu);
  m.impl("adam_", &adam_cpu);
  m.impl("lamb_", &lamb_cpu);
  m.impl("colossal_lamb_", &colossal_lamb_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  m.impl("bucket_new", &bucket_new);
  m.impl("bucket_free", &bucket_free);
  m.impl("grad_norm_hooks", &grad_norm_hooks);
  m.impl("remove_grad_hooks", &remove_grad_hooks);
  m.impl("grad_sum_squares_", &grad_sum_squares_);
  m.impl("sgd_bucket", &sgd_bucket);
  m.impl("sign_sgd_bucket", &sign_sgd_bucket);
  m.impl("lars_bucket", &lars_bucket);
  m.impl("colossal_lars_bucket", &colossal_lars_bucket);
  m.impl("sparsified_sgd_bucket", &sparsified_sgd_bucket);
  m.impl("adam_bucket", &adam_bucket);
  m.impl("lamb_bucket", &lamb_bucket);
  m.impl("colossal_lamb_bucket", &colossal_lamb_bucket);
}

}  // namespace fused_optim
