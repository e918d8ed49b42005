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
  m.impl("powersgd_accumulate_", &powersgd_accumulate_cpu);
  m.impl("powersgd_decompress_", &powersgd_decompress_cpu);
#define FUSED_OPTIM_REGISTER_CPU(name) m.impl(#name "_", &name##_cpu);
  FUSED_OPTIM_UPDATE_OPS(FUSED_OPTIM_REGISTER_CPU)
#undef FUSED_OPTIM_REGISTER_CPU
#define FUSED_OPTIM_REGISTER_COMPACT(name) m.impl(#name "_compact_", &name##_compact_cpu);
  FUSED_OPTIM_COMPACT_OPS(FUSED_OPTIM_REGISTER_COMPACT)
#undef FUSED_OPTIM_REGISTER_COMPACT
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  m.impl("bucket_new", &bucket_new);
  m.impl("bucket_free", &bucket_free);
  m.impl("bucket_grads_match", &bucket_grads_match);
  m.impl("grad_norm_hooks", &grad_norm_hooks);
  m.impl("remove_grad_hooks", &remove_grad_hooks);
  m.impl("grad_sum_squares_", &grad_sum_squares_);
#define FUSED_OPTIM_REGISTER_TWIN(name) impl_twin<&name##_cpu>(m, #name "_");
  FUSED_OPTIM_UPDATE_OPS(FUSED_OPTIM_REGISTER_TWIN)
#undef FUSED_OPTIM_REGISTER_TWIN
#define FUSED_OPTIM_REGISTER_COMPACT_TWIN(name) impl_twin<&name##_compact_cpu>(m, #name "_compact_");
  FUSED_OPTIM_COMPACT_OPS(FUSED_OPTIM_REGISTER_COMPACT_TWIN)
#undef FUSED_OPTIM_REGISTER_COMPACT_TWIN
}

}  // namespace fused_optim
