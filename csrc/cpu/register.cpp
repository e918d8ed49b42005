// Registration of every CPU implementation (declared in ops.h) for the schemas of
// fused_optim/_ops.py: the update ops and the norm for the CPU key; the bucket twins, the
// bucket registry and AdaScale's gradient norms for CompositeExplicitAutograd, because a twin may
// take no tensor argument at all, and the norms call sum_squares_ for their tensors' device.
#include "bucket.h"
#include "ops.h"

#include <torch/library.h>

#include <string>

namespace fused_optim {
namespace {

// Registers "<name>bucket", the bucket twin of list op `name` implemented by `cpu` (bucket.h).
template <auto* cpu>
void impl_twin(torch::Library& m, const std::string& name) {
  m.impl((name + "bucket").c_str(), bucket_twin<cpu>(name));
}

}  // namespace

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
  impl_twin<&sgd_cpu>(m, "sgd_");
  impl_twin<&sign_sgd_cpu>(m, "sign_sgd_");
  impl_twin<&lars_cpu>(m, "lars_");
  impl_twin<&colossal_lars_cpu>(m, "colossal_lars_");
  impl_twin<&sparsified_sgd_cpu>(m, "sparsified_sgd_");
  impl_twin<&adam_cpu>(m, "adam_");
  impl_twin<&lamb_cpu>(m, "lamb_");
  impl_twin<&colossal_lamb_cpu>(m, "colossal_lamb_");
}

}  // namespace fused_optim
