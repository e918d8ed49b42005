// The CUDA implementations of the ops of fused_optim/_ops.py (same C++ signatures as the CPU ones,
// csrc/host/update_ops.h), registered for the CUDA key. A thin layer: check the tensors, turn the lists
// into pointers and sizes, put lr / grad_scale / found_inf on the device, allocate the scratch of
// per-tensor sums, and call the launchers of launch.h on the current stream. No host sync, except
// sparsified_sgd_'s index draws (host random numbers, like the CPU kernel and the reference).
// Master weights (master_params) are passed to the kernels as lists of their own: the kernels read
// the fp16/bf16 grads, update the fp32 masters and state and write the rounded params in one pass.
// The compact twins (<op>compact_: bf16 / 8-bit state, stochastic rounding) are the same calls with
// the compact arguments of csrc/host/compact_args.h (CompactCall below; the kernels:
// compact_state.cuh); the list ops are those calls without them.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "../host/checks.h"
#include "../host/compact_args.h"
#include "../host/sparse_indices.h"
#include "../host/update_ops.h"
#include "../shared/trust_ratio.h"
#include "launch.h"

// The library and dispatch key these implementations are registered for: fused_optim's CUDA key;
// the CPU emulation build (fused_optim/_build.py, csrc/emulation) sets its own library and CPU.
#ifndef FUSED_OPTIM_CUDA_LIBRARY
#define FUSED_OPTIM_CUDA_LIBRARY fused_optim
#define FUSED_OPTIM_CUDA_KEY CUDA
#endif

namespace fused_optim {
namespace {

using OptTensor = std::optional<at::Tensor>;
using cuda::DType;

DType dtype_of(const char* op, at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::kFloat;
    case at::kDouble: return DType::kDouble;
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "fused_optim::", op, ": dtype ", type, " has no CUDA kernel (float32/64, float16, bfloat16)");
  }
}

// The data pointers of a TensorList or of ContiguousTensors.
template <typename Tensors>
std::vector<void*> pointers(const Tensors& tensors) {
  std::vector<void*> out;
  out.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) out.push_back(tensors[i].data_ptr());
  return out;
}

std::vector<int64_t> sizes_of(at::TensorList tensors) {
  std::vector<int64_t> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(t.numel());
  return out;
}

int64_t max_chunks_of(const std::vector<int64_t>& sizes) {
  int64_t most = 1;
  for (const int64_t s : sizes) most = std::max(most, cuda::chunks_of(s));
  return most;
}

// The CUDA device of a call, from params[0]; checks that it is a CUDA tensor.
at::Device device_of(const char* op, at::TensorList params) {
  TORCH_CHECK(params[0].device().type() == c10::DeviceType::FUSED_OPTIM_CUDA_KEY, "fused_optim::", op,
              ": params[0] is on ", params[0].device(), "; the CUDA kernel needs CUDA params");
  return params[0].device();
}

// A one-element tensor argument as a float32 scalar on the device: itself when it is one, a copy
// otherwise (a CPU value is read on the host and filled in on the device); undefined when absent.
at::Tensor device_scalar(const char* op, const char* name, const OptTensor& t, at::Device device) {
  if (!t.has_value() || !t->defined()) return {};
  TORCH_CHECK(t->numel() == 1, "fused_optim::", op, ": ", name, " must have one element, got ", t->numel());
  const auto options = at::TensorOptions().device(device).dtype(at::kFloat);
  if (t->device() == device && t->scalar_type() == at::kFloat) return *t;
  if (t->is_cpu()) return at::full({1}, t->item<double>(), options);
  return t->to(options);
}

// lr / grad_scale / found_inf as device scalars for the kernels (keeps the tensors alive).
class Scalars {
 public:
  Scalars(const char* op, at::Device device, double lr, const OptTensor& lr_tensor, const OptTensor& grad_scale,
          const OptTensor& found_inf)
      : lr_(device_scalar(op, "lr_tensor", lr_tensor, device)),
        grad_scale_(device_scalar(op, "grad_scale", grad_scale, device)),
        found_inf_(device_scalar(op, "found_inf", found_inf, device)) {
    s_.lr = lr_.defined() ? lr_.data_ptr<float>() : nullptr;
    s_.lr_value = lr;
    s_.grad_scale = grad_scale_.defined() ? grad_scale_.data_ptr<float>() : nullptr;
    s_.found_inf = found_inf_.defined() ? found_inf_.data_ptr<float>() : nullptr;
  }

  const cuda::DeviceScalars& get() const { return s_; }

 private:
  at::Tensor lr_, grad_scale_, found_inf_;
  cuda::DeviceScalars s_;
};

// The end of an update given a grad_scale: its kernels wrote the grads back unscaled (where the
// scale is not 1; GradWriteBack, multi_tensor_apply.cuh), into the contiguous copies of those
// given non-contiguous too, which go back to the caller's tensors (queued on the stream). The
// scale lives on the device, so the copies go back whatever it is (a scale of 1 or an overflow
// step copies back the values they had: a write, not a change).
bool scaled(const OptTensor& grad_scale) { return grad_scale.has_value() && grad_scale->defined(); }

// Whether found_inf skips the step, read on the host (a sync: for the host's own work only, which
// the kernels' device-side skip cannot stop).
bool skipped_on_host(const OptTensor& found_inf) {
  return found_inf.has_value() && found_inf->defined() && found_inf->item<double>() != 0.0;
}

void finish_grads(const ContiguousTensors& grads, const OptTensor& grad_scale) {
  if (scaled(grad_scale)) grads.copy_back();
}

std::vector<float*> checked_steps(const char* op, at::TensorList params, at::TensorList steps) {
  check_same_size(op, "steps", params, steps);
  std::vector<float*> out;
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    TORCH_CHECK(s.numel() == 1 && s.device() == params[0].device() && s.scalar_type() == at::kFloat,
                "fused_optim::", op, ": steps[", i, "] must be a 1-element float32 tensor on ", params[0].device(),
                " (got ", s.scalar_type(), " on ", s.device(), "); CUDA step counters live on the param's device");
    out.push_back(s.data_ptr<float>());
  }
  return out;
}

// The lists an update reads and writes, from its checked params (UpdatedParams,
// csrc/host/checks.h): the values updated (the params, or their fp32 masters), with masters the
// params written from them in the same pass (`model`, empty without), and their dtypes.
struct UpdateLists {
  cuda::UpdateDTypes dtypes;
  std::vector<void*> values, model;

  UpdateLists(const char* op, const UpdatedParams& params)
      : dtypes(cuda::UpdateDTypes::of(dtype_of(op, params.model[0].scalar_type()), !params.masters.empty())),
        values(pointers(params.values())),
        model(params.masters.empty() ? std::vector<void*>{} : pointers(params.model)) {}
  UpdateLists(const char* op, const UpdatedParams& params, const CompactArgs& c) : UpdateLists(op, params) {
    dtypes.format = c.format;
    dtypes.stochastic_params = c.stochastic_params;
  }

  void* const* model_list() const { return model.empty() ? nullptr : model.data(); }
};

// Per-tensor sums of squares of `lists` lists on the device (ChunkSums with their scratch).
struct SumsScratch {
  at::Tensor partials, out;
  cuda::ChunkSums sums;

  SumsScratch(at::Device device, int64_t tensors, int64_t max_chunks, int lists) {
    const auto options = at::TensorOptions().device(device).dtype(at::kDouble);
    partials = at::zeros({tensors * max_chunks * lists}, options);
    out = at::zeros({tensors * lists}, options);
    sums = {partials.data_ptr<double>(), max_chunks, out.data_ptr<double>()};
  }
};

// The compact twin's inputs (compact_args.h), or none for the list op.
using MaybeCompact = std::optional<CompactInputs>;

// A call's compact arguments (compact_args.h: the format from the state list `first`, checked as
// the CPU kernels check them) for the kernels: the absmax pointers of its 8-bit lists (list-major,
// as the op takes them) and the step's rounding keys copied to the device. The key tensors stay
// int64 CPU tensors on every device: read here, advanced on the host by finish(); the element
// offsets, with stochastic rounding, copied to the device too. A list op (no CompactInputs) is
// the call on plain state: `first` (named `what`), and so every state list checked against its
// format, must be in the values' dtype (the CPU's PlainState, csrc/cpu/update_args.h).
class CompactCall {
 public:
  CompactCall(const char* op, const UpdatedParams& params, const char* what, at::TensorList first,
              const MaybeCompact& in, at::Device device)
      : args_(checked_args(op, params, what, first, in)) {
    if (args_.format == StateFormat::k8bit) absmaxes_ = pointers(in->absmaxes);
    if (args_.stochastic()) {
      keys_ = on_device(args_.key_values, device);
      if (!args_.offsets.empty()) offsets_ = on_device(args_.offsets, device);
    }
  }

  const CompactArgs& args() const { return args_; }
  // The absmaxes of the 8-bit lists, or nullptr.
  void* const* absmaxes() const { return absmaxes_.empty() ? nullptr : absmaxes_.data(); }
  // The absmax of 8-bit list `slot`, tensor t (an SGD launch's subset of the tensors).
  void* absmax(int slot, int64_t n, int64_t t) const { return absmaxes_.empty() ? nullptr : absmaxes_[slot * n + t]; }
  void set(cuda::DeviceScalars& s) const {
    s.rounding_keys = keys_.defined() ? keys_.data_ptr<int64_t>() : nullptr;
    s.element_offsets = offsets_.defined() ? offsets_.data_ptr<int64_t>() : nullptr;
    s.stochastic_state = args_.stochastic_state;
  }
  // After the launches: every key advanced by one, unless found_inf skipped the step (read on the
  // host: with stochastic rounding a device found_inf costs a sync).
  void finish(const OptTensor& found_inf) const {
    if (!args_.stochastic() || skipped_on_host(found_inf)) return;
    advance_keys(args_);
  }

 private:
  static CompactArgs checked_args(const char* op, const UpdatedParams& params, const char* what, at::TensorList first,
                                  const MaybeCompact& in) {
    if (!in.has_value() && !first.empty()) check_mutable(op, what, params.values(), first, true);
    return state_args(op, params, first, in.value_or(CompactInputs{}));
  }

  // The host values as an int64 tensor on the device.
  static at::Tensor on_device(const std::vector<int64_t>& values, at::Device device) {
    at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
    std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
    return host.to(device);
  }

  CompactArgs args_;
  std::vector<void*> absmaxes_;
  at::Tensor keys_, offsets_;
};

// The SGD family: per-tensor first-step flags split the tensors into two launches. The layer-wise
// ops' sums (Σv², Σg²) come from the rows of norm_sums when given (cuda::NormSums); with
// sums_only the call writes those rows and nothing else.
void sgd_family_cuda(const char* op, cuda::SgdDirection direction, at::TensorList params, at::TensorList grads_in,
                     at::TensorList bufs, at::TensorList masters, const c10::List<bool>& first_step,
                     cuda::SgdArgs args, double lr, const OptTensor& lr_tensor, const OptTensor& grad_scale,
                     const OptTensor& found_inf, const MaybeCompact& compact = {},
                     const OptTensor& norm_sums = std::nullopt, bool sums_only = false) {
  if (params.empty()) return;
  const cuda::NormSums phase{checked_norm_sums(op, norm_sums, sums_only, params), sums_only};
  const at::Device device = device_of(op, params);
  const c10::cuda::CUDAGuard guard(device);
  const UpdatedParams updated = checked_params(op, params, masters);
  const auto grads = checked_grads(op, params, grads_in, scaled(grad_scale));
  const CompactCall call(op, updated, "momentum_buffers", bufs, compact, device);
  if (args.momentum != 0.0) {
    check_state_list(op, "momentum_buffers", updated, bufs, call.args(), 0);
    TORCH_CHECK(first_step.size() == params.size() || first_step.empty(), "fused_optim::", op,
                ": first_step needs one flag per param (or none: no first steps)");
  } else {
    TORCH_CHECK(bufs.empty(), "fused_optim::", op, ": momentum_buffers must be empty when momentum == 0");
  }
  const Scalars scalars(op, device, lr, lr_tensor, grad_scale, found_inf);
  args.s = scalars.get();
  call.set(args.s);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const UpdateLists lists(op, updated, call.args());
  const int64_t n = static_cast<int64_t>(params.size());
  auto g = pointers(grads), b = pointers(bufs);
  const auto sizes = sizes_of(params);
  std::optional<SumsScratch> norms;
  if (phase.sums_only || (args.trust != cuda::TrustRatio::kNone && phase.rows == nullptr)) {
    norms.emplace(device, n, max_chunks_of(sizes), 2);
    cuda::value_grad_squares_launch(lists.dtypes.storage(), n, lists.values.data(), g.data(), sizes.data(),
                                    norms->sums, stream);
    if (phase.sums_only) {  // the rows, unless found_inf is set, and nothing else (keys included)
      cuda::sum_chunks_launch(2, n, {norms->sums.partials, norms->sums.max_chunks, phase.rows}, stream,
                              args.s.found_inf);
      return;
    }
    cuda::sum_chunks_launch(2, n, norms->sums, stream);
  }
  if (args.trust != cuda::TrustRatio::kNone) args.sq_norms = phase.rows != nullptr ? phase.rows : norms->sums.out;
  void* const* buf_list = args.momentum != 0.f ? b.data() : nullptr;
  if (first_step.empty() || buf_list == nullptr) {
    cuda::sgd_launch(lists.dtypes, direction, n, lists.values.data(), g.data(), buf_list, lists.model_list(),
                     call.absmaxes(), sizes.data(), nullptr, args, stream);
    finish_grads(grads, grad_scale);
    return call.finish(found_inf);
  }
  for (const bool first : {true, false}) {  // the tensors on their first step, then the others
    std::vector<void*> ps, gs, bs, ms, as;
    std::vector<int64_t> ss;
    std::vector<int32_t> index;
    for (int64_t t = 0; t < n; ++t) {
      if (first_step[t] != first) continue;
      ps.push_back(lists.values[t]);
      gs.push_back(g[t]);
      bs.push_back(b[t]);
      if (!lists.model.empty()) ms.push_back(lists.model[t]);
      as.push_back(call.absmax(0, n, t));
      ss.push_back(sizes[t]);
      index.push_back(static_cast<int32_t>(t));
    }
    args.first_step = first;
    cuda::sgd_launch(lists.dtypes, direction, static_cast<int64_t>(ps.size()), ps.data(), gs.data(), bs.data(),
                     lists.model.empty() ? nullptr : ms.data(), call.absmaxes() != nullptr ? as.data() : nullptr,
                     ss.data(), index.data(), args, stream);
  }
  finish_grads(grads, grad_scale);
  call.finish(found_inf);
}

cuda::SgdArgs sgd_args(double momentum, double dampening, double weight_decay, bool nesterov) {
  cuda::SgdArgs a;
  a.momentum = momentum;
  a.dampening = dampening;
  a.weight_decay = weight_decay;
  a.nesterov = nesterov;
  return a;
}

// SGD and SignSGD: the same numbers for every tensor.
void sgd_call(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
              at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum,
              const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf,
              const MaybeCompact& compact) {
  auto a = sgd_args(momentum, dampening, weight_decay, nesterov);
  a.maximize = maximize;
  a.wd_after_momentum = wd_after_momentum;
  sgd_family_cuda("sgd_", cuda::SgdDirection::kPlain, params, grads, momentum_buffers, master_params, first_step, a,
                  lr, lr_tensor, grad_scale, found_inf, compact);
}

void sign_sgd_call(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, const OptTensor& lr_tensor,
                   const OptTensor& grad_scale, const OptTensor& found_inf, const MaybeCompact& compact) {
  sgd_family_cuda("sign_sgd_", cuda::SgdDirection::kSign, params, grads, momentum_buffers, master_params, first_step,
                  sgd_args(momentum, dampening, weight_decay, nesterov), lr, lr_tensor, grad_scale, found_inf,
                  compact);
}

void lars_call(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
               at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
               double dampening, double weight_decay, bool nesterov, double trust_coefficient, double eps,
               bool trust_clip, bool always_adapt, const OptTensor& norm_sums, bool sums_only,
               const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf,
               const MaybeCompact& compact) {
  auto a = sgd_args(momentum, dampening, weight_decay, nesterov);
  if (weight_decay != 0.0 || always_adapt) {
    a.trust = cuda::TrustRatio::kLars;
    a.trust_coefficient = trust_coefficient;
    a.eps = eps;
    a.trust_clip = trust_clip;
  }
  sgd_family_cuda("lars_", cuda::SgdDirection::kPlain, params, grads, momentum_buffers, master_params, first_step, a,
                  lr, lr_tensor, grad_scale, found_inf, compact, norm_sums, sums_only);
}

void colossal_lars_call(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                        at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
                        double eeta, double weight_decay, double epsilon, bool lars, const OptTensor& norm_sums,
                        bool sums_only, const OptTensor& lr_tensor, const OptTensor& grad_scale,
                        const OptTensor& found_inf, const MaybeCompact& compact) {
  auto a = sgd_args(momentum, 0.0, lars ? weight_decay : 0.0, false);
  a.clamp = kColossalLarsGradClamp;
  if (lars) {
    a.trust = cuda::TrustRatio::kColossal;
    a.trust_coefficient = eeta;
    a.eps = epsilon;
  }
  sgd_family_cuda("colossal_lars_", cuda::SgdDirection::kClamp, params, grads, momentum_buffers, master_params,
                  first_step, a, lr, lr_tensor, grad_scale, found_inf, compact, norm_sums, sums_only);
}

void sparsified_sgd_cuda(at::TensorList params, at::TensorList grads_in, at::TensorList memories,
                         at::TensorList master_params, double lr, double weight_decay, int64_t sparse_grad_size,
                         bool random_sparse, const std::optional<at::Generator>& generator,
                         c10::IntArrayRef whole_shapes, c10::IntArrayRef box_offsets, const OptTensor& lr_tensor,
                         const OptTensor& grad_scale, const OptTensor& found_inf) {
  const char* op = "sparsified_sgd_";
  // (a skipped step draws nothing, as on the CPU: the generator's next draws are the next step's)
  if (params.empty() || skipped_on_host(found_inf)) return;
  TORCH_CHECK(sparse_grad_size > 0, "fused_optim::sparsified_sgd_: sparse_grad_size must be > 0");
  const at::Device device = device_of(op, params);
  const c10::cuda::CUDAGuard guard(device);
  const UpdatedParams updated = checked_params(op, params, master_params);
  const auto grads = checked_grads(op, params, grads_in, scaled(grad_scale));
  check_mutable(op, "memories", updated.values(), memories);
  const Scalars scalars(op, device, lr, lr_tensor, grad_scale, found_inf);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const UpdateLists lists(op, updated);
  auto g = pointers(grads), m = pointers(memories);
  const auto sizes = sizes_of(params);
  const auto indices =  // (drawn and checked before anything is written)
      draw_sparse_indices(params, sparse_grad_size, random_sparse, generator, whole_shapes, box_offsets);
  cuda::sparsified_sgd_launch(lists.dtypes, static_cast<int64_t>(params.size()), lists.values.data(), g.data(),
                              m.data(), lists.model_list(), sizes.data(), scalars.get(), weight_decay, stream);
  for (size_t t = 0; t < params.size(); ++t) {
    const at::Tensor index = indices[t].to(device);
    cuda::sparse_apply_launch(lists.dtypes, lists.values[t], m[t], lists.model.empty() ? nullptr : lists.model[t],
                              index.data_ptr<int64_t>(), index.numel(), scalars.get(), stream);
  }
  finish_grads(grads, grad_scale);
}


void adam_call(at::TensorList params, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList master_params, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
               bool bias_correction, double div_scale, const OptTensor& lr_tensor, const OptTensor& grad_scale,
               const OptTensor& found_inf, const MaybeCompact& compact) {
  const char* op = "adam_";
  if (params.empty()) return;
  TORCH_CHECK(std::isfinite(div_scale) && div_scale > 0.0, "fused_optim::adam_: div_scale must be a finite number > 0, "
              "got ", div_scale);
  const at::Device device = device_of(op, params);
  const c10::cuda::CUDAGuard guard(device);
  const UpdatedParams updated = checked_params(op, params, master_params);
  const auto grads = checked_grads(op, params, grads_in, scaled(grad_scale));
  const CompactCall call(op, updated, "exp_avgs", exp_avgs, compact, device);
  int slot = check_state_list(op, "exp_avgs", updated, exp_avgs, call.args(), 0);
  slot = check_state_list(op, "exp_avg_sqs", updated, exp_avg_sqs, call.args(), slot);
  if (amsgrad) {
    check_state_list(op, "max_exp_avg_sqs", updated, max_exp_avg_sqs, call.args(), slot);
  } else {
    TORCH_CHECK(max_exp_avg_sqs.empty(), "fused_optim::adam_: max_exp_avg_sqs must be empty without amsgrad");
  }
  auto step_ptrs = checked_steps(op, params, steps);
  const Scalars scalars(op, device, lr, lr_tensor, grad_scale, found_inf);
  cuda::AdamArgs a;
  a.s = scalars.get();
  call.set(a.s);
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  a.decoupled = decoupled;
  a.maximize = maximize;
  a.bias_correction = bias_correction;
  a.div_scale = div_scale;
  const UpdateLists lists(op, updated, call.args());
  auto g = pointers(grads), m = pointers(exp_avgs), v = pointers(exp_avg_sqs), vmax = pointers(max_exp_avg_sqs);
  const auto sizes = sizes_of(params);
  cuda::adam_launch(lists.dtypes, static_cast<int64_t>(params.size()), lists.values.data(), g.data(), m.data(),
                    v.data(), amsgrad ? vmax.data() : nullptr, lists.model_list(), step_ptrs.data(), call.absmaxes(),
                    sizes.data(), a, c10::cuda::getCurrentCUDAStream());
  finish_grads(grads, grad_scale);
  call.finish(found_inf);
}

void lion_call(at::TensorList params, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList master_params,
               double lr, double beta1, double beta2, double weight_decay, const OptTensor& lr_tensor,
               const OptTensor& grad_scale, const OptTensor& found_inf, const MaybeCompact& compact) {
  const char* op = "lion_";
  if (params.empty()) return;
  const at::Device device = device_of(op, params);
  const c10::cuda::CUDAGuard guard(device);
  const UpdatedParams updated = checked_params(op, params, master_params);
  const auto grads = checked_grads(op, params, grads_in, scaled(grad_scale));
  const CompactCall call(op, updated, "exp_avgs", exp_avgs, compact, device);
  check_state_list(op, "exp_avgs", updated, exp_avgs, call.args(), 0);
  const Scalars scalars(op, device, lr, lr_tensor, grad_scale, found_inf);
  cuda::LionArgs a;
  a.s = scalars.get();
  call.set(a.s);
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.weight_decay = weight_decay;
  const UpdateLists lists(op, updated, call.args());
  auto g = pointers(grads), m = pointers(exp_avgs);
  const auto sizes = sizes_of(params);
  cuda::lion_launch(lists.dtypes, static_cast<int64_t>(params.size()), lists.values.data(), g.data(), m.data(),
                    lists.model_list(), call.absmaxes(), sizes.data(), a, c10::cuda::getCurrentCUDAStream());
  finish_grads(grads, grad_scale);
  call.finish(found_inf);
}

void adagrad_call(at::TensorList params, at::TensorList grads_in, at::TensorList sums, at::TensorList steps,
                  at::TensorList master_params, double lr, double lr_decay, double weight_decay, double eps,
                  bool maximize, const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf,
                  const MaybeCompact& compact) {
  const char* op = "adagrad_";
  if (params.empty()) return;
  const at::Device device = device_of(op, params);
  const c10::cuda::CUDAGuard guard(device);
  const UpdatedParams updated = checked_params(op, params, master_params);
  const auto grads = checked_grads(op, params, grads_in, scaled(grad_scale));
  const CompactCall call(op, updated, "sums", sums, compact, device);
  check_state_list(op, "sums", updated, sums, call.args(), 0);
  auto step_ptrs = checked_steps(op, params, steps);
  const Scalars scalars(op, device, lr, lr_tensor, grad_scale, found_inf);
  cuda::AdagradArgs a;
  a.s = scalars.get();
  call.set(a.s);
  a.lr_decay = lr_decay;
  a.weight_decay = weight_decay;
  a.eps = eps;
  a.maximize = maximize;
  const UpdateLists lists(op, updated, call.args());
  auto g = pointers(grads), s = pointers(sums);
  const auto sizes = sizes_of(params);
  cuda::adagrad_launch(lists.dtypes, static_cast<int64_t>(params.size()), lists.values.data(), g.data(), s.data(),
                       lists.model_list(), step_ptrs.data(), call.absmaxes(), sizes.data(), a,
                       c10::cuda::getCurrentCUDAStream());
  finish_grads(grads, grad_scale);
  call.finish(found_inf);
}

// lamb_ and colossal_lamb_ after their own argument translation (a.s is set here).
void run_lamb_cuda(const char* op, at::TensorList params, at::TensorList grads_in, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList masters, cuda::LambArgs a,
                   double lr, const OptTensor& global_grad_norm, const OptTensor& norm_sums, bool sums_only,
                   const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf,
                   const MaybeCompact& compact) {
  if (params.empty()) return;
  const cuda::NormSums phase{checked_norm_sums(op, norm_sums, sums_only, params), sums_only};
  const at::Device device = device_of(op, params);
  const c10::cuda::CUDAGuard guard(device);
  const UpdatedParams updated = checked_params(op, params, masters);
  const auto grads = checked_grads(op, params, grads_in, scaled(grad_scale));
  const CompactCall call(op, updated, "exp_avgs", exp_avgs, compact, device);
  const int slot = check_state_list(op, "exp_avgs", updated, exp_avgs, call.args(), 0);
  check_state_list(op, "exp_avg_sqs", updated, exp_avg_sqs, call.args(), slot);
  auto step_ptrs = checked_steps(op, params, steps);
  const Scalars scalars(op, device, lr, lr_tensor, grad_scale, found_inf);
  a.s = scalars.get();
  call.set(a.s);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const UpdateLists lists(op, updated, call.args());
  const int64_t n = static_cast<int64_t>(params.size());
  auto g = pointers(grads), m = pointers(exp_avgs), v = pointers(exp_avg_sqs);
  const auto sizes = sizes_of(params);
  const int64_t max_chunks = max_chunks_of(sizes);
  const at::Tensor clip_norm = device_scalar(op, "global_grad_norm", global_grad_norm, device);
  std::optional<SumsScratch> grad_sq;
  if (a.max_grad_norm > 0.f && clip_norm.defined()) {
    a.grad_norm = clip_norm.data_ptr<float>();
  } else if (a.max_grad_norm > 0.f) {  // the norm of this call's grads: all chunks summed as one
    grad_sq.emplace(device, n, max_chunks, 1);
    cuda::sum_squares_launch(lists.dtypes.grads, n, g.data(), sizes.data(), nullptr, grad_sq->sums, stream);
    cuda::sum_chunks_launch(1, 1, {grad_sq->sums.partials, n * max_chunks, grad_sq->sums.out}, stream);
    a.grad_sq = grad_sq->sums.out;
  }
  SumsScratch norms(device, a.trust_ratio || phase.sums_only ? n : 0, max_chunks, 2);
  cuda::lamb_launch(lists.dtypes, n, lists.values.data(), g.data(), m.data(), v.data(), lists.model_list(),
                    step_ptrs.data(), call.absmaxes(), sizes.data(), a, norms.sums, phase, stream);
  if (phase.sums_only) return;
  finish_grads(grads, grad_scale);
  call.finish(found_inf);
}

void lamb_call(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList steps, at::TensorList master_params, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode, double max_grad_norm,
               bool use_nvlamb, bool trust_clip, const OptTensor& global_grad_norm, const OptTensor& norm_sums,
               bool sums_only, const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf,
               const MaybeCompact& compact) {
  cuda::LambArgs a;
  static_cast<LambOptions&>(a) = lamb_options(beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
                                              adam_w_mode, max_grad_norm, use_nvlamb, trust_clip);
  run_lamb_cuda("lamb_", params, grads, exp_avgs, exp_avg_sqs, steps, master_params, a, lr, global_grad_norm,
                norm_sums, sums_only, lr_tensor, grad_scale, found_inf, compact);
}

void colossal_lamb_call(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params, double lr,
                        double beta1, double beta2, double eps, double weight_decay, bool adam, bool bias_correction,
                        const OptTensor& norm_sums, bool sums_only, const OptTensor& lr_tensor,
                        const OptTensor& grad_scale, const OptTensor& found_inf, const MaybeCompact& compact) {
  cuda::LambArgs a;
  static_cast<LambOptions&>(a) = colossal_lamb_options(beta1, beta2, eps, weight_decay, adam, bias_correction);
  run_lamb_cuda("colossal_lamb_", params, grads, exp_avgs, exp_avg_sqs, steps, master_params, a, lr, std::nullopt,
                norm_sums, sums_only, lr_tensor, grad_scale, found_inf, compact);
}

// The list ops and their compact twins (the schemas' argument order, csrc/host/update_ops.h).
void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
              at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum,
              const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  sgd_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, dampening, weight_decay, nesterov,
           maximize, wd_after_momentum, lr_tensor, grad_scale, found_inf, {});
}

void sgd_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                      at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                      const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                      double weight_decay, bool nesterov, bool maximize, bool wd_after_momentum, bool stochastic_state,
                      bool stochastic_params, c10::IntArrayRef element_offsets, const OptTensor& lr_tensor,
                      const OptTensor& grad_scale,
                      const OptTensor& found_inf) {
  sgd_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, dampening, weight_decay, nesterov,
           maximize, wd_after_momentum, lr_tensor, grad_scale, found_inf, CompactInputs{absmaxes, rounding_keys,
           stochastic_state, stochastic_params, element_offsets});
}

void sign_sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                   at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, const OptTensor& lr_tensor,
                   const OptTensor& grad_scale, const OptTensor& found_inf) {
  sign_sgd_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, dampening, weight_decay,
                nesterov, lr_tensor, grad_scale, found_inf, {});
}

void sign_sgd_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                           at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                           const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                           double weight_decay, bool nesterov, bool stochastic_state, bool stochastic_params,
                           c10::IntArrayRef element_offsets,
                           const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  sign_sgd_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, dampening, weight_decay,
                nesterov, lr_tensor, grad_scale, found_inf, CompactInputs{absmaxes, rounding_keys, stochastic_state,
                stochastic_params, element_offsets});
}

void lars_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
               at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
               double dampening, double weight_decay, bool nesterov, double trust_coefficient, double eps,
               bool trust_clip, bool always_adapt, const OptTensor& norm_sums, bool sums_only,
               const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  lars_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, dampening, weight_decay, nesterov,
            trust_coefficient, eps, trust_clip, always_adapt, norm_sums, sums_only, lr_tensor, grad_scale, found_inf,
            {});
}

void lars_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                       at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                       const c10::List<bool>& first_step, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov, double trust_coefficient, double eps, bool trust_clip,
                       bool always_adapt, const OptTensor& norm_sums, bool sums_only, bool stochastic_state,
                       bool stochastic_params, c10::IntArrayRef element_offsets, const OptTensor& lr_tensor,
                       const OptTensor& grad_scale,
                       const OptTensor& found_inf) {
  lars_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, dampening, weight_decay, nesterov,
            trust_coefficient, eps, trust_clip, always_adapt, norm_sums, sums_only, lr_tensor, grad_scale, found_inf,
            CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets});
}

void colossal_lars_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                        at::TensorList master_params, const c10::List<bool>& first_step, double lr, double momentum,
                        double eeta, double weight_decay, double epsilon, bool lars, const OptTensor& norm_sums,
                        bool sums_only, const OptTensor& lr_tensor, const OptTensor& grad_scale,
                        const OptTensor& found_inf) {
  colossal_lars_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, eeta, weight_decay,
                     epsilon, lars, norm_sums, sums_only, lr_tensor, grad_scale, found_inf, {});
}

void colossal_lars_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                                at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                                const c10::List<bool>& first_step, double lr, double momentum, double eeta,
                                double weight_decay, double epsilon, bool lars, const OptTensor& norm_sums,
                                bool sums_only, bool stochastic_state, bool stochastic_params,
                                c10::IntArrayRef element_offsets,
                                const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  colossal_lars_call(params, grads, momentum_buffers, master_params, first_step, lr, momentum, eeta, weight_decay,
                     epsilon, lars, norm_sums, sums_only, lr_tensor, grad_scale, found_inf,
                     CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets});
}

void adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList master_params, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
               bool bias_correction, double div_scale, const OptTensor& lr_tensor, const OptTensor& grad_scale,
               const OptTensor& found_inf) {
  adam_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps,
            weight_decay, amsgrad, decoupled, maximize, bias_correction, div_scale, lr_tensor, grad_scale, found_inf,
            {});
}

void adam_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                       at::TensorList max_exp_avg_sqs, at::TensorList steps, at::TensorList master_params,
                       at::TensorList absmaxes, at::TensorList rounding_keys, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool amsgrad, bool decoupled, bool maximize,
                       bool bias_correction, double div_scale, bool stochastic_state, bool stochastic_params,
                       c10::IntArrayRef element_offsets, const OptTensor& lr_tensor,
                       const OptTensor& grad_scale, const OptTensor& found_inf) {
  adam_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps,
            weight_decay, amsgrad, decoupled, maximize, bias_correction, div_scale, lr_tensor, grad_scale, found_inf,
            CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets});
}

void lamb_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList steps, at::TensorList master_params, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode, double max_grad_norm,
               bool use_nvlamb, bool trust_clip, const OptTensor& global_grad_norm, const OptTensor& norm_sums,
               bool sums_only, const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  lamb_call(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
            bias_correction, grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, trust_clip, global_grad_norm,
            norm_sums, sums_only, lr_tensor, grad_scale, found_inf, {});
}

void lamb_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                       at::TensorList steps, at::TensorList master_params, at::TensorList absmaxes,
                       at::TensorList rounding_keys, double lr, double beta1, double beta2, double eps,
                       double weight_decay, bool bias_correction, bool grad_averaging, bool adam_w_mode,
                       double max_grad_norm, bool use_nvlamb, bool trust_clip, const OptTensor& global_grad_norm,
                       const OptTensor& norm_sums, bool sums_only, bool stochastic_state, bool stochastic_params,
                       c10::IntArrayRef element_offsets,
                       const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  lamb_call(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
            bias_correction, grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb, trust_clip, global_grad_norm,
            norm_sums, sums_only, lr_tensor, grad_scale, found_inf,
            CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets});
}

void colossal_lamb_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params, double lr,
                        double beta1, double beta2, double eps, double weight_decay, bool adam, bool bias_correction,
                        const OptTensor& norm_sums, bool sums_only, const OptTensor& lr_tensor,
                        const OptTensor& grad_scale, const OptTensor& found_inf) {
  colossal_lamb_call(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
                     adam, bias_correction, norm_sums, sums_only, lr_tensor, grad_scale, found_inf, {});
}

void colossal_lamb_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                                at::TensorList exp_avg_sqs, at::TensorList steps, at::TensorList master_params,
                                at::TensorList absmaxes, at::TensorList rounding_keys, double lr, double beta1,
                                double beta2, double eps, double weight_decay, bool adam, bool bias_correction,
                                const OptTensor& norm_sums, bool sums_only, bool stochastic_state,
                                bool stochastic_params, c10::IntArrayRef element_offsets, const OptTensor& lr_tensor,
                                const OptTensor& grad_scale,
                                const OptTensor& found_inf) {
  colossal_lamb_call(params, grads, exp_avgs, exp_avg_sqs, steps, master_params, lr, beta1, beta2, eps, weight_decay,
                     adam, bias_correction, norm_sums, sums_only, lr_tensor, grad_scale, found_inf,
                     CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets});
}

void lion_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList master_params,
               double lr, double beta1, double beta2, double weight_decay, const OptTensor& lr_tensor,
               const OptTensor& grad_scale, const OptTensor& found_inf) {
  lion_call(params, grads, exp_avgs, master_params, lr, beta1, beta2, weight_decay, lr_tensor, grad_scale, found_inf,
            {});
}

void lion_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys, double lr,
                       double beta1, double beta2, double weight_decay, bool stochastic_state, bool stochastic_params,
                       c10::IntArrayRef element_offsets,
                       const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  lion_call(params, grads, exp_avgs, master_params, lr, beta1, beta2, weight_decay, lr_tensor, grad_scale, found_inf,
            CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params, element_offsets});
}

void adagrad_cuda(at::TensorList params, at::TensorList grads, at::TensorList sums, at::TensorList steps,
                  at::TensorList master_params, double lr, double lr_decay, double weight_decay, double eps,
                  bool maximize, const OptTensor& lr_tensor, const OptTensor& grad_scale, const OptTensor& found_inf) {
  adagrad_call(params, grads, sums, steps, master_params, lr, lr_decay, weight_decay, eps, maximize, lr_tensor,
               grad_scale, found_inf, {});
}

void adagrad_compact_cuda(at::TensorList params, at::TensorList grads, at::TensorList sums, at::TensorList steps,
                          at::TensorList master_params, at::TensorList absmaxes, at::TensorList rounding_keys,
                          double lr, double lr_decay, double weight_decay, double eps, bool maximize,
                          bool stochastic_state, bool stochastic_params, c10::IntArrayRef element_offsets,
                          const OptTensor& lr_tensor,
                          const OptTensor& grad_scale, const OptTensor& found_inf) {
  adagrad_call(params, grads, sums, steps, master_params, lr, lr_decay, weight_decay, eps, maximize, lr_tensor,
               grad_scale, found_inf, CompactInputs{absmaxes, rounding_keys, stochastic_state, stochastic_params,
               element_offsets});
}

// Σx² of every tensor (any floating dtypes, one CUDA device), in double, on the device.
at::Tensor squares_per_tensor(const char* op, at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), op, ": needs at least one tensor");
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device() == device, op, ": tensors[", i, "] is on ", tensors[i].device(),
                " but tensors[0] is on ", device, "; one call reads tensors of one device");
    dtype_of(op, tensors[i].scalar_type());
    inputs.push_back(tensors[i].contiguous());
  }
  const int64_t n = static_cast<int64_t>(inputs.size());
  const auto sizes = sizes_of(inputs);
  SumsScratch scratch(device, n, max_chunks_of(sizes), 1);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (const auto type : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {  // one launch sequence per dtype
    std::vector<void*> ptrs;
    std::vector<int64_t> ss;
    std::vector<int32_t> index;
    for (int64_t t = 0; t < n; ++t) {
      if (inputs[t].scalar_type() != type) continue;
      ptrs.push_back(inputs[t].data_ptr());
      ss.push_back(sizes[t]);
      index.push_back(static_cast<int32_t>(t));
    }
    if (!ptrs.empty()) {
      cuda::sum_squares_launch(dtype_of(op, type), static_cast<int64_t>(ptrs.size()), ptrs.data(), ss.data(),
                               index.data(), scratch.sums, stream);
    }
  }
  cuda::sum_chunks_launch(1, n, scratch.sums, stream);
  return scratch.out;
}

std::tuple<at::Tensor, at::Tensor> l2norm_cuda(at::TensorList tensors) {
  const at::Tensor squares = squares_per_tensor("fused_optim::l2norm", tensors);
  const bool any_double =
      std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.scalar_type() == at::kDouble; });
  at::Tensor per_tensor = squares.sqrt(), global = squares.sum().sqrt();
  if (!any_double) return {global.to(at::kFloat), per_tensor.to(at::kFloat)};
  return {global, per_tensor};
}

// sums[index[i]] += Σx² of tensors[i], each run of equal consecutive indices added at once.
void sum_squares_cuda(const at::Tensor& sums, at::TensorList tensors, c10::IntArrayRef index) {
  const char* op = "fused_optim::sum_squares_";
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.dim() == 1 && sums.is_contiguous(), op,
              ": sums must be a contiguous 1-D float64 tensor, got ", sums.scalar_type(), " of shape ", sums.sizes());
  check_sums_index(op, "tensor", tensors.size(), index, sums.numel());
  if (tensors.empty()) return;
  const at::Tensor squares = squares_per_tensor(op, tensors).to(sums.device());
  for (size_t begin = 0, end = 0; begin < index.size(); begin = end) {
    while (end < index.size() && index[end] == index[begin]) ++end;
    sums.narrow(0, index[begin], 1).add_(squares.narrow(0, begin, end - begin).sum());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(FUSED_OPTIM_CUDA_LIBRARY, FUSED_OPTIM_CUDA_KEY, m) {
  m.impl("l2norm", &l2norm_cuda);
  m.impl("sum_squares_", &sum_squares_cuda);
#define FUSED_OPTIM_REGISTER_CUDA(name) m.impl(#name "_", &name##_cuda);
  FUSED_OPTIM_UPDATE_OPS(FUSED_OPTIM_REGISTER_CUDA)
#undef FUSED_OPTIM_REGISTER_CUDA
#define FUSED_OPTIM_REGISTER_COMPACT(name) m.impl(#name "_compact_", &name##_compact_cuda);
  FUSED_OPTIM_COMPACT_OPS(FUSED_OPTIM_REGISTER_COMPACT)
#undef FUSED_OPTIM_REGISTER_COMPACT
}

#ifdef FUSED_OPTIM_EMULATED_LAUNCH
// The emulated library's count of kernel launches (csrc/emulation/cuda_runtime.h): tests count
// the device passes of a step with it.
TORCH_LIBRARY_FRAGMENT(FUSED_OPTIM_CUDA_LIBRARY, m) {
  m.def("emulated_launches() -> int", [] { return static_cast<int64_t>(emulation::launches.load()); });
}
#endif

}  // namespace fused_optim
