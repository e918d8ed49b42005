// The compact arguments of an update op's twin <name>compact_ (bf16 / 8-bit state, fp32 state of
// fp16 / bf16 params, stochastic rounding: fused_optim/state_formats.py) and their checks, shared by the CPU kernels
// (csrc/cpu/compact_state.h) and the CUDA binding (csrc/cuda/binding.cpp). ATen core only.
#pragma once

#include "checks.h"
#include "../shared/state_codes.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace fused_optim {

// What a compact op (<name>compact_) adds to its list op: the absmax tensors of its 8-bit state
// lists (list-major: slot q of tensor t at q*n + t), the params' rounding keys (int64, one per
// param, advanced by one per step), which roundings are stochastic, and each param's element
// offset: the index in its whole tensor of its first element, where the param is a contiguous
// part (a shard) of one; stochastic rounding draws an element's bits by its index in the whole
// tensor (state_codes.h), so a shard's bits are the unsharded tensor's. A list op has none: the
// CPU kernels take its state as PlainState (csrc/cpu/update_args.h), the CUDA binding as the
// CompactArgs of plain state after checking it (CompactCall).
struct CompactArgs {
  at::TensorList absmaxes, keys;
  bool stochastic_state = false, stochastic_params = false;
  StateFormat format = StateFormat::kPlain;
  std::vector<int64_t> key_values;  // read before the update
  std::vector<int64_t> offsets;     // one per param, or none: every offset 0

  bool stochastic() const { return stochastic_state || stochastic_params; }
  int64_t offset(size_t t) const { return offsets.empty() ? 0 : offsets[t]; }
};

// The format of a call's state lists (every compact list of a call has the same): that of the
// first non-empty one's dtype against the values' (params or masters).
inline StateFormat format_of(at::ScalarType state, at::ScalarType values) {
  if (state == values) return StateFormat::kPlain;
  if (state == at::kFloat && (values == at::kHalf || values == at::kBFloat16)) return StateFormat::kFp32;
  if (state == at::kBFloat16 && values != at::kDouble) return StateFormat::kBf16;
  if (state == at::kByte && values != at::kDouble) return StateFormat::k8bit;
  return StateFormat::kPlain;  // check_state_list names the mismatch
}

// Checks a state list of the call's format (dtype, device, contiguity, size) and, for 8-bit, its
// absmax tensors at `slot`; returns the next free slot.
inline int check_state_list(const char* op, const char* what, const UpdatedParams& params, at::TensorList ts,
                            const CompactArgs& c, int slot) {
  const auto values = params.values();
  check_same_size(op, what, values, ts);
  const size_t n = values.size();
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    const at::ScalarType want = c.format == StateFormat::kBf16  ? at::kBFloat16
                                : c.format == StateFormat::k8bit ? at::kByte
                                : c.format == StateFormat::kFp32 ? at::kFloat
                                                                 : values[i].scalar_type();
    TORCH_CHECK(t.device() == values[0].device() && t.layout() == at::kStrided && t.is_contiguous(), "fused_optim::",
                op, ": ", what, "[", i, "] must be a dense contiguous tensor on ", values[0].device(),
                " (it is updated in place)");
    TORCH_CHECK(t.scalar_type() == want, "fused_optim::", op, ": ", what, "[", i, "] has dtype ", t.scalar_type(),
                " but this call's state is ", want, " (its value is ", values[i].scalar_type(),
                "); every state list of a call has one format");
    TORCH_CHECK(t.numel() == values[i].numel(), "fused_optim::", op, ": ", what, "[", i, "] has ", t.numel(),
                " elements but its param has ", values[i].numel());
  }
  if (c.format != StateFormat::k8bit || ts.empty()) return slot;
  TORCH_CHECK(c.absmaxes.size() >= (slot + 1) * n, "fused_optim::", op, ": absmaxes has ", c.absmaxes.size(),
              " tensors; 8-bit state needs one per param for each 8-bit state list (", what, " is list ", slot + 1,
              ")");
  for (size_t i = 0; i < n; ++i) {
    const auto& a = c.absmaxes[slot * n + i];
    const int64_t blocks = (values[i].numel() + kQ8Block - 1) / kQ8Block;
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.device() == values[0].device() &&
                    a.numel() == blocks,
                "fused_optim::", op, ": the absmax of ", what, "[", i, "] must be a contiguous float32 tensor of ",
                blocks, " elements (one per block of ", kQ8Block, ")");
  }
  return slot + 1;
}

// What a compact twin passes besides its list op's arguments.
struct CompactInputs {
  at::TensorList absmaxes, keys;
  bool stochastic_state = false, stochastic_params = false;
  c10::IntArrayRef element_offsets;
};

// The compact arguments of a call after their checks: the format from `first` (a state list), the
// keys read. (A list op's state: PlainState, csrc/cpu/update_args.h.)
inline CompactArgs state_args(const char* op, const UpdatedParams& params, at::TensorList first,
                              const CompactInputs& in) {
  const auto& [absmaxes, keys, stochastic_state, stochastic_params, element_offsets] = in;
  CompactArgs c{absmaxes, keys, stochastic_state, stochastic_params, StateFormat::kPlain, {}, {}};
  TORCH_CHECK(element_offsets.empty() || element_offsets.size() == params.model.size(), "fused_optim::", op,
              ": element_offsets has ", element_offsets.size(), " entries for ", params.model.size(),
              " params; give one per param (or none)");
  for (size_t i = 0; i < element_offsets.size(); ++i) {
    TORCH_CHECK(element_offsets[i] >= 0, "fused_optim::", op, ": element_offsets[", i, "] = ", element_offsets[i],
                " is negative; it is the index of the param's first element in its whole tensor");
  }
  c.offsets.assign(element_offsets.begin(), element_offsets.end());
  const auto values = params.values();
  if (!first.empty()) c.format = format_of(first[0].scalar_type(), values[0].scalar_type());
  // bf16 state of bf16 params rounded stochastically: decoded and encoded like bf16 state of fp32
  if (stochastic_state && !first.empty() && first[0].scalar_type() == at::kBFloat16) c.format = StateFormat::kBf16;
  TORCH_CHECK(!stochastic_state || c.format == StateFormat::kBf16, "fused_optim::", op,
              ": stochastic_state rounds bf16 state; this call's state is not bf16");
  if (stochastic_params) {
    TORCH_CHECK(params.masters.empty() && values[0].scalar_type() == at::kBFloat16, "fused_optim::", op,
                ": stochastic_params rounds bf16 params without master weights");
  }
  if (c.stochastic()) {
    check_same_size(op, "rounding_keys", values, keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      TORCH_CHECK(keys[i].scalar_type() == at::kLong && keys[i].numel() == 1 && keys[i].is_cpu(), "fused_optim::",
                  op, ": rounding_keys[", i, "] must be a one-element int64 CPU tensor");
      c.key_values.push_back(*static_cast<const int64_t*>(keys[i].data_ptr()));
    }
  }
  return c;
}

// After the update: every param's key advanced by one.
inline void advance_keys(const CompactArgs& c) {
  if (!c.stochastic()) return;
  for (size_t i = 0; i < c.keys.size(); ++i) *static_cast<int64_t*>(c.keys[i].data_ptr()) = c.key_values[i] + 1;
}

}  // namespace fused_optim
