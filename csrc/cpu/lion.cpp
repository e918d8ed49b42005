// fused_optim::lion_ on the CPU: Lion over a whole bucket in one parallel region. The math:
// csrc/shared/lion_math.h (per element, shared with the CUDA kernel); fused_optim/lion.py
// documents the class. lion_compact_ is the same update on compact state (compact_state.h).
#include "multi_tensor.h"  // before the shared rule (lion_math.h)
#include "compact_state.h"  // the compact twin
#include "update_args.h"
#include "bucket.h"
#include "ops.h"
#include "../shared/lion_math.h"

namespace fused_optim {
namespace {

// lion_ (inputs: PlainState, update_args.h) and its compact twin (CompactInputs, compact_args.h).
template <typename Inputs>
void lion_impl(at::TensorList model, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList masters,
               double lr, double beta1, double beta2, double weight_decay, const Inputs& inputs,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  const UpdatedParams params = checked_params("lion_", model, masters);
  const auto grads = checked_grads("lion_", params.model, grads_in, amp.unscale_grads);
  const auto c = state_args("lion_", params, exp_avgs, inputs);
  check_state_list("lion_", "exp_avgs", params, exp_avgs, c, 0);

  std::vector<int64_t> numels(model.size());
  for (size_t i = 0; i < model.size(); ++i) numels[i] = model[i].numel();
  dispatch_update(params, [&](auto types) {
    using T = typename decltype(types)::grad_t;
    using S = typename decltype(types)::state_t;
    const auto rule = lion_rule<FVec<T>>(lr, beta1, beta2, weight_decay, amp.inv_scale);
    dispatch_streams<T, S>(params, c, [&](const auto& s) {
      multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
        const auto g = grad_stream<T>(grads, t, amp);
        s.with_param(t, [&](auto p) {
          s.for_each(begin, end, [&](auto& pv, auto& gv, auto& mv) { rule.apply(pv, gv, mv); }, p, g,
                     s.state(exp_avgs, t, 0, 0, true));
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
  lion_impl(model, grads, exp_avgs, masters, lr, beta1, beta2, weight_decay, PlainState{}, lr_tensor, grad_scale,
            found_inf);
}

void lion_compact_cpu(at::TensorList model, at::TensorList grads, at::TensorList exp_avgs, at::TensorList masters,
                      at::TensorList absmaxes, at::TensorList keys, double lr, double beta1, double beta2,
                      double weight_decay, bool stochastic_state, bool stochastic_params,
                      c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  lion_impl(model, grads, exp_avgs, masters, lr, beta1, beta2, weight_decay,
            CompactInputs{absmaxes, keys, stochastic_state, stochastic_params, element_offsets}, lr_tensor, grad_scale,
            found_inf);
}

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("lion_", &lion_cpu);
  m.impl("lion_compact_", &lion_compact_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  impl_twin<&lion_cpu>(m, "lion_");
  impl_twin<&lion_compact_cpu>(m, "lion_compact_");
}

}  // namespace fused_optim
