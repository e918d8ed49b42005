// The host entry points of the CUDA kernels, in CUDA-only terms: tensors as pointers and element
// counts, per-step scalars as device pointers (read by the kernels, never by the host: a step
// does no host sync and can be captured in a CUDA graph). The torch binding calls these; the
// kernels (*.cu) compile with nvcc alone, without torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_optim {
namespace cuda {

enum class DType { kFloat, kDouble, kHalf, kBFloat16 };

// torch.optim.SGD's update (sgd_), or SignSGD's (sign_sgd_: p <- p - lr*sign(d)); see sgd.cu.
enum class SgdDirection { kPlain, kSign };

struct SgdArgs {
  const float* lr;          // device, one value
  const float* grad_scale;  // device or nullptr: grads are divided by it
  const float* found_inf;   // device or nullptr: non-zero -> nothing changes
  float momentum = 0.f, dampening = 0.f, weight_decay = 0.f;
  bool nesterov = false, maximize = false, wd_after_momentum = false;
  bool first_step = false;  // the momentum buffers are set to d (torch's first step)
};

// One launch sequence over n tensors of one dtype; bufs is nullptr when momentum == 0.
void sgd_launch(DType dtype, SgdDirection direction, int64_t n, void* const* params, void* const* grads,
                void* const* bufs, const int64_t* sizes, const SgdArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace fused_optim
