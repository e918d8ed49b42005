// The SGD family on CUDA: sgd_ and sign_sgd_ (the CPU twin: csrc/cpu/sgd.cpp). Per element, in
// opmath, with s the grad scale (1 without one) and found_inf checked first by every block:
//   d <- ±g/s (− when maximize) ; d <- d + wd*p (unless wd_after_momentum)
//   buf <- d (first step) | momentum*buf + (1-dampening)*d ; d <- d + momentum*buf (nesterov) | buf
//   d <- d + wd*p (wd_after_momentum) ; p <- p - lr*(d | sign(d))
#include "launch.h"
#include "multi_tensor_apply.cuh"

#include <vector>

namespace fused_optim {
namespace cuda {
namespace {

template <typename M, SgdDirection D>
__device__ __forceinline__ M direction_of(M d) {
  if constexpr (D == SgdDirection::kSign) {
    return d > M(0) ? M(1) : d < M(0) ? M(-1) : d;  // 0 and NaN stay, as torch.sign
  } else {
    return d;
  }
}

// Lists: params (mutable), momentum buffers (mutable, with momentum), grads.
template <typename T, SgdDirection D, bool kMomentum>
struct SgdFunctor {
  static constexpr int kDepth = kMomentum ? 3 : 2;
  static constexpr int kMutable = kMomentum ? 2 : 1;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const SgdArgs& a) {
    using M = opmath_t<T>;
    if (a.found_inf != nullptr && *a.found_inf != 0.f) return;
    const M inv_scale = a.grad_scale != nullptr ? M(1) / static_cast<M>(*a.grad_scale) : M(1);
    const M grad_mul = a.maximize ? -inv_scale : inv_scale;
    const M neg_lr = -static_cast<M>(*a.lr);
    const M wd = a.weight_decay, momentum = a.momentum, one_minus_damp = M(1) - static_cast<M>(a.dampening);
    const bool wd_before = a.weight_decay != 0.f && !a.wd_after_momentum;
    const bool wd_after = a.weight_decay != 0.f && a.wd_after_momentum;
    const Chunk chunk = chunk_of_block(meta);
    for_each_element<T, kDepth, kMutable>(meta, chunk, [&](M (&x)[kDepth]) {
      M& p = x[0];
      M d = x[kDepth - 1] * grad_mul;
      if (wd_before) d = fma(wd, p, d);
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
               const SgdArgs& args, cudaStream_t stream) {
  if (bufs != nullptr) {
    std::vector<void*> lists(params, params + n);
    lists.insert(lists.end(), bufs, bufs + n);
    lists.insert(lists.end(), grads, grads + n);
    multi_tensor_apply<3, SgdFunctor<T, D, true>>(n, lists.data(), sizes, args, stream);
  } else {
    std::vector<void*> lists(params, params + n);
    lists.insert(lists.end(), grads, grads + n);
    multi_tensor_apply<2, SgdFunctor<T, D, false>>(n, lists.data(), sizes, args, stream);
  }
}

template <SgdDirection D>
void sgd_dispatch(DType dtype, int64_t n, void* const* params, void* const* grads, void* const* bufs,
                  const int64_t* sizes, const SgdArgs& args, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat: return sgd_typed<float, D>(n, params, grads, bufs, sizes, args, stream);
    case DType::kDouble: return sgd_typed<double, D>(n, params, grads, bufs, sizes, args, stream);
    case DType::kHalf: return sgd_typed<__half, D>(n, params, grads, bufs, sizes, args, stream);
    case DType::kBFloat16: return sgd_typed<__nv_bfloat16, D>(n, params, grads, bufs, sizes, args, stream);
  }
}

}  // namespace

void sgd_launch(DType dtype, SgdDirection direction, int64_t n, void* const* params, void* const* grads,
                void* const* bufs, const int64_t* sizes, const SgdArgs& args, cudaStream_t stream) {
  if (direction == SgdDirection::kSign) {
    sgd_dispatch<SgdDirection::kSign>(dtype, n, params, grads, bufs, sizes, args, stream);
  } else {
    sgd_dispatch<SgdDirection::kPlain>(dtype, n, params, grads, bufs, sizes, args, stream);
  }
}

}  // namespace cuda
}  // namespace fused_optim
