// The step counters of Adam and LAMB on CUDA: float32 tensors on the device, one element each,
// incremented after the update read them (same stream, so in order), unless found_inf is set.
#include <vector>

#include "launch.h"
#include "multi_tensor_apply.cuh"

namespace fused_optim {
namespace cuda {
namespace {

struct IncrementFunctor {
  __device__ static void apply(const TensorListMetadata<1>& meta, const DeviceScalars& s) {
    if (skip_step(s)) return;
    for_each_element<ListTypes<float>, 1>(meta, chunk_of_block(meta), [](float(&x)[1]) { x[0] += 1.f; });
  }
};

}  // namespace

void increment_steps_launch(int64_t n, float* const* steps, const DeviceScalars& scalars, cudaStream_t stream) {
  const std::vector<int64_t> ones(n, 1);
  const auto pointers = concat_lists(n, {reinterpret_cast<void* const*>(steps)});
  multi_tensor_apply<1, IncrementFunctor>(n, pointers.data(), ones.data(), scalars, stream);
}

}  // namespace cuda
}  // namespace fused_optim
