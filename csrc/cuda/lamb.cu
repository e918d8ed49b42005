// LAMB on CUDA (the CPU twin: csrc/cpu/lamb.cpp): lamb_ and colossal_lamb_. Per element, in
// opmath, with per-tensor step s = steps[t] + 1 read by each block:
//   g^ <- g / (grad_scale*clip)  clip = G/max_grad_norm if G > max_grad_norm > 0, else 1, with G
//                               grad_norm/grad_scale or sqrt(grad_sq)/grad_scale (launch.h)
//   g^ <- g^ + wd*p              (L2 mode)
//   m <- beta1*m + beta3*g^ ; v <- beta2*v + (1-beta2)*g^^2
//   u <- (m*c1) / (sqrt(v)*c2 + eps) (+ wd*p in decoupled mode)
//   r <- ||p||/||u|| (1 if a norm is 0; min(r, 1) with trust_clip) when the trust ratio is on
//   p <- p - lr_t*r*u
//   lamb_:          c1 = 1/bc1, c2 = 1/sqrt(bc2), lr_t = lr          (bc_i = 1 - beta_i^s, or 1)
//   colossal_lamb_: c1 = c2 = 1, lr_t = lr*sqrt(bc2)/bc1
// With the trust ratio, phase 1 updates m and v and writes the chunk partials of ||p||^2 and
// ||u||^2, sum_chunks adds them per tensor (fixed order), and phase 2 recomputes u from the stored
// m, v and the untouched p and updates p: no scratch the size of the params, grads untouched.
// Then the step counters are incremented; everything is skipped when found_inf is set.
#include "launch.h"
#include "reduce.cuh"

namespace fused_optim {
namespace cuda {
namespace {

// The numbers of one tensor, in opmath.
template <typename M>
struct LambMath {
  M grad_mul, wd, b1, b3, b2, one_minus_b2, eps, c1, c2, lr;
  bool has_wd, decoupled;

  __device__ void moments(M p, M g, M& m, M& v) const {
    M gh = g * grad_mul;
    if (has_wd && !decoupled) gh = fma(wd, p, gh);
    m = fma(b1, m, b3 * gh);
    v = fma(b2, v, one_minus_b2 * gh * gh);
  }

  __device__ M update(M p, M m, M v) const {
    M u = (m * c1) / fma(sqrt(v), c2, eps);
    if (has_wd && decoupled) u = fma(wd, p, u);
    return u;
  }
};

// The math of the block's tensor; the step counter is the metadata's list `steps_list`.
template <typename M, int Depth>
__device__ LambMath<M> lamb_math(const TensorListMetadata<Depth>& meta, const Chunk& chunk, int steps_list,
                                 const LambArgs& a) {
  const double step = static_cast<double>(*static_cast<const float*>(meta.addresses[steps_list][chunk.slot])) + 1.0;
  const double bc1 = a.bias_correction ? 1.0 - pow(static_cast<double>(a.beta1), step) : 1.0;
  const double bc2 = a.bias_correction ? 1.0 - pow(static_cast<double>(a.beta2), step) : 1.0;
  const double inv_scale = inv_scale_of(a.s), lr = lr_of(a.s);
  double grad_mul = inv_scale;
  if (a.max_grad_norm > 0.f) {
    const double norm = (a.grad_norm != nullptr ? *a.grad_norm : sqrt(*a.grad_sq)) * inv_scale;
    if (norm > a.max_grad_norm) grad_mul = inv_scale * a.max_grad_norm / norm;
  }
  const double c1 = a.colossal ? 1.0 : 1.0 / bc1, c2 = a.colossal ? 1.0 : 1.0 / sqrt(bc2);
  const double lr_t = a.colossal ? lr * sqrt(bc2) / bc1 : lr;
  return {static_cast<M>(grad_mul),
          static_cast<M>(a.weight_decay),
          static_cast<M>(a.beta1),
          static_cast<M>(a.beta3),
          static_cast<M>(a.beta2),
          static_cast<M>(1.0 - a.beta2),
          static_cast<M>(a.eps),
          static_cast<M>(c1),
          static_cast<M>(c2),
          static_cast<M>(lr_t),
          a.weight_decay != 0.0,
          a.decoupled};
}

// Without the trust ratio, one pass. Lists: params, exp_avgs, exp_avg_sqs (mutable), grads; steps.
template <typename T>
struct LambOnePass {
  __device__ static void apply(const TensorListMetadata<5>& meta, const LambArgs& a) {
    using M = opmath_t<T>;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const LambMath<M> math = lamb_math<M>(meta, chunk, 4, a);
    for_each_element<T, 4, 3>(meta, chunk, [&](M(&x)[4]) {
      math.moments(x[0], x[3], x[1], x[2]);
      x[0] = fma(-math.lr, math.update(x[0], x[1], x[2]), x[0]);
    });
  }
};

// Phase 1. Lists: exp_avgs, exp_avg_sqs (mutable), params, grads; steps. Partials of ||p||², ||u||².
template <typename T>
struct LambMoments {
  struct Args {
    LambArgs lamb;
    ChunkSums sums;
  };

  __device__ static void apply(const TensorListMetadata<5>& meta, const Args& a) {
    using M = opmath_t<T>;
    if (skip_step(a.lamb.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const LambMath<M> math = lamb_math<M>(meta, chunk, 4, a.lamb);
    M acc[2] = {};
    for_each_element<T, 4, 2>(meta, chunk, [&](M(&x)[4]) {
      math.moments(x[2], x[3], x[0], x[1]);
      const M u = math.update(x[2], x[0], x[1]);
      acc[0] = fma(x[2], x[2], acc[0]);
      acc[1] = fma(u, u, acc[1]);
    });
    store_chunk_sums<2>(acc, chunk, a.sums);
  }
};

// Phase 2. Lists: params (mutable), exp_avgs, exp_avg_sqs; steps. Reads the per-tensor sums.
template <typename T>
struct LambTrustedUpdate {
  using Args = typename LambMoments<T>::Args;

  __device__ static void apply(const TensorListMetadata<4>& meta, const Args& a) {
    using M = opmath_t<T>;
    if (skip_step(a.lamb.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const LambMath<M> math = lamb_math<M>(meta, chunk, 3, a.lamb);
    const double pn = sqrt(a.sums.out[2 * chunk.tensor]), un = sqrt(a.sums.out[2 * chunk.tensor + 1]);
    double r = pn > 0.0 && un > 0.0 ? pn / un : 1.0;
    if (a.lamb.trust_clip) r = fmin(r, 1.0);
    const M neg_lr = -static_cast<double>(math.lr) * r;
    for_each_element<T, 3, 1>(meta, chunk, [&](M(&x)[3]) { x[0] = fma(neg_lr, math.update(x[0], x[1], x[2]), x[0]); });
  }
};

}  // namespace

void lamb_launch(DType dtype, int64_t n, void* const* params, void* const* grads, void* const* exp_avgs,
                 void* const* exp_avg_sqs, float* const* steps, const int64_t* sizes, const LambArgs& args,
                 const ChunkSums& sums, cudaStream_t stream) {
  void* const* step_list = reinterpret_cast<void* const*>(steps);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (!args.trust_ratio) {
      const auto lists = concat_lists(n, {params, exp_avgs, exp_avg_sqs, grads, step_list});
      multi_tensor_apply<5, LambOnePass<T>>(n, lists.data(), sizes, args, stream);
      return;
    }
    const typename LambMoments<T>::Args both{args, sums};
    const auto phase1 = concat_lists(n, {exp_avgs, exp_avg_sqs, params, grads, step_list});
    multi_tensor_apply<5, LambMoments<T>>(n, phase1.data(), sizes, both, stream);
    sum_chunks_launch(2, n, sums, stream);
    const auto phase2 = concat_lists(n, {params, exp_avgs, exp_avg_sqs, step_list});
    multi_tensor_apply<4, LambTrustedUpdate<T>>(n, phase2.data(), sizes, both, stream);
  });
  increment_steps_launch(n, steps, args.s, stream);
}

}  // namespace cuda
}  // namespace fused_optim
