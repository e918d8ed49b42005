// fused_optim::adam_ on CUDA (the CPU twin: csrc/cpu/adam.cpp): torch.optim.Adam / AdamW. Per
// element, in opmath, with per-tensor step s = steps[t] + 1 read by each block:
//   g <- ±g / grad_scale ; p <- p*(1 - lr*wd) (decoupled) | g <- g + wd*p (L2)
//   m <- m + (1-beta1)*(g - m) ; v <- beta2*v + (1-beta2)*g*g ; vmax <- max(vmax, v) (amsgrad)
//   p <- p - (lr/bc1) * m / (sqrt(v or vmax)/sqrt(bc2) + eps),  bc_i = 1 - beta_i^s (or 1)
// then steps[t] <- s (increment_steps_launch), all skipped when found_inf is set.
#include "launch.h"
#include "multi_tensor_apply.cuh"

namespace fused_optim {
namespace cuda {
namespace {

// Lists: params, exp_avgs, exp_avg_sqs, [max_exp_avg_sqs] (mutable), grads; then the step counters.
template <typename T, bool kAmsgrad>
struct AdamFunctor {
  static constexpr int kLists = kAmsgrad ? 5 : 4;

  __device__ static void apply(const TensorListMetadata<kLists + 1>& meta, const AdamArgs& a) {
    using M = opmath_t<T>;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const double step = static_cast<double>(*static_cast<const float*>(meta.addresses[kLists][chunk.slot])) + 1.0;
    const double lr = lr_of(a.s);
    const double bc1 = a.bias_correction ? 1.0 - pow(static_cast<double>(a.beta1), step) : 1.0;
    const double bc2 = a.bias_correction ? 1.0 - pow(static_cast<double>(a.beta2), step) : 1.0;
    const float inv_scale = inv_scale_of(a.s);
    const M grad_mul = a.maximize ? -inv_scale : inv_scale, wd = a.weight_decay;
    const M decay_mul = 1.0 - lr * a.weight_decay, neg_step_size = -lr / bc1, inv_bc2_sqrt = 1.0 / sqrt(bc2);
    const M one_minus_b1 = 1.0 - a.beta1, b2 = a.beta2, one_minus_b2 = 1.0 - a.beta2, eps = a.eps;
    const bool has_wd = a.weight_decay != 0.f;
    for_each_element<T, kLists, kLists - 1>(meta, chunk, [&](M(&x)[kLists]) {
      M &p = x[0], &m = x[1], &v = x[2];
      M g = x[kLists - 1] * grad_mul;
      if (has_wd) {
        if (a.decoupled) {
          p = p * decay_mul;
        } else {
          g = fma(wd, p, g);
        }
      }
      m = fma(one_minus_b1, g - m, m);
      v = fma(b2, v, one_minus_b2 * g * g);
      M used = v;
      if constexpr (kAmsgrad) {
        x[3] = fmax(x[3], v);
        used = x[3];
      }
      p = fma(neg_step_size, m / fma(sqrt(used), inv_bc2_sqrt, eps), p);
    });
  }
};

}  // namespace

void adam_launch(DType dtype, int64_t n, void* const* params, void* const* grads, void* const* exp_avgs,
                 void* const* exp_avg_sqs, void* const* max_exp_avg_sqs, float* const* steps, const int64_t* sizes,
                 const AdamArgs& args, cudaStream_t stream) {
  void* const* step_list = reinterpret_cast<void* const*>(steps);
  const auto lists = max_exp_avg_sqs != nullptr
                         ? concat_lists(n, {params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, grads, step_list})
                         : concat_lists(n, {params, exp_avgs, exp_avg_sqs, grads, step_list});
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (max_exp_avg_sqs != nullptr) {
      multi_tensor_apply<6, AdamFunctor<T, true>>(n, lists.data(), sizes, args, stream);
    } else {
      multi_tensor_apply<5, AdamFunctor<T, false>>(n, lists.data(), sizes, args, stream);
    }
  });
  increment_steps_launch(n, steps, args.s, stream);
}

}  // namespace cuda
}  // namespace fused_optim
