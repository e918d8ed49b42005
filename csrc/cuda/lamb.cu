// LAMB on CUDA (the CPU twin: csrc/cpu/lamb.cpp): lamb_ and colossal_lamb_. The math:
// csrc/shared/lamb_math.h (per element and per tensor), trust_ratio.h (the trust ratio r), with the
// tensor's step s = steps[t] + 1 read by each block, and the clipping norm G = grad_norm/grad_scale
// or sqrt(grad_sq)/grad_scale (launch.h).
// With the trust ratio, phase 1 updates m and v and writes the chunk partials of ||p||^2 and
// ||u||^2, sum_chunks adds them per tensor (fixed order), and phase 2 recomputes u from the stored
// m, v and the untouched p and updates p: no scratch the size of the params, grads untouched.
// Then the step counters are incremented; everything is skipped when found_inf is set. With master
// weights every pass reads the fp16/bf16 grads and the fp32 masters and state directly (||p|| is
// the masters' norm), and the passes that update the masters write the rounded params.
// The sharded step's calls (NormSums, launch.h): the sums-only call runs phase 1 without storing
// the moments and sums its partials into the given rows (with or without the trust ratio); the
// update with given rows runs the passes above, phase 2 taking ||p||^2 and ||u||^2 from the rows.
// lamb_compact_ / colossal_lamb_compact_: the same passes on compact moments or stochastically
// rounded bf16 params (compact_state.cuh), as the CPU runs them: phase 1 encodes the new moments
// after summing ||u||^2 of their fp32 values, phase 2 decodes the moments as stored.
#include "launch.h"
#include "reduce.cuh"
#include "../shared/lamb_math.h"
#include "../shared/trust_ratio.h"

namespace fused_optim {
namespace cuda {
namespace {

// The rule and lr_t of one tensor.
template <typename M>
struct TensorLamb {
  LambRule<M> rule;
  double lr;
};

// The numbers of the block's tensor; the step counter is the metadata's list `steps_list`.
template <typename M, int Depth>
__device__ TensorLamb<M> tensor_lamb(const TensorListMetadata<Depth>& meta, const Chunk& chunk, int steps_list,
                                     const LambArgs& a) {
  const double step = static_cast<double>(*static_cast<const float*>(meta.addresses[steps_list][chunk.slot])) + 1.0;
  const double inv_scale = inv_scale_of(a.s);
  double grad_mul = inv_scale;
  if (a.max_grad_norm > 0.0) {
    const double norm = (a.grad_norm != nullptr ? *a.grad_norm : sqrt(*a.grad_sq)) * inv_scale;
    grad_mul = lamb_grad_multiplier(inv_scale, norm, a.max_grad_norm);
  }
  const BiasCorrection bc = bias_correction(a.beta1, a.beta2, step, a.bias_correction);
  const LambTensor numbers = lamb_tensor(lr_of(a.s), bc, a.colossal);
  return {lamb_rule<M>(a, grad_mul, numbers), numbers.lr};
}

// The storage of LAMB's moments m (signed) and v (U: UpdateTypes).
template <typename U>
using LambM = moment_t<typename U::state_t, true>;
template <typename U>
using LambV = moment_t<typename U::state_t, false>;

// Without the trust ratio, one pass. Lists: params, exp_avgs, exp_avg_sqs (mutable), grads; the
// model params with master weights (U: UpdateTypes); steps; the absmaxes of 8-bit moments.
template <typename U>
struct LambOnePass {
  using Types = ListTypes<typename U::value_t, LambM<U>, LambV<U>, typename U::grad_t>;
  static constexpr int kSteps = 4 + U::kModelLists;
  static constexpr int kDepth = kSteps + 1 + Types::kQ8Lists;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const LambArgs& a) {
    using M = typename Types::opmath;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const TensorLamb<M> lamb = tensor_lamb<M>(meta, chunk, kSteps, a);
    const M neg_lr = static_cast<M>(-lamb.lr);
    for_each_element<Types, 3, typename U::model_t>(meta, chunk, [&](M(&x)[4]) {
      lamb.rule.moments(x[0], x[3], x[1], x[2]);
      LambRule<M>::apply(x[0], neg_lr, lamb.rule.direction(x[0], x[1], x[2]));
    }, coding_of(a.s), a.s.grad_scale);
  }
};

// The two-pass launches' arguments: the per-tensor sums are a.sums (phase 2 reads sums.out).
struct LambSumsArgs {
  LambArgs lamb;
  ChunkSums sums;
};

// Phase 1. Lists: exp_avgs, exp_avg_sqs (mutable when kStore), params, grads; steps; the absmaxes
// of 8-bit moments. Partials of ||p||², ||u||². Without kStore (the sums-only call) the new moments
// stay in registers: the same elements in the same order, so the same partials, and nothing stored.
template <typename U, bool kStore = true>
struct LambMoments {
  using Types = ListTypes<LambM<U>, LambV<U>, typename U::value_t, typename U::grad_t>;
  static constexpr int kDepth = 5 + Types::kQ8Lists;
  using Args = LambSumsArgs;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const Args& a) {
    using M = typename Types::opmath;
    if (skip_step(a.lamb.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const LambRule<M> rule = tensor_lamb<M>(meta, chunk, 4, a.lamb).rule;
    M acc[2] = {};
    for_each_element<Types, kStore ? 2 : 0>(meta, chunk, [&](M(&x)[4]) {
      rule.moments(x[2], x[3], x[0], x[1]);
      const M u = rule.direction(x[2], x[0], x[1]);
      acc[0] = fma(x[2], x[2], acc[0]);
      acc[1] = fma(u, u, acc[1]);
    }, coding_of(a.lamb.s, 1), kStore ? a.lamb.s.grad_scale : nullptr);  // m and v: the random streams 1 and 2
    store_chunk_sums<2>(acc, chunk, a.sums);
  }
};

// Phase 2. Lists: params (mutable), exp_avgs, exp_avg_sqs (read as stored); the model params with
// master weights; steps; the absmaxes of 8-bit moments. Reads the per-tensor sums.
template <typename U>
struct LambTrustedUpdate {
  using Types = ListTypes<typename U::value_t, LambM<U>, LambV<U>>;
  using Args = LambSumsArgs;
  static constexpr int kSteps = 3 + U::kModelLists;
  static constexpr int kDepth = kSteps + 1 + Types::kQ8Lists;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const Args& a) {
    using M = typename Types::opmath;
    if (skip_step(a.lamb.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const TensorLamb<M> lamb = tensor_lamb<M>(meta, chunk, kSteps, a.lamb);
    const double r = lamb_trust_ratio(sqrt(a.sums.out[2 * chunk.tensor]), sqrt(a.sums.out[2 * chunk.tensor + 1]),
                                      a.lamb.trust_clip);
    const M neg_lr = static_cast<M>(-lamb.lr * r);
    for_each_element<Types, 1, typename U::model_t>(meta, chunk, [&](M(&x)[3]) {
      LambRule<M>::apply(x[0], neg_lr, lamb.rule.direction(x[0], x[1], x[2]));
    }, coding_of(a.lamb.s));
  }
};

}  // namespace

void lamb_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                 void* const* exp_avgs, void* const* exp_avg_sqs, void* const* model, float* const* steps,
                 void* const* absmaxes, const int64_t* sizes, const LambArgs& args, const ChunkSums& sums,
                 const NormSums& phase, cudaStream_t stream) {
  void* const* step_list = reinterpret_cast<void* const*>(steps);
  void* const* m_absmax = absmax_list(absmaxes, n, 0);
  void* const* v_absmax = absmax_list(absmaxes, n, 1);
  dispatch_any_update(dtypes, [&](auto types) {
    using U = decltype(types);
    if (!args.trust_ratio && !phase.sums_only) {
      const auto lists = concat_lists(n, {params, exp_avgs, exp_avg_sqs, grads, model, step_list, m_absmax, v_absmax});
      multi_tensor_apply<LambOnePass<U>::kDepth, LambOnePass<U>>(n, lists.data(), sizes, args, stream);
      return;
    }
    const auto phase1 = concat_lists(n, {exp_avgs, exp_avg_sqs, params, grads, step_list, m_absmax, v_absmax});
    if (phase.sums_only) {  // phase 1's sums, into the rows
      const LambSumsArgs both{args, sums};
      multi_tensor_apply<LambMoments<U, false>::kDepth, LambMoments<U, false>>(n, phase1.data(), sizes, both, stream);
      sum_chunks_launch(2, n, {sums.partials, sums.max_chunks, phase.rows}, stream, args.s.found_inf);
      return;
    }
    // Phase 2 reads the per-tensor totals from the given rows, or from phase 1's sums.
    const LambSumsArgs both{args, {sums.partials, sums.max_chunks, phase.rows != nullptr ? phase.rows : sums.out}};
    multi_tensor_apply<LambMoments<U>::kDepth, LambMoments<U>>(n, phase1.data(), sizes, both, stream);
    if (phase.rows == nullptr) sum_chunks_launch(2, n, sums, stream);
    const auto phase2 = concat_lists(n, {params, exp_avgs, exp_avg_sqs, model, step_list, m_absmax, v_absmax});
    multi_tensor_apply<LambTrustedUpdate<U>::kDepth, LambTrustedUpdate<U>>(n, phase2.data(), sizes, both, stream);
  });
  if (!phase.sums_only) increment_steps_launch(n, steps, args.s, stream);
}

}  // namespace cuda
}  // namespace fused_optim
