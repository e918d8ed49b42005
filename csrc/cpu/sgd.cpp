// The SGD family kernel (see sgd_family.h) and the ops that are nothing but it:
//   sgd_      torch.optim.SGD (fused_optim/sgd.py)
//   sign_sgd_ mlbench SignSGD: torch SGD momentum on g + wd*p, then p <- p - lr*sign(d) (sign_sgd.py)
#include "compact_state.h"  // the compact twins
#include "fixed_order_sums.h"
#include "update_args.h"
#include "bucket.h"
#include "ops.h"
#include "sgd_family.h"
#include "multi_tensor.h"
#include "two_pass.h"

#include <cmath>
#include <type_traits>

namespace fused_optim {
namespace {

// The update of elements [begin, end) of tensor t, with tensor t's numbers from args; T the
// params' and grads' dtype, S that of the values updated and the buffers, Streams their streams
// (update_args.h).
template <typename T, typename S, SgdDirection D, typename Streams>
struct SgdUpdate {
  using grad_t = T;
  using state_t = S;
  const UpdatedParams& params;
  const ContiguousTensors& grads;
  at::TensorList bufs;
  const c10::List<bool>& first_step;
  const SgdFamily& a;
  const Streams& s;

  void operator()(int64_t t, int64_t begin, int64_t end) const {
    const auto rule = sgd_rule<FVec<T>, D>({a.grad_mul[t], a.weight_decay[t], a.lr[t]}, a.momentum, a.dampening,
                                           a.clamp, a.nesterov, a.wd_after_momentum,
                                           !first_step.empty() && first_step[t]);
    const auto g = grad_stream<T>(grads, t, a.amp);
    s.with_param(t, [&](auto p) {
      if (a.momentum != 0.0) {
        s.for_each(begin, end, [&](auto& pv, auto& gv, auto& bv) { rule.apply(pv, gv, bv); }, p, g,
                   s.state(bufs, t, 0, 0, true));
      } else {
        s.for_each(begin, end, [&](auto& pv, auto& gv) { rule.apply(pv, gv); }, p, g);
      }
    });
  }
};

// f(update) with the SgdUpdate of the params' types and the direction, one of Ds (the directions
// the launch takes: each is compiled for every type and state format).
template <SgdDirection... Ds, typename States, typename F>
void with_update(const UpdatedParams& params, const ContiguousTensors& grads, at::TensorList bufs,
                 const c10::List<bool>& first_step, const SgdFamily& a, const States& states, const F& f) {
  dispatch_update(params, [&](auto types) {
    using T = typename decltype(types)::grad_t;
    using S = typename decltype(types)::state_t;
    dispatch_streams<T, S>(params, states, [&](const auto& s) {
      using Streams = std::decay_t<decltype(s)>;
      const bool taken =
          ((a.direction == Ds && (f(SgdUpdate<T, S, Ds, Streams>{params, grads, bufs, first_step, a, s}), true)) ||
           ...);
      TORCH_CHECK(taken, "fused_optim: an SGD-family launch got a direction it is not compiled for");
    });
  });
}

}  // namespace

template <typename States>
void sgd_family(const UpdatedParams& params, const ContiguousTensors& grads, at::TensorList bufs,
                const c10::List<bool>& first_step, const SgdFamily& args, const States& states) {
  if (params.model.empty()) return;
  with_update<SgdDirection::kPlain, SgdDirection::kSign, SgdDirection::kClamp>(
      params, grads, bufs, first_step, args, states,
      [&](const auto& update) { multi_tensor_apply(numels_of(params.model), update); });
  advance_keys(states);
  finish_grads(grads, args.amp);
}

template <typename States>
void sgd_family_after_norms(const UpdatedParams& params, const ContiguousTensors& grads, at::TensorList bufs,
                            const c10::List<bool>& first_step, const SgdFamily& args, const States& states,
                            const SetNumbers& set, const NormSums& norm) {
  if (params.model.empty()) return;
  // LARS and ColossalAI's Lars: no sign direction (each direction is compiled for every type and format)
  constexpr auto kPlain = SgdDirection::kPlain, kClamp = SgdDirection::kClamp;
  with_update<kPlain, kClamp>(params, grads, bufs, first_step, args, states, [&](const auto& update) {
    using T = typename std::decay_t<decltype(update)>::grad_t;
    using S = typename std::decay_t<decltype(update)>::state_t;
    const auto numels = numels_of(params.model);
    auto sums = [&](int64_t t, int64_t begin, int64_t end, Placement) {
      return sums_of_squares(cptr<S>(params.values()[t]), cptr<T>(grads[t]), begin, end);
    };
    if (norm.sums_only) return two_pass_sums<2>(numels, sums, norm.rows);
    multi_tensor_two_pass<2>(
        numels, sums,
        [&](int64_t t, const std::array<double, 2>& totals) {
          set(static_cast<size_t>(t), std::sqrt(totals[0]), std::sqrt(totals[1]));
        },
        [&](int64_t t, int64_t begin, int64_t end, Placement) { update(t, begin, end); }, norm.rows);
  });
  if (norm.sums_only) return;
  advance_keys(states);
  finish_grads(grads, args.amp);
}

template void sgd_family(const UpdatedParams&, const ContiguousTensors&, at::TensorList, const c10::List<bool>&,
                         const SgdFamily&, const PlainState&);
template void sgd_family(const UpdatedParams&, const ContiguousTensors&, at::TensorList, const c10::List<bool>&,
                         const SgdFamily&, const CompactArgs&);
template void sgd_family_after_norms(const UpdatedParams&, const ContiguousTensors&, at::TensorList,
                                     const c10::List<bool>&, const SgdFamily&, const PlainState&, const SetNumbers&,
                                     const NormSums&);
template void sgd_family_after_norms(const UpdatedParams&, const ContiguousTensors&, at::TensorList,
                                     const c10::List<bool>&, const SgdFamily&, const CompactArgs&, const SetNumbers&,
                                     const NormSums&);

namespace {

// SGD and SignSGD: the same numbers for every tensor (inputs: PlainState for the list op,
// CompactInputs for the compact twin).
template <typename Inputs>
void sgd_like(const char* op, SgdDirection direction, at::TensorList model, at::TensorList grads_in,
              at::TensorList bufs, at::TensorList masters, const c10::List<bool>& first_step, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov, bool maximize,
              bool wd_after_momentum, const Inputs& inputs, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || model.empty()) return;
  const auto call = sgd_call(op, model, grads_in, bufs, masters, first_step, momentum, inputs, amp.unscale_grads);
  const size_t n = model.size();
  SgdFamily args{direction, momentum, dampening, 0.0, nesterov, wd_after_momentum,
                 std::vector<double>(n, maximize ? -amp.inv_scale : amp.inv_scale),
                 std::vector<double>(n, weight_decay), std::vector<double>(n, lr), amp};
  sgd_family(call.params, call.grads, bufs, first_step, args, call.states);
}

}  // namespace

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
             at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum, double dampening, double weight_decay,
             bool nesterov, bool maximize, bool wd_after_momentum, const std::optional<at::Tensor>& lr_tensor,
             const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  sgd_like("sgd_", SgdDirection::kPlain, params, grads, momentum_buffers, master_params, first_step, lr, momentum,
           dampening, weight_decay, nesterov, maximize, wd_after_momentum, PlainState{}, lr_tensor, grad_scale,
           found_inf);
}

void sgd_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                     at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                     const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                     double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum, bool stochastic_state,
                     bool stochastic_params, c10::IntArrayRef element_offsets,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  sgd_like("sgd_", SgdDirection::kPlain, params, grads, momentum_buffers, master_params, first_step, lr, momentum,
           dampening, weight_decay, nesterov, maximize, wd_after_momentum,
           CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets}, lr_tensor,
           grad_scale, found_inf);
}

void sign_sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                  at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum, double dampening, double weight_decay,
                  bool nesterov, const std::optional<at::Tensor>& lr_tensor,
                  const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  sgd_like("sign_sgd_", SgdDirection::kSign, params, grads, momentum_buffers, master_params, first_step, lr, momentum,
           dampening, weight_decay, nesterov, false, false, PlainState{}, lr_tensor, grad_scale, found_inf);
}

void sign_sgd_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                          at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                          const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                          double weight_decay, bool nesterov, bool stochastic_state, bool stochastic_params,
                          c10::IntArrayRef element_offsets,
                          const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                          const std::optional<at::Tensor>& found_inf) {
  sgd_like("sign_sgd_", SgdDirection::kSign, params, grads, momentum_buffers, master_params, first_step, lr, momentum,
           dampening, weight_decay, nesterov, false, false,
           CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets}, lr_tensor,
           grad_scale, found_inf);
}

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("sgd_", &sgd_cpu);
  m.impl("sgd_compact_", &sgd_compact_cpu);
  m.impl("sign_sgd_", &sign_sgd_cpu);
  m.impl("sign_sgd_compact_", &sign_sgd_compact_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  impl_twin<&sgd_cpu>(m, "sgd_");
  impl_twin<&sgd_compact_cpu>(m, "sgd_compact_");
  impl_twin<&sign_sgd_cpu>(m, "sign_sgd_");
  impl_twin<&sign_sgd_compact_cpu>(m, "sign_sgd_compact_");
}

}  // namespace fused_optim
