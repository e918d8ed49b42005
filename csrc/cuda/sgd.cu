// The SGD family on CUDA: sgd_, sign_sgd_, lars_, colossal_lars_ (the CPU twin:
// csrc/cpu/sgd_family.h). The per-element rule is csrc/shared/sgd_math.h, with per-tensor numbers
// grad_mul = ±1/grad_scale (− when maximize), wd = weight_decay and lr, except with trust ratios
// (csrc/shared/trust_ratio.h), computed by each block from its tensor's sums of squares (||p||,
// ||g|| = sqrt(Σg²)/grad_scale). found_inf is checked first by every block. With master weights
// one pass reads the fp16/bf16 grads, updates the fp32 masters and momentum buffers and writes
// the rounded params; ||p|| is then the masters' norm. The compact twins: the same functor on
// compact momentum buffers or stochastically rounded bf16 params (compact_state.cuh).
#include <type_traits>

#include "launch.h"
#include "multi_tensor_apply.cuh"
#include "../shared/sgd_math.h"
#include "../shared/trust_ratio.h"

namespace fused_optim {
namespace cuda {
namespace {

__device__ __forceinline__ SgdTensor tensor_numbers(const SgdArgs& a, int32_t t) {
  const double inv_scale = inv_scale_of(a.s), lr = lr_of(a.s);
  SgdTensor n{a.maximize ? -inv_scale : inv_scale, a.weight_decay, lr};
  if (a.trust == TrustRatio::kNone) return n;
  const double pn = sqrt(a.sq_norms[2 * t]), gn = sqrt(a.sq_norms[2 * t + 1]) * inv_scale;
  if (a.trust == TrustRatio::kLars) {
    const LarsTensor lars =
        lars_tensor(pn, gn, n.grad_mul, lr, a.trust_coefficient, a.weight_decay, a.eps, a.trust_clip);
    n.grad_mul = lars.grad_mul;
    n.weight_decay = lars.weight_decay;
  } else {
    n.lr = colossal_lars_lr(pn, gn, lr, a.trust_coefficient, a.weight_decay, a.eps);
  }
  return n;
}

// Lists: params (mutable), momentum buffers (mutable, with momentum), grads; the model params
// with master weights (U: UpdateTypes); the buffers' absmaxes with 8-bit buffers.
template <typename U, SgdDirection D, bool kMomentum>
struct SgdFunctor {
  using V = typename U::value_t;
  using Types = std::conditional_t<kMomentum, ListTypes<V, moment_t<typename U::state_t, true>, typename U::grad_t>,
                                   ListTypes<V, typename U::grad_t>>;
  static constexpr int kLists = Types::size;
  static constexpr int kMutable = kMomentum ? 2 : 1;
  static constexpr int kDepth = kLists + U::kModelLists + Types::kQ8Lists;

  __device__ static void apply(const TensorListMetadata<kDepth>& meta, const SgdArgs& a) {
    using M = typename Types::opmath;
    if (skip_step(a.s)) return;
    const Chunk chunk = chunk_of_block(meta);
    const auto rule = sgd_rule<M, D>(tensor_numbers(a, chunk.tensor), a.momentum, a.dampening, a.clamp, a.nesterov,
                                     a.wd_after_momentum, a.first_step);
    for_each_element<Types, kMutable, typename U::model_t>(meta, chunk, [&](M(&x)[kLists]) {
      if constexpr (kMomentum) {
        rule.apply(x[0], x[kLists - 1], x[1]);
      } else {
        rule.apply(x[0], x[kLists - 1]);
      }
    }, coding_of(a.s), a.s.grad_scale);
  }
};

template <typename U, SgdDirection D>
void sgd_typed(int64_t n, void* const* params, void* const* grads, void* const* bufs, void* const* model,
               void* const* absmaxes, const int64_t* sizes, const int32_t* index, const SgdArgs& args,
               cudaStream_t stream) {
  if (bufs != nullptr) {
    using F = SgdFunctor<U, D, true>;
    const auto lists = concat_lists(n, {params, bufs, grads, model, absmaxes});
    multi_tensor_apply<F::kDepth, F>(n, lists.data(), sizes, args, stream, index);
  } else {
    using F = SgdFunctor<U, D, false>;
    const auto lists = concat_lists(n, {params, grads, model});
    multi_tensor_apply<F::kDepth, F>(n, lists.data(), sizes, args, stream, index);
  }
}

}  // namespace

void sgd_launch(const UpdateDTypes& dtypes, SgdDirection direction, int64_t n, void* const* params,
                void* const* grads, void* const* bufs, void* const* model, void* const* absmaxes,
                const int64_t* sizes, const int32_t* index, const SgdArgs& args, cudaStream_t stream) {
  dispatch_any_update(dtypes, [&](auto types) {
    using U = decltype(types);
    switch (direction) {
      case SgdDirection::kPlain:
        return sgd_typed<U, SgdDirection::kPlain>(n, params, grads, bufs, model, absmaxes, sizes, index, args, stream);
      case SgdDirection::kSign:
        return sgd_typed<U, SgdDirection::kSign>(n, params, grads, bufs, model, absmaxes, sizes, index, args, stream);
      case SgdDirection::kClamp:
        return sgd_typed<U, SgdDirection::kClamp>(n, params, grads, bufs, model, absmaxes, sizes, index, args, stream);
    }
  });
}

}  // namespace cuda
}  // namespace fused_optim
