// The host entry points of the CUDA kernels, in CUDA-only terms: tensors as pointers and element
// counts, per-step scalars as device pointers (read by the kernels, never by the host: a step
// does no host sync and can be captured in a CUDA graph). The torch binding (binding.cpp) calls
// these; the kernels (*.cu) compile with nvcc alone, without torch headers.
//
// Lists: `pointers`-style arguments hold one pointer per tensor, `sizes[t]` the element count of
// tensor t in every list, `index[t]` (nullable: t) its index in the caller's lists, which is where
// per-tensor values (norms, sums) are read and written.
#pragma once

#include <cuda_runtime.h>

#include "../shared/lamb_math.h"
#include "../shared/sgd_math.h"
#include "../shared/state_codes.h"

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace fused_optim {
namespace cuda {

enum class DType { kFloat, kDouble, kHalf, kBFloat16 };

// The dtypes of an update's lists: the grads (and the params as the caller holds them), the values
// updated (the params, or their float32 master weights) and the optimizer state (today the
// values' dtype). With master weights (values != grads) the params form a write-only list, each
// written as its master rounded to nearest even, in the same pass (the `model` lists below;
// nullptr without masters). The kernels exist for one dtype, and for fp16/bf16 grads with fp32
// values and state (multi_tensor_apply.cuh's dispatch_update). Compact updates (the <op>compact_
// ops) add the moments' format (bf16 or 8-bit codes of fp32 moments) and whether bf16 params
// without masters are rounded stochastically (compact_state.cuh).
struct UpdateDTypes {
  DType grads, values, state;
  StateFormat format = StateFormat::kPlain;
  bool stochastic_params = false;

  static UpdateDTypes of(DType params, bool masters) {
    const DType values = masters ? DType::kFloat : params;
    return {params, values, values};
  }
  bool masters() const { return values != grads; }
  bool compact() const { return format != StateFormat::kPlain || stochastic_params; }
  // The dtypes of the values as stored, for the passes that only read values and grads (norms).
  UpdateDTypes storage() const { return {grads, values, state}; }
};

// Elements per chunk of the launcher (one block each); per-chunk partial sums are laid out by it.
constexpr int64_t kChunkSize = 65536;

inline int64_t chunks_of(int64_t size) { return (size + kChunkSize - 1) / kChunkSize; }

// The `pointers` argument of the launchers: the lists' n pointers each, one list after another;
// absent lists (nullptr: no max_exp_avg_sqs, no model params without masters) are left out.
inline std::vector<void*> concat_lists(int64_t n, std::initializer_list<void* const*> lists) {
  std::vector<void*> pointers;
  pointers.reserve(n * lists.size());
  for (void* const* list : lists) {
    if (list != nullptr) pointers.insert(pointers.end(), list, list + n);
  }
  return pointers;
}

// The scalars every update op reads on the device. Hyperparameters travel as doubles, as the ops
// take them: fp64 params are updated with them unrounded (kernels convert them to their opmath).
struct DeviceScalars {
  const float* lr = nullptr;  // the lr tensor, or nullptr: lr_value
  double lr_value = 0.0;
  const float* grad_scale = nullptr;  // grads are divided by it; nullptr: 1
  const float* found_inf = nullptr;   // non-zero: nothing changes, step counters included; nullptr: 0
  // Compact updates (compact_state.cuh): each tensor's rounding key of this step, by the caller's
  // tensor index (nullptr without stochastic rounding), and whether bf16 state rounds stochastically.
  const int64_t* rounding_keys = nullptr;
  // Each tensor's element offset (compact_args.h; nullptr: all 0), by the caller's tensor index.
  const int64_t* element_offsets = nullptr;
  bool stochastic_state = false;
};

// The absmax lists of a compact update's 8-bit state lists (`absmaxes`, list-major: state list k's
// tensor t at [k * n + t], as the <op>compact_ ops take them), or nullptr for state that is not
// 8-bit: the list of state list k, or nullptr.
inline void* const* absmax_list(void* const* absmaxes, int64_t n, int k) {
  return absmaxes != nullptr ? absmaxes + k * n : nullptr;
}

// Per-tensor sums over chunks: a block writes partials[(t * max_chunks + chunk) * lists + k]
// (zeroed by the caller), sum_chunks_launch adds them up per tensor, in a fixed order, into
// out[t * lists + k]. Sums are of squares, in double.
struct ChunkSums {
  double* partials;
  int64_t max_chunks;  // the most chunks a tensor of the call has
  double* out;
};

// norm.cu: the chunk partials of Σx² of one list of one dtype.
void sum_squares_launch(DType dtype, int64_t n, void* const* pointers, const int64_t* sizes, const int32_t* index,
                        const ChunkSums& sums, cudaStream_t stream);
// norm.cu: the chunk partials of Σv² and Σg² (2 lists) of an update's values and grads.
void value_grad_squares_launch(const UpdateDTypes& dtypes, int64_t n, void* const* values, void* const* grads,
                               const int64_t* sizes, const ChunkSums& sums, cudaStream_t stream);
// out[t * lists + k] = Σ_chunk partials, for tensors t < n; nothing is written when found_inf
// (nullable) is set.
void sum_chunks_launch(int lists, int64_t n, const ChunkSums& sums, cudaStream_t stream,
                       const float* found_inf = nullptr);

// The phased calls of the layer-wise ops (lars_, colossal_lars_, lamb_, colossal_lamb_) for
// sharded params: rows (nullptr: one call) holds rows[2t] = S_p, rows[2t + 1] = S_x of tensor t,
// the sums of squares its trust ratio takes ||p|| and ||g|| (LAMB: ||u||) from. With sums_only
// the call writes the rows and nothing else (nothing at all when found_inf is set); without, the
// update takes its per-tensor totals from the rows instead of summing its own.
struct NormSums {
  double* rows = nullptr;
  bool sums_only = false;
};

// steps.cu: steps[t] += 1 for every t, unless found_inf is set.
void increment_steps_launch(int64_t n, float* const* steps, const DeviceScalars& scalars, cudaStream_t stream);

// sgd.cu: the SGD family (the math: csrc/shared/sgd_math.h, trust_ratio.h).
using fused_optim::SgdDirection;
enum class TrustRatio { kNone, kLars, kColossal };

struct SgdArgs {
  DeviceScalars s;
  double momentum = 0.0, dampening = 0.0, weight_decay = 0.0, clamp = 0.0;
  bool nesterov = false, maximize = false, wd_after_momentum = false;
  bool first_step = false;  // the momentum buffers are set to d (torch's first step)
  // Layer-wise ratios from sq_norms[2t] = Σp², sq_norms[2t + 1] = Σg² (grads as given, scaled).
  TrustRatio trust = TrustRatio::kNone;
  const double* sq_norms = nullptr;
  double trust_coefficient = 0.0, eps = 0.0;
  bool trust_clip = false;
};

// bufs is nullptr when momentum == 0. params: the values updated (UpdateDTypes). absmaxes: the
// buffers' absmaxes with 8-bit buffers, else nullptr.
void sgd_launch(const UpdateDTypes& dtypes, SgdDirection direction, int64_t n, void* const* params,
                void* const* grads, void* const* bufs, void* const* model, void* const* absmaxes,
                const int64_t* sizes, const int32_t* index, const SgdArgs& args, cudaStream_t stream);

// adam.cu: torch.optim.Adam / AdamW; max_exp_avg_sqs is nullptr without amsgrad. Increments steps.
struct AdamArgs {
  DeviceScalars s;
  double beta1 = 0.0, beta2 = 0.0, eps = 0.0, weight_decay = 0.0;
  double div_scale = 1.0;  // ColossalAI's divisor of the grads in the update (not of those written back)
  bool decoupled = false, maximize = false, bias_correction = true;
};

// absmaxes: with 8-bit state those of exp_avgs, exp_avg_sqs[, max_exp_avg_sqs] (absmax_list), else nullptr.
void adam_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                 void* const* exp_avgs, void* const* exp_avg_sqs, void* const* max_exp_avg_sqs, void* const* model,
                 float* const* steps, void* const* absmaxes, const int64_t* sizes, const AdamArgs& args,
                 cudaStream_t stream);

// lamb.cu: lamb_ and colossal_lamb_ (see lamb.cu). Increments steps.
struct LambArgs : LambOptions {  // (csrc/shared/lamb_math.h)
  DeviceScalars s;
  // The gradient norm to clip with (max_grad_norm > 0), before unscaling: grad_norm (a float), or
  // the square root of grad_sq (a double); one of them is set when clipping.
  const float* grad_norm = nullptr;
  const double* grad_sq = nullptr;
};

// sums: per-tensor scratch for the trust ratio (2 lists), used when args.trust_ratio or
// phase.sums_only. absmaxes: with 8-bit state those of exp_avgs, exp_avg_sqs (absmax_list), else
// nullptr. phase: the sharded step's calls (NormSums); with sums_only nothing but the rows is
// written (no moments, params or step counters).
void lamb_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                 void* const* exp_avgs, void* const* exp_avg_sqs, void* const* model, float* const* steps,
                 void* const* absmaxes, const int64_t* sizes, const LambArgs& args, const ChunkSums& sums,
                 const NormSums& phase, cudaStream_t stream);

// lion.cu: Lion (the math: csrc/shared/lion_math.h). absmaxes: with 8-bit state those of
// exp_avgs (absmax_list), else nullptr.
struct LionArgs {
  DeviceScalars s;
  double beta1 = 0.0, beta2 = 0.0, weight_decay = 0.0;
};

void lion_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                 void* const* exp_avgs, void* const* model, void* const* absmaxes, const int64_t* sizes,
                 const LionArgs& args, cudaStream_t stream);

// adagrad.cu: torch.optim.Adagrad (the math: csrc/shared/adagrad_math.h). Increments steps.
// absmaxes: with 8-bit state those of sums (absmax_list), else nullptr.
struct AdagradArgs {
  DeviceScalars s;
  double lr_decay = 0.0, weight_decay = 0.0, eps = 0.0;
  bool maximize = false;
};

void adagrad_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads, void* const* sums,
                    void* const* model, float* const* steps, void* const* absmaxes, const int64_t* sizes,
                    const AdagradArgs& args, cudaStream_t stream);

// sparsified_sgd.cu: memory <- memory + lr*g/grad_scale ; p <- p - weight_decay*p (every element),
// then, per tensor, p[i] <- p[i] - memory[i] ; memory[i] <- 0 for its k indices.
// With masters, params are the masters and model[t] / model the params written from them.
void sparsified_sgd_launch(const UpdateDTypes& dtypes, int64_t n, void* const* params, void* const* grads,
                           void* const* memories, void* const* model, const int64_t* sizes,
                           const DeviceScalars& scalars, double weight_decay, cudaStream_t stream);
void sparse_apply_launch(const UpdateDTypes& dtypes, void* param, void* memory, void* model, const int64_t* indices,
                         int64_t k, const DeviceScalars& scalars, cudaStream_t stream);

}  // namespace cuda
}  // namespace fused_optim
