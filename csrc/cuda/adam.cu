// fused_optim::adam_ on CUDA (the CPU twin: csrc/cpu/adam.cpp): torch.optim.Adam / AdamW. The
// math: csrc/shared/adam_math.h per element and per tensor, with the tensor's step
// s = steps[t] + 1 read by each block; then steps[t] <- s (increment_steps_launch), all skipped
// when found_inf is set. With master weights the one pass reads the fp16/bf16 grads, updates the
// fp32 masters and moments and writes the rounded params. adam_compact_: the same functor on
// compact moments or stochastically rounded bf16 params (compact_state.cuh).
#include <type_traits>

#include "launch.h"
#include "multi_tensor_apply.cuh"
#include "../shared/adam_math.h"

namespace fused_optim {
namespace cuda {
namespace {

// Lists: params, exp_avgs, exp_avg_sqs, [max_exp_avg_sqs] (mutable), grads; the model params
// with master weights (U: UpdateTypes); then the step counters; then the absmaxes of 8-bit state.
template <typename U, bool kAmsgrad>
struct AdamFunctor {
  using V = typename U::value_t;
  using M1 = moment_t<typename U::state_t, true>;
  using M2 = moment_t<typename U::state_t, false>;
  using G = typename U::grad_t;
  using Types = std::conditional_t<kAmsgrad, ListTypes<V, M1, M2, M2, G>, ListTypes<V, M1, M2, G>>;
  static constexpr int kLists = Types::size;
  static constexpr int kSteps = kLists + U::kModelLists;
  static constexpr int kDepth = kSteps + 1 + Types::kQ8Lists;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const AdamArgs& a) {
    using M = typename Types::opmath;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const double step = static_cast<double>(*static_cast<const float*>(meta.addresses[kSteps][chunk.slot])) + 1.0;
    const double lr = lr_of(a.s);
    const AdamStep s = adam_step(lr, bias_correction(a.beta1, a.beta2, step, a.bias_correction));
    const AdamRule<M> rule =
        adam_rule<M>(lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.decoupled, a.maximize,
                     static_cast<double>(inv_scale_of(a.s)) / a.div_scale)
            .for_tensor(s);
    for_each_element<Types, kLists - 1, typename U::model_t>(meta, chunk, [&](M(&x)[kLists]) {
      if constexpr (kAmsgrad) {
        rule.apply(x[0], x[kLists - 1], x[1], x[2], x[3]);
      } else {
        rule.apply(x[0], x[kLists - 1], x[1], x[2]);
      }
    }, coding_of(a.s), a.s.grad_scale);
  }
};

}  // namespace

void adam_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                 void* const* exp_avgs, void* const* exp_avg_sqs, void* const* max_exp_avg_sqs, void* const* model,
                 float* const* steps, void* const* absmaxes, const int64_t* sizes, const AdamArgs& args,
                 cudaStream_t stream) {
  void* const* step_list = reinterpret_cast<void* const*>(steps);
  const bool amsgrad = max_exp_avg_sqs != nullptr;
  const auto lists = concat_lists(n, {params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, grads, model, step_list,
                                      absmax_list(absmaxes, n, 0), absmax_list(absmaxes, n, 1),
                                      amsgrad ? absmax_list(absmaxes, n, 2) : nullptr});
  dispatch_any_update(dtypes, [&](auto types) {
    using U = decltype(types);
    if (amsgrad) {
      using F = AdamFunctor<U, true>;
      multi_tensor_apply<F::kDepth, F>(n, lists.data(), sizes, args, stream);
    } else {
      using F = AdamFunctor<U, false>;
      multi_tensor_apply<F::kDepth, F>(n, lists.data(), sizes, args, stream);
    }
  });
  increment_steps_launch(n, steps, args.s, stream);
}

}  // namespace cuda
}  // namespace fused_optim
