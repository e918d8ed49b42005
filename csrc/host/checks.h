// Argument checks shared by the CPU and CUDA implementations of every op (csrc/host: the host code
// of both devices' ops, on ATen core; the torch-free math is csrc/shared). Tensors an op updates
// must be contiguous (we never update a copy) and on params[0]'s device; the grads, which an op
// only reads or (a scaled step) overwrites with their unscaled values, may be anything dense and
// are made contiguous here (ContiguousTensors: copies go back with copy_back()).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/MaybeOwned.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

namespace fused_optim {

// The index of sum_squares_-like ops: one entry per tensor (`what`: "tensor", "param"), each an
// element of sums (of `sums_size` elements).
inline void check_sums_index(const char* op, const char* what, size_t count, c10::IntArrayRef index,
                             int64_t sums_size) {
  TORCH_CHECK(index.size() == count, op, ": index has ", index.size(), " entries for ", count, " ", what,
              "s; give one index per ", what);
  for (size_t i = 0; i < index.size(); ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < sums_size, op, ": index[", i, "] = ", index[i],
                " is out of range for sums of size ", sums_size);
  }
}

inline void check_same_size(const char* op, const char* what, at::TensorList ref, at::TensorList other) {
  TORCH_CHECK(other.size() == ref.size(), "fused_optim::", op, ": ", what, " has ", other.size(),
              " tensors but params has ", ref.size());
}

// The tensors `ts` an op updates in place, one per param: on params[0]'s device, dense and
// contiguous, of their param's dtype and size. `state`: they are the state of a list op, one per
// value (`params` are the values: the params, or their masters), and a dtype error names the op's
// compact twin, the op for the compact formats.
inline void check_mutable(const char* op, const char* what, at::TensorList params, at::TensorList ts,
                          bool state = false) {
  check_same_size(op, what, params, ts);
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    TORCH_CHECK(t.device() == params[0].device(), "fused_optim::", op, ": ", what, "[", i, "] is on ", t.device(),
                " but params[0] is on ", params[0].device(), "; one call updates tensors of one device");
    TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), "fused_optim::", op, ": ", what, "[", i,
                "] must be a dense contiguous tensor (it is updated in place)");
    TORCH_CHECK(t.scalar_type() == params[i].scalar_type(), "fused_optim::", op, ": ", what, "[", i, "] has dtype ",
                t.scalar_type(), " but ", state ? "the value it belongs to (param or master)" : "its param", " has ",
                params[i].scalar_type(),
                state ? "; this op takes state in its values' dtype, the compact formats (bf16 or 8-bit state, fp32 "
                        "state of fp16/bf16 params) its compact twin, "
                      : "",
                state ? op : "", state ? "compact_" : "");
    TORCH_CHECK(t.numel() == params[i].numel(), "fused_optim::", op, ": ", what, "[", i, "] has ", t.numel(),
                " elements but its param has ", params[i].numel());
  }
}

// The inputs of one op call that are read (grads, the norm op's tensors), contiguous: the
// caller's tensors where they already are (borrowed: they outlive the call, and no Tensor handle
// is copied), contiguous copies where not. An update that wrote its grads back unscaled (into the
// copies too) calls copy_back().
class ContiguousTensors {
 public:
  explicit ContiguousTensors(at::TensorList sources) : sources_(sources) {
    tensors_.reserve(sources.size());
    for (const auto& t : sources) tensors_.push_back(t.expect_contiguous());
  }
  const at::Tensor& operator[](size_t i) const { return *tensors_[i]; }
  size_t size() const { return tensors_.size(); }
  // Each contiguous copy written into the caller's tensor it was made from.
  void copy_back() const {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (!tensors_[i].unsafeIsBorrowed()) sources_[i].copy_(*tensors_[i]);
    }
  }

 private:
  at::TensorList sources_;
  std::vector<c10::MaybeOwned<at::Tensor>> tensors_;
};

// Checks the grads against their params (dtype, shape, device, dense) and returns them contiguous.
// `written`: the update writes them back unscaled (a step given a grad_scale), so none may have
// elements sharing memory (an expanded tensor): refused here, before anything is written.
inline ContiguousTensors checked_grads(const char* op, at::TensorList params, at::TensorList grads, bool written) {
  check_same_size(op, "grads", params, grads);
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    TORCH_CHECK(g.layout() == at::kStrided, "fused_optim::", op, ": grads[", i,
                "] is sparse; fused_optim does not support sparse gradients (use torch.optim.SparseAdam)");
    TORCH_CHECK(g.scalar_type() == params[i].scalar_type() && g.sizes() == params[i].sizes() &&
                    g.device() == params[i].device(),
                "fused_optim::", op, ": grads[", i, "] (", g.scalar_type(), ", shape ", g.sizes(), ", ", g.device(),
                ") does not match its param (", params[i].scalar_type(), ", shape ", params[i].sizes(), ", ",
                params[i].device(), ")");
    TORCH_CHECK(!written || at::has_internal_overlap(g) != at::MemOverlap::Yes, "fused_optim::", op, ": grads[", i,
                "] has elements that share memory (an expanded tensor), and a step with a grad_scale writes the "
                "unscaled grads back into it; give the param a grad of its own (p.grad = p.grad.clone())");
  }
  return ContiguousTensors(grads);
}

// The params of an update op: `model`, the params as the caller holds them (their grads have
// their dtype), and `masters`, empty or their fp32 master weights (master_params: one per fp16 or
// bf16 param). The update reads and writes values(): the masters when given, and writes each
// param as its master rounded to nearest even. Every state tensor has values()' dtype.
struct UpdatedParams {
  at::TensorList model, masters;
  at::TensorList values() const { return masters.empty() ? model : masters; }
};

// Checks the params (and their masters, if any) of an update op.
inline UpdatedParams checked_params(const char* op, at::TensorList params, at::TensorList masters) {
  check_mutable(op, "params", params, params);
  if (!masters.empty()) {
    check_same_size(op, "master_params", params, masters);
    for (size_t i = 0; i < masters.size(); ++i) {
      const auto& m = masters[i];
      TORCH_CHECK(params[i].scalar_type() == at::kHalf || params[i].scalar_type() == at::kBFloat16, "fused_optim::",
                  op, ": master_params are for float16/bfloat16 params, but params[", i, "] is ",
                  params[i].scalar_type(), "; pass master_params empty");
      TORCH_CHECK(m.scalar_type() == at::kFloat && m.device() == params[0].device() && m.layout() == at::kStrided &&
                      m.is_contiguous() && m.numel() == params[i].numel(),
                  "fused_optim::", op, ": master_params[", i, "] must be a contiguous float32 tensor of its param's ",
                  params[i].numel(), " elements on ", params[0].device(), " (got ", m.scalar_type(), ", ",
                  m.numel(), " elements on ", m.device(), ")");
    }
  }
  return {params, masters};
}

// The phased calls of the layer-wise ops (lars_, colossal_lars_, lamb_, colossal_lamb_), whose
// norm_sums holds row t = (S_p, S_x) of params[t]: a contiguous float64 [n, 2] tensor on the
// params' device. Returns its data, or nullptr without norm_sums (one call; sums_only needs it).
inline double* checked_norm_sums(const char* op, const std::optional<at::Tensor>& norm_sums, bool sums_only,
                                 at::TensorList params) {
  if (!norm_sums.has_value() || !norm_sums->defined()) {
    TORCH_CHECK(!sums_only, "fused_optim::", op, ": sums_only=True needs norm_sums, the float64 [", params.size(),
                ", 2] tensor it writes the per-tensor sums into");
    return nullptr;
  }
  const at::Tensor& s = *norm_sums;
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(s.scalar_type() == at::kDouble && s.dim() == 2 && s.size(0) == n && s.size(1) == 2 &&
                  s.layout() == at::kStrided && s.is_contiguous() && (n == 0 || s.device() == params[0].device()),
              "fused_optim::", op, ": norm_sums must be a contiguous float64 tensor of shape [", n,
              ", 2] (one row per param) on the params' device, got ", s.scalar_type(), " of shape ", s.sizes(),
              (s.is_contiguous() ? "" : " (not contiguous)"), " on ", s.device());
  return s.data_ptr<double>();
}

}  // namespace fused_optim
