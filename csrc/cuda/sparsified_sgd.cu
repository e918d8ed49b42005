// fused_optim::sparsified_sgd_ on CUDA (the CPU twin: csrc/cpu/sparsified_sgd.cpp). Per tensor:
//   memory <- memory + lr*g/grad_scale ; p <- p - weight_decay*p   (every element, one launch for all)
//   p[i] <- p[i] - memory[i] ; memory[i] <- 0                     (its k indices, one launch each)
// The binding draws the indices on the host; both launches are skipped when found_inf is set.
#include <algorithm>

#include "launch.h"
#include "multi_tensor_apply.cuh"

namespace fused_optim {
namespace cuda {
namespace {

struct SparsifiedArgs {
  DeviceScalars s;
  double weight_decay;
};

// Lists: params, memories (mutable), grads.
template <typename T>
struct AccumulateFunctor {
  __device__ static void apply(const TensorListMetadata<3>& meta, const SparsifiedArgs& a) {
    using M = opmath_t<T>;
    if (skip_step(a.s)) return;
    const M step = lr_of(a.s) * inv_scale_of(a.s), neg_wd = -a.weight_decay;
    for_each_element<T, 3, 2>(meta, chunk_of_block(meta), [&](M(&x)[3]) {
      x[1] = fma(step, x[2], x[1]);
      x[0] = fma(neg_wd, x[0], x[0]);
    });
  }
};

template <typename T>
__global__ void __launch_bounds__(kBlockSize)
    sparse_apply_kernel(T* param, T* memory, const int64_t* indices, int64_t k, DeviceScalars s) {
  if (skip_step(s)) return;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = indices[j];
    param[i] = from_opmath<T>(to_opmath<T>(param[i]) - to_opmath<T>(memory[i]));
    memory[i] = from_opmath<T>(0);
  }
}

}  // namespace

void sparsified_sgd_launch(DType dtype, int64_t n, void* const* params, void* const* grads, void* const* memories,
                           const int64_t* sizes, const DeviceScalars& scalars, double weight_decay,
                           cudaStream_t stream) {
  const auto lists = concat_lists(n, {params, memories, grads});
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    multi_tensor_apply<3, AccumulateFunctor<T>>(n, lists.data(), sizes, SparsifiedArgs{scalars, weight_decay}, stream);
  });
}

void sparse_apply_launch(DType dtype, void* param, void* memory, const int64_t* indices, int64_t k,
                         const DeviceScalars& scalars, cudaStream_t stream) {
  if (k == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((k + kBlockSize - 1) / kBlockSize, kMaxBlocks));
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    FUSED_OPTIM_LAUNCH((sparse_apply_kernel<T>), blocks, kBlockSize, stream, static_cast<T*>(param),
                       static_cast<T*>(memory), indices, k, scalars);
  });
}

}  // namespace cuda
}  // namespace fused_optim
