// fused_optim::lion_ on the CPU: Lion over a whole bucket in one parallel region. The math:
// csrc/shared/lion_math.h (per element, shared with the CUDA kernel); fused_optim/lion.py
// documents the class. lion_compact_ is the same update on compact state (compact_state.h).
#include "simd_blocks.h"  // before the shared rule (lion_math.h)
#include "compact_state.h"
#include "master_weights.h"
#include "multi_tensor.h"
#include "op_args.h"
#include "ops.h"
#include "../shared/lion_math.h"

namespace fused_optim {
namespace {

// lion_ and its compact twin (compact_state.h): absmaxes and keys empty for lion_.
void lion_impl(at::TensorList model, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList masters,
               at::TensorList absmaxes, at::TensorList keys, double lr, double beta1, double beta2,
               double weight_decay, bool stochastic_state, bool stochastic_params, c10::IntArrayRef element_offsets,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  const UpdatedParams params = checked_params("lion_", model, masters);
  const auto grads = checked_grads("lion_", params.model, grads_in, amp.unscale_grads);
  const CompactArgs c =
      compact_args("lion_", params, exp_avgs, absmaxes, keys, stochastic_state, stochastic_params, element_offsets);
  check_state_list("lion_", "exp_avgs", params, exp_avgs, c, 0);

  std::vector<int64_t> numels(model.size());
  for (size_t i = 0; i < model.size(); ++i) numels[i] = model[i].numel();
  dispatch_update(params, [&](auto types) {
    using T = typename decltype(types)::grad_t;
    using S = typename decltype(types)::state_t;
    const auto rule = lion_rule<FVec<T>>(lr, beta1, beta2, weight_decay, amp.inv_scale);
    dispatch_format<T>(c, [&](auto format) {
      constexpr StateFormat F = decltype(format)::value;
      multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
        const auto g = grad_stream<T>(grads, t, amp);
        with_param_stream<T, S>(params, c, t, [&](auto p) {
          for_each_chunk<T>(
              begin, end, [&](auto& pv, auto& gv, auto& mv) { rule.apply(pv, gv, mv); }, p, g,
              state_stream<F, S>(c, exp_avgs, t, 0, 0, true));
        });
      });
    });
  });
  advance_keys(c);
  finish_grads(grads, amp);
}

}  // namespace

void lion_cpu(at::TensorList model, at::TensorList grads, at::TensorList exp_avgs, at::TensorList masters, double lr,
              double beta1, double beta2, double weight_decay, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  lion_impl(model, grads, exp_avgs, masters, {}, {}, lr, beta1, beta2, weight_decay, false, false, {}, lr_tensor,
            grad_scale, found_inf);
}

void lion_compact_cpu(at::TensorList model, at::TensorList grads, at::TensorList exp_avgs, at::TensorList masters,
                      at::TensorList absmaxes, at::TensorList keys, double lr, double beta1, double beta2,
                      double weight_decay, bool stochastic_state, bool stochastic_params,
                      c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  lion_impl(model, grads, exp_avgs, masters, absmaxes, keys, lr, beta1, beta2, weight_decay, stochastic_state,
            stochastic_params, element_offsets, lr_tensor, grad_scale, found_inf);
}

}  // namespace fused_optim
