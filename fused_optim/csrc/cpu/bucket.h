// Buckets: tensor lists an optimizer registers once and refers to by id on every step, so a step
// passes only its grads through the dispatcher (see fused_optim/_ops.py). Thread-safe registry.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace fused_optim {

using TensorLists = std::vector<std::vector<at::Tensor>>;

// The lists of bucket `id` (throws a clear error for an unknown id).
std::shared_ptr<const TensorLists> get_bucket(int64_t id);

// Mark every tensor of the lists as modified in place (what the list ops get from the dispatcher).
void bump_versions(const TensorLists& lists);

// The .grad of each param, or an empty vector when one of them has none (then nothing may change).
std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params);

// What a bucket twin returns: whether it stepped.
constexpr int64_t kStepped = 0;
constexpr int64_t kMissingGrad = 1;

}  // namespace fused_optim
