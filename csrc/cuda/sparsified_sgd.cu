// fused_optim::sparsified_sgd_ on CUDA (the CPU twin: csrc/cpu/sparsified_sgd.cpp). Per tensor:
//   memory <- memory + lr*g/grad_scale ; p <- p - weight_decay*p   (every element, one launch for all)
//   p[i] <- p[i] - memory[i] ; memory[i] <- 0                     (its k indices, one launch each)
// The binding draws the indices on the host, and returns before drawing when found_inf is set (read
// on the host); the launches also skip on the device (skip_step).
// With master weights, p is the fp32 master and each launch writes the params it changes as their
// masters rounded (one pass over the fp16/bf16 grads, no fp32 copy).
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

// Lists: params, memories (mutable), grads; the model params with master weights (U: UpdateTypes).
template <typename U>
struct AccumulateFunctor {
  using Types = ListTypes<typename U::value_t, typename U::state_t, typename U::grad_t>;

  __device__ static void apply(const TensorListMetadata<3 + U::kModelLists>& meta, const SparsifiedArgs& a) {
    using M = typename Types::opmath;
    if (skip_step(a.s)) return;
    const M step = lr_of(a.s) * inv_scale_of(a.s), neg_wd = -a.weight_decay;
    for_each_element<Types, 2, typename U::model_t>(meta, chunk_of_block(meta), [&](M(&x)[3]) {
      x[1] = fma(step, x[2], x[1]);
      x[0] = fma(neg_wd, x[0], x[0]);
    }, {}, a.s.grad_scale);
  }
};

// param[i] <- param[i] - memory[i] ; memory[i] <- 0 at the k indices; with master weights (model
// not null) model[i] <- param[i] rounded.
template <typename U>
__global__ void __launch_bounds__(kBlockSize)
    sparse_apply_kernel(typename U::value_t* param, typename U::state_t* memory, typename U::model_t* model,
                        const int64_t* indices, int64_t k, DeviceScalars s) {
  using V = typename U::value_t;
  using S = typename U::state_t;
  if (skip_step(s)) return;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = indices[j];
    const auto updated = to_opmath<V>(param[i]) - to_opmath<S>(memory[i]);
    param[i] = from_opmath<V>(updated);
    memory[i] = from_opmath<S>(0);
    if constexpr (U::kModelLists == 1) model[i] = from_opmath<typename U::model_t>(updated);
  }
}

}  // namespace

void sparsified_sgd_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                           void* const* memories, void* const* model, const int64_t* sizes,
                           const DeviceScalars& scalars, double weight_decay, cudaStream_t stream) {
  const auto lists = concat_lists(n, {params, memories, grads, model});
  dispatch_update(dtypes, [&](auto types) {
    using U = decltype(types);
    multi_tensor_apply<3 + U::kModelLists, AccumulateFunctor<U>>(n, lists.data(), sizes,
                                                                 SparsifiedArgs{scalars, weight_decay}, stream);
  });
}

void sparse_apply_launch(const UpdateDTypes& dtypes, void* param, void* memory, void* model, const int64_t* indices,
                         int64_t k, const DeviceScalars& scalars, cudaStream_t stream) {
  if (k == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((k + kBlockSize - 1) / kBlockSize, kMaxBlocks));
  dispatch_update(dtypes, [&](auto types) {
    using U = decltype(types);
    FUSED_OPTIM_LAUNCH((sparse_apply_kernel<U>), blocks, kBlockSize, stream,
                       static_cast<typename U::value_t*>(param), static_cast<typename U::state_t*>(memory),
                       static_cast<typename U::model_t*>(model), indices, k, scalars);
  });
}

}  // namespace cuda
}  // namespace fused_optim
