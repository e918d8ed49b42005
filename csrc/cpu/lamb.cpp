// LAMB over a whole bucket (lamb_, colossal_lamb_); step counters incremented here. The math:
// csrc/shared/lamb_math.h (per element and per tensor), trust_ratio.h (the trust ratio r[t]),
// shared with the CUDA kernel; fused_optim/lamb.py documents both classes.
// With the trust ratio, pass 1 updates m and v and sums ||p||^2 and ||u||^2 per tensor (fixed
// order); pass 2 updates p with u as pass 1 kept it in a scratch buffer (fp32/fp64, see KeptU),
// else recomputed from the stored m, v and the untouched p. So no host sync per tensor: the data
// is read twice, in one two-pass launch (multi_tensor_two_pass) that updates a tensor right after
// its sums, while it is in the cache.
// lamb_compact_ / colossal_lamb_compact_ are the same updates on compact state (compact_state.h):
// pass 1 decodes m and v, updates them, sums ||u||^2 of the new (fp32) moments and encodes them;
// pass 2 decodes the moments as stored and recomputes u from them (the reference's definition:
// fused_optim/_reference.py _lamb). Nothing is kept between the passes of compact state.
// norm_sums / sums_only (two_pass.h: NormSums): S_p = sum p^2 and S_x = sum u^2 of pass 1's u;
// the sums only run pass 1 with the moments read, not stored (written for every tensor, whether
// or not the trust ratio is on), and leave the step counters and rounding keys as they were.
#include "multi_tensor.h"  // before the shared rule (lamb_math.h)
#include "compact_state.h"  // the compact twins
#include "fixed_order_sums.h"
#include "update_args.h"
#include "bucket.h"
#include "ops.h"
#include "two_pass.h"
#include "../shared/lamb_math.h"
#include "../shared/trust_ratio.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace fused_optim {
namespace {

struct Lamb : LambOptions {  // (csrc/shared/lamb_math.h)
  AmpArgs amp;  // grad_scale's inverse, and whether pass 1 (the last to read the grads) unscales them
  std::optional<double> grad_norm;  // unscaled norm to clip with; none: that of the call's grads
  std::vector<LambTensor> tensors;  // per tensor: c1, c2, lr
  std::vector<double> new_step;      // per tensor
};

// KeptU: where pass 1 keeps u for pass 2, element i of a tensor at [i]: the thread's scratch when
// both passes of the tensor run on that thread (Placement::kThread, <= kWhole elements), the
// calling thread's when all threads share a tensor of at most kKeepAll elements (kAll, `shared`:
// grown before the launch), else nowhere (pass 2 recomputes u). A larger tensor does not stay in
// the cache between the passes, so writing u would add memory traffic; a smaller one made pass 2
// compute-bound on the sqrt and the divide (~0.18 ms per 1M fp32 elements in L3, a third of
// pass 1). fp16/bf16 and compact state keep nothing: pass 2 recomputes their u from m and v as
// stored, rounded or encoded (fp16's v underflows), as the reference does.
constexpr int64_t kKeepAll = int64_t{1} << 22;

template <typename M>
M* scratch_of_thread(int64_t numel) {
  thread_local std::vector<M> scratch;
  const auto size = static_cast<size_t>(numel + kAlign);  // room for the SIMD tail
  if (scratch.size() < size) scratch.resize(size);
  return scratch.data();
}

template <typename T>
struct KeptU {
  using M = opmath_t<T>;
  const std::vector<int64_t>& numels;
  M* shared = nullptr;

  bool keep = !at::vec::is_reduced_floating_point_v<T>;

  KeptU(const std::vector<int64_t>& numels_, bool stored_as_computed) : numels(numels_) {
    keep = keep && stored_as_computed;
    if (keep) {
      int64_t largest = 0;
      for (const int64_t numel : numels) largest = numel <= kKeepAll ? std::max(largest, numel) : largest;
      if (largest > kWhole) shared = scratch_of_thread<M>(largest);
    }
  }

  M* at(int64_t t, Placement where) const {
    if (!keep) return nullptr;
    if (where == Placement::kThread) return scratch_of_thread<M>(numels[t]);
    return where == Placement::kAll && numels[t] <= kKeepAll ? shared : nullptr;
  }
};

// 1/(grad_scale*clip) for the gradient (lamb_grad_multiplier), the norm summed here if not given.
template <typename T>
double grad_multiplier(const ContiguousTensors& grads, const std::vector<int64_t>& numels, const Lamb& a) {
  if (a.max_grad_norm <= 0.0) return a.amp.inv_scale;  // no clipping: no norm needed
  double norm = a.grad_norm.value_or(0.0);
  if (!a.grad_norm) {
    double sum = 0.0;
    for (const double s : multi_tensor_squares(
             numels, [&](int64_t t, int64_t b, int64_t e) { return sum_of_squares(cptr<T>(grads[t]), b, e); },
             [&](int64_t t, int64_t b, int64_t e, int64_t u, int64_t c, int64_t f) {
               return sums_of_squares(cptr<T>(grads[t]) + b, e - b, cptr<T>(grads[u]) + c, f - c);
             })) {
      sum += s;
    }
    norm = std::sqrt(sum) * a.amp.inv_scale;
  }
  return lamb_grad_multiplier(a.amp.inv_scale, norm, a.max_grad_norm);
}

// A moment stream as pass 1 takes it: written back (kStore), or read only (the sums only: the new
// moments are computed in registers for u and dropped).
template <bool kStore, typename Stream>
auto stored_if(const Stream& s) {
  if constexpr (kStore) {
    return s;
  } else {
    return read_only(s);
  }
}

// T: the params' and grads' dtype; S: that of the values updated; Streams: the moments' streams
// (update_args.h: plain, or compact_state.h). With `norm` (two_pass.h) pass 1 alone, the
// moments not stored (the sums only), or the trust ratio from the sums given.
template <typename T, typename S, typename Streams>
void lamb_typed(const UpdatedParams& params, const ContiguousTensors& grads, at::TensorList exp_avgs,
                at::TensorList exp_avg_sqs, const Lamb& a, const Streams& s, const NormSums& norm) {
  using M = opmath_t<T>;
  using V = FVec<T>;
  const size_t n = params.model.size();
  const auto numels = numels_of(params.model);
  const double grad_mul = grad_multiplier<T>(grads, numels, a);
  auto rule_of = [&](size_t t) { return lamb_rule<V>(a, grad_mul, a.tensors[t]); };
  auto m_of = [&](int64_t t) { return s.state(exp_avgs, t, 0, 0, true); };
  auto v_of = [&](int64_t t) { return s.state(exp_avg_sqs, t, 1, 1, false); };
  const KeptU<S> kept_u(numels, Streams::kPlainState && a.trust_ratio && !norm.sums_only);
  // Pass 1 over items [begin, end) of tensor t: the new moments (stored when `store` is true),
  // ||p||^2 and ||u||^2 of u from the new moments (kept for pass 2 where kept_u says).
  auto first_pass = [&](auto store) {
    return [&](int64_t t, int64_t begin, int64_t end, Placement where) {
      constexpr bool kStore = decltype(store)::value;
      const auto rule = rule_of(t);
      M* keep = kept_u.at(t, where);
      if (keep != nullptr) keep += begin;
      V p2(0), u2(0);
      s.for_each(
          begin, end,
          [&](auto& p, auto& g, auto& m, auto& v) {
            rule.moments(p, g, m, v);
            const V u = rule.direction(p, m, v);
            p2 = at::vec::fmadd(p, p, p2);
            u2 = at::vec::fmadd(u, u, u2);
            if (keep != nullptr) {
              u.store(keep);
              keep += V::size();
            }
          },
          cptr<S>(params.values()[t]), grad_stream<T>(grads, t, kStore ? a.amp : AmpArgs{}),
          stored_if<kStore>(m_of(t)), stored_if<kStore>(v_of(t)));
      return std::array<double, 2>{lane_sum(p2), lane_sum(u2)};
    };
  };
  if (norm.sums_only) return two_pass_sums<2>(numels, first_pass(std::false_type{}), norm.rows);
  std::vector<double> neg_lr(n);
  for (size_t t = 0; t < n; ++t) neg_lr[t] = -a.tensors[t].lr;
  if (!a.trust_ratio) {  // one pass
    multi_tensor_apply(numels, [&](int64_t t, int64_t begin, int64_t end) {
      const auto rule = rule_of(t);
      const V step(static_cast<M>(neg_lr[t]));
      s.with_param(t, [&](auto p) {
        s.for_each(
            begin, end,
            [&](auto& pv, auto& g, auto& m, auto& v) {
              rule.moments(pv, g, m, v);
              rule.apply(pv, step, rule.direction(pv, m, v));
            },
            p, grad_stream<T>(grads, t, a.amp), m_of(t), v_of(t));
      });
    });
    return;
  }
  multi_tensor_two_pass<2>(
      numels, first_pass(std::true_type{}),
      [&](int64_t t, const std::array<double, 2>& sums) {
        neg_lr[t] *= lamb_trust_ratio(std::sqrt(sums[0]), std::sqrt(sums[1]), a.trust_clip);
      },
      [&](int64_t t, int64_t begin, int64_t end, Placement where) {
        const V step(static_cast<M>(neg_lr[t]));
        if (const M* kept = kept_u.at(t, where); kept != nullptr) {
          kept += begin;
          for_each_block<T>(
              begin, end,
              [&](auto& p) {
                LambRule<V>::apply(p, step, V::loadu(kept));
                kept += V::size();
              },
              param_stream<T, S>(params, t));
          return;
        }
        const auto rule = rule_of(t);
        s.with_param(t, [&](auto p) {
          s.for_each(
              begin, end, [&](auto& pv, auto& m, auto& v) { rule.apply(pv, step, rule.direction(pv, m, v)); }, p,
              read_only(m_of(t)), read_only(v_of(t)));
        });
      },
      norm.rows);
}

// Checks, the per-tensor step counters and numbers (lamb_tensor), and the update; inputs:
// PlainState for the list ops, CompactInputs for the compact twins.
template <typename Inputs>
void run_lamb(const char* op, at::TensorList model, at::TensorList grads_in, at::TensorList exp_avgs,
              at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList masters, const Inputs& inputs, Lamb& a,
              double lr, const NormSums& norm) {
  const UpdatedParams params = checked_params(op, model, masters);
  const auto grads = checked_grads(op, params.model, grads_in, a.amp.unscale_grads && !norm.sums_only);
  const auto c = state_args(op, params, exp_avgs, inputs);
  const int slot = check_state_list(op, "exp_avgs", params, exp_avgs, c, 0);
  check_state_list(op, "exp_avg_sqs", params, exp_avg_sqs, c, slot);
  check_steps(op, model, steps);
  const size_t n = model.size();
  a.tensors.resize(n);
  a.new_step.resize(n);
  BiasCorrections corrections(a.beta1, a.beta2, a.bias_correction);
  for (size_t t = 0; t < n; ++t) {
    a.new_step[t] = read_step(steps[t]) + 1.0;
    a.tensors[t] = lamb_tensor(lr, corrections.at(a.new_step[t]), a.colossal);
  }
  dispatch_update(params, [&](auto types) {
    using T = typename decltype(types)::grad_t;
    using S = typename decltype(types)::state_t;
    dispatch_streams<T, S>(params, c, [&](const auto& s) {
      lamb_typed<T, S>(params, grads, exp_avgs, exp_avg_sqs, a, s, norm);
    });
  });
  if (norm.sums_only) return;  // the step counters, rounding keys and grads as they were
  finish_grads(grads, a.amp);
  for (size_t t = 0; t < n; ++t) write_step(steps[t], a.new_step[t]);
  advance_keys(c);
}

// lamb_ (inputs: PlainState) and its compact twin (CompactInputs).
template <typename Inputs>
void lamb_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList steps, at::TensorList master_params, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode, double max_grad_norm,
               bool use_nvlamb, bool trust_clip, const std::optional<at::Tensor>& global_grad_norm,
               const std::optional<at::Tensor>& norm_sums, bool sums_only, const Inputs& inputs,
               const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf) {
  const NormSums norm = norm_sums_of("lamb_", norm_sums, sums_only, params);
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || params.empty()) return;
  Lamb a;
  static_cast<LambOptions&>(a) = lamb_options(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                                              adam_w_mode, max_grad_norm, use_nvlamb, trust_clip);
  a.amp = amp;
  if (global_grad_norm.has_value() && global_grad_norm->defined()) {
    TORCH_CHECK(global_grad_norm->numel() == 1, "fused_optim::lamb_: global_grad_norm must have one element");
    a.grad_norm = global_grad_norm->item<double>() * amp.inv_scale;
  }
  run_lamb("lamb_", params, grads, exp_avgs, exp_avg_sqs, steps, master_params, inputs, a, lr, norm);
}

// colossal_lamb_ and its compact twin.
template <typename Inputs>
void colossal_lamb_impl(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params, double lr,
                        double beta1, double beta2, double eps, double weight_decay, bool adam, bool bias_correction,
                        const std::optional<at::Tensor>& norm_sums, bool sums_only, const Inputs& inputs,
                        const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const NormSums norm = norm_sums_of("colossal_lamb_", norm_sums, sums_only, params);
  const AmpArgs amp = read_amp(grad_scale, found_inf);
  lr = read_lr(lr, lr_tensor);
  if (amp.skip || params.empty()) return;
  Lamb a;
  static_cast<LambOptions&>(a) = colossal_lamb_options(beta1, beta2, eps, weight_decay, adam, bias_correction);
  a.amp = amp;
  run_lamb("colossal_lamb_", params, grads, exp_avgs, exp_avg_sqs, steps, master_params, inputs, a, lr, norm);
}

}  // namespace

void lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
              at::TensorList steps, at::TensorList master_params, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode, double max_grad_norm,
              bool use_nvlamb, bool trust_clip, const std::optional<at::Tensor>& global_grad_norm,
              const std::optional<at::Tensor>& norm_sums, bool sums_only, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  lamb_impl(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
            bias_correction, grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, trust_clip, global_grad_norm,
            norm_sums, sums_only, PlainState{}, lr_tensor, grad_scale, found_inf);
}

void lamb_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params,
                      at::TensorList absmaxes, at::TensorList rounding_keys, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode,
                      double max_grad_norm, bool use_nvlamb, bool trust_clip,
                      const std::optional<at::Tensor>& global_grad_norm, const std::optional<at::Tensor>& norm_sums,
                      bool sums_only, bool stochastic_state, bool stochastic_params, c10::IntArrayRef element_offsets,
                      const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  lamb_impl(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
            bias_correction, grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, trust_clip, global_grad_norm,
            norm_sums, sums_only,
            CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets}, lr_tensor,
            grad_scale, found_inf);
}

void colossal_lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                       at::TensorList steps, at::TensorList master_params, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool adam, bool bias_correction,
                       const std::optional<at::Tensor>& norm_sums, bool sums_only,
                       const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf) {
  colossal_lamb_impl(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
                     adam, bias_correction, norm_sums, sums_only, PlainState{}, lr_tensor, grad_scale, found_inf);
}

void colossal_lamb_compact_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params,
                               at::TensorList absmaxes, at::TensorList rounding_keys, double lr, double beta1,
                               double beta2, double eps, double weight_decay, bool adam, bool bias_correction,
                               const std::optional<at::Tensor>& norm_sums, bool sums_only, bool stochastic_state,
                               bool stochastic_params, c10::IntArrayRef element_offsets,
                               const std::optional<at::Tensor>& lr_tensor,
                               const std::optional<at::Tensor>& grad_scale,
                               const std::optional<at::Tensor>& found_inf) {
  colossal_lamb_impl(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
                     adam, bias_correction, norm_sums, sums_only,
                     CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets},
                     lr_tensor, grad_scale, found_inf);
}

TORCH_LIBRARY_IMPL(fused_optim, CPU, m) {
  m.impl("lamb_", &lamb_cpu);
  m.impl("lamb_compact_", &lamb_compact_cpu);
  m.impl("colossal_lamb_", &colossal_lamb_cpu);
  m.impl("colossal_lamb_compact_", &colossal_lamb_compact_cpu);
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  impl_twin<&lamb_cpu>(m, "lamb_");
  impl_twin<&lamb_compact_cpu>(m, "lamb_compact_");
  impl_twin<&colossal_lamb_cpu>(m, "colossal_lamb_");
  impl_twin<&colossal_lamb_compact_cpu>(m, "colossal_lamb_compact_");
}

}  // namespace fused_optim
