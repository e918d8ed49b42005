// The SGD family on CUDA: sgd_, sign_sgd_, lars_, colossal_lars_ (the CPU twin:
// csrc/cpu/sgd_family.h). Per element, in opmath, with per-tensor numbers grad_mul, wd, lr:
//   d <- grad_mul*g ; d <- d + wd*p (unless wd_after_momentum) ; d <- clamp(d, -c, c) (kClamp)
//   buf <- d (first step) | momentum*buf + (1-dampening)*d ; d <- d + momentum*buf (nesterov) | buf
//   d <- d + wd*p (wd_after_momentum) ; p <- p - lr*(sign(d) (kSign) | d)
// grad_mul = ±1/grad_scale (− when maximize), wd = weight_decay and lr, except with trust ratios,
// computed by each block from its tensor's sums of squares (||p||, ||g|| = sqrt(Σg²)/grad_scale):
//   kLars:     if ||p|| > 0 and ||g|| > 0: r = tc*||p||/(||g|| + weight_decay*||p|| + eps)
//              (trust_clip: min(r/lr, 1)), grad_mul *= r, wd = weight_decay*r; else wd = 0
//   kColossal: r = eeta*||p||/(||g|| + weight_decay*||p|| + eps) (1 if a norm is 0), lr *= clamp(r, 0, 50)
// found_inf is checked first by every block.
#include "launch.h"
#include "multi_tensor_apply.cuh"


namespace fused_optim {
namespace cuda {
namespace {

constexpr double kMaxColossalTrust = 50.0;

template <typename M, SgdDirection D>
__device__ __forceinline__ M direction_of(M d) {
  if constexpr (D == SgdDirection::kSign) {
    return d > M(0) ? M(1) : d < M(0) ? M(-1) : M(0);  // 0 for 0 and NaN, as torch.sign
  } else {
    return d;
  }
}

struct TensorNumbers {
  double grad_mul, wd, lr;
};

__device__ __forceinline__ TensorNumbers tensor_numbers(const SgdArgs& a, int32_t t) {
  const double inv_scale = inv_scale_of(a.s), lr = lr_of(a.s);
  TensorNumbers n{a.maximize ? -inv_scale : inv_scale, a.weight_decay, lr};
  if (a.trust == TrustRatio::kNone) return n;
  const double pn = sqrt(a.sq_norms[2 * t]), gn = sqrt(a.sq_norms[2 * t + 1]) * inv_scale;
  const bool adapt = pn > 0.0 && gn > 0.0;
  const double r = adapt ? a.trust_coefficient * pn / (gn + a.weight_decay * pn + a.eps) : 1.0;
  if (a.trust == TrustRatio::kLars) {
    const double ratio = a.trust_clip ? fmin(r / lr, 1.0) : r;
    n.grad_mul = adapt ? n.grad_mul * ratio : n.grad_mul;
    n.wd = adapt ? a.weight_decay * ratio : 0.0;
  } else {
    n.lr = lr * fmin(fmax(r, 0.0), kMaxColossalTrust);
  }
  return n;
}

// Lists: params (mutable), momentum buffers (mutable, with momentum), grads.
template <typename T, SgdDirection D, bool kMomentum>
struct SgdFunctor {
  static constexpr int kDepth = kMomentum ? 3 : 2;
  static constexpr int kMutable = kMomentum ? 2 : 1;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const SgdArgs& a) {
    using M = opmath_t<T>;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const TensorNumbers n = tensor_numbers(a, chunk.tensor);
    const M grad_mul = n.grad_mul, wd = n.wd, neg_lr = -n.lr, bound = a.clamp;
    const M momentum = a.momentum, one_minus_damp = M(1) - static_cast<M>(a.dampening);
    const bool wd_before = n.wd != 0.0 && !a.wd_after_momentum;
    const bool wd_after = n.wd != 0.0 && a.wd_after_momentum;
    for_each_element<T, kDepth, kMutable>(meta, chunk, [&](M (&x)[kDepth]) {
      M& p = x[0];
      M d = x[kDepth - 1] * grad_mul;
      if (wd_before) d = fma(wd, p, d);
      if constexpr (D == SgdDirection::kClamp) d = fmin(fmax(d, -bound), bound);
      if constexpr (kMomentum) {
        M& buf = x[1];
        buf = a.first_step ? d : fma(momentum, buf, one_minus_damp * d);
        d = a.nesterov ? fma(momentum, buf, d) : buf;
      }
      if (wd_after) d = fma(wd, p, d);
      p = fma(neg_lr, direction_of<M, D>(d), p);
    });
  }
};

template <typename T, SgdDirection D>
void sgd_typed(int64_t n, void* const* params, void* const* grads, void* const* bufs, const int64_t* sizes,
               const int32_t* index, const SgdArgs& args, cudaStream_t stream) {
  if (bufs != nullptr) {
    const auto lists = concat_lists(n, {params, bufs, grads});
    multi_tensor_apply<3, SgdFunctor<T, D, true>>(n, lists.data(), sizes, args, stream, index);
  } else {
    const auto lists = concat_lists(n, {params, grads});
    multi_tensor_apply<2, SgdFunctor<T, D, false>>(n, lists.data(), sizes, args, stream, index);
  }
}

}  // namespace

void sgd_launch(DType dtype, SgdDirection direction, int64_t n, void* const* params, void* const* grads,
                void* const* bufs, const int64_t* sizes, const int32_t* index, const SgdArgs& args,
                cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (direction) {
      case SgdDirection::kPlain:
        return sgd_typed<T, SgdDirection::kPlain>(n, params, grads, bufs, sizes, index, args, stream);
      case SgdDirection::kSign:
        return sgd_typed<T, SgdDirection::kSign>(n, params, grads, bufs, sizes, index, args, stream);
      case SgdDirection::kClamp:
        return sgd_typed<T, SgdDirection::kClamp>(n, params, grads, bufs, sizes, index, args, stream);
    }
  });
}

}  // namespace cuda
}  // namespace fused_optim
