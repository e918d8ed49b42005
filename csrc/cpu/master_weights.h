// Master weights in the CPU kernels (UpdatedParams: csrc/host/checks.h). An update over fp16 or
// bf16 params with fp32 masters reads the half grads, updates the fp32 masters and the fp32 state
// in opmath, and writes each param as its master rounded to nearest even: one pass, no fp32 grad
// copy. Kernels are instantiated for (T, S): T the dtype of the params and grads, which leads the
// SIMD blocks (simd_blocks.h), and S that of the values updated and of the state: T, or float
// with masters.
#pragma once

#include "simd_blocks.h"
#include "../host/checks.h"

#include <type_traits>

namespace fused_optim {

template <typename T, typename S>
struct UpdateTypes {
  using grad_t = T;
  using state_t = S;
};

// f(UpdateTypes<T, S>{}) for the params' dtype T and, with masters, S = float (else S = T).
template <typename F>
void dispatch_update(const UpdatedParams& params, const F& f) {
  FUSED_OPTIM_DISPATCH_FLOATING(params.model[0].scalar_type(), "fused_optim update", [&] {
    if constexpr (kHalves<scalar_t> == 2) {
      if (!params.masters.empty()) return f(UpdateTypes<scalar_t, float>{});
    }
    return f(UpdateTypes<scalar_t, scalar_t>{});
  });
}

// The stream of param t that an update reads and writes: the param's data, or its master's
// (MasterStream, which also writes the rounded param).
template <typename T, typename S>
auto param_stream(const UpdatedParams& params, int64_t t) {
  if constexpr (std::is_same_v<T, S>) {
    return ptr<T>(params.model[t]);
  } else {
    return MasterStream<T>{ptr<float>(params.masters[t]), ptr<T>(params.model[t])};
  }
}

}  // namespace fused_optim
