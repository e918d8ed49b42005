// fused_optim::lion_ on CUDA (the CPU twin: csrc/cpu/lion.cpp): Lion, the math per element in
// csrc/shared/lion_math.h, skipped when found_inf is set. With master weights the one pass reads
// the fp16/bf16 grads, updates the fp32 masters and momentum and writes the rounded params.
// lion_compact_: the same functor on compact momentum or stochastically rounded bf16 params
// (compact_state.cuh).
#include "launch.h"
#include "multi_tensor_apply.cuh"
#include "../shared/lion_math.h"

namespace fused_optim {
namespace cuda {
namespace {

// Lists: params, exp_avgs (mutable), grads; the model params with master weights (U:
// UpdateTypes); the absmaxes of 8-bit momentum.
template <typename U>
struct LionFunctor {
  using Types = ListTypes<typename U::value_t, moment_t<typename U::state_t, true>, typename U::grad_t>;
  static constexpr int kLists = Types::size;
  static constexpr int kDepth = kLists + U::kModelLists + Types::kQ8Lists;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const LionArgs& a) {
    using M = typename Types::opmath;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const auto rule = lion_rule<M>(lr_of(a.s), a.beta1, a.beta2, a.weight_decay, inv_scale_of(a.s));
    for_each_element<Types, 2, typename U::model_t>(meta, chunk, [&](M(&x)[kLists]) {
      rule.apply(x[0], x[2], x[1]);
    }, coding_of(a.s), a.s.grad_scale);
  }
};

}  // namespace

void lion_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                 void* const* exp_avgs, void* const* model, void* const* absmaxes, const int64_t* sizes,
                 const LionArgs& args, cudaStream_t stream) {
  const auto lists = concat_lists(n, {params, exp_avgs, grads, model, absmax_list(absmaxes, n, 0)});
  dispatch_any_update(dtypes, [&](auto types) {
    using F = LionFunctor<decltype(types)>;
    multi_tensor_apply<F::kDepth, F>(n, lists.data(), sizes, args, stream);
  });
}

}  // namespace cuda
}  // namespace fused_optim
