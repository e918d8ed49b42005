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

}  // namespace fused_optim
