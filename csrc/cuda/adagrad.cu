// fused_optim::adagrad_ on CUDA (the CPU twin: csrc/cpu/adagrad.cpp): torch.optim.Adagrad. The
// math: csrc/shared/adagrad_math.h, per element and the step size of the tensor's step
// s = steps[t] + 1 read by each block; then steps[t] <- s (increment_steps_launch), all skipped
// when found_inf is set. With master weights the one pass reads the fp16/bf16 grads, updates the
// fp32 masters and sums and writes the rounded params. adagrad_compact_: the same functor on
// compact sums or stochastically rounded bf16 params (compact_state.cuh).
#include "launch.h"
#include "multi_tensor_apply.cuh"
#include "../shared/adagrad_math.h"

namespace fused_optim {
namespace cuda {
namespace {

// Lists: params, sums (mutable), grads; the model params with master weights (U: UpdateTypes);
// then the step counters; then the absmaxes of 8-bit sums.
template <typename U>
struct AdagradFunctor {
  using Types = ListTypes<typename U::value_t, moment_t<typename U::state_t, false>, typename U::grad_t>;
  static constexpr int kLists = Types::size;
  static constexpr int kSteps = kLists + U::kModelLists;
  static constexpr int kDepth = kSteps + 1 + Types::kQ8Lists;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const AdagradArgs& a) {
    using M = typename Types::opmath;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const double step = static_cast<double>(*static_cast<const float*>(meta.addresses[kSteps][chunk.slot])) + 1.0;
    const auto rule = adagrad_rule<M>(a.eps, a.weight_decay, a.maximize, inv_scale_of(a.s))
                          .for_tensor(adagrad_step_size(lr_of(a.s), a.lr_decay, step));
    for_each_element<Types, 2, typename U::model_t>(meta, chunk, [&](M(&x)[kLists]) {
      rule.apply(x[0], x[2], x[1]);
    }, coding_of(a.s), a.s.grad_scale);
  }
};

}  // namespace

void adagrad_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads, void* const* sums,
                    void* const* model, float* const* steps, void* const* absmaxes, const int64_t* sizes,
                    const AdagradArgs& args, cudaStream_t stream) {
  const auto lists = concat_lists(n, {params, sums, grads, model, reinterpret_cast<void* const*>(steps),
                                      absmax_list(absmaxes, n, 0)});
  dispatch_any_update(dtypes, [&](auto types) {
    using F = AdagradFunctor<decltype(types)>;
    multi_tensor_apply<F::kDepth, F>(n, lists.data(), sizes, args, stream);
  });
  increment_steps_launch(n, steps, args.s, stream);
}

}  // namespace cuda
}  // namespace fused_optim
