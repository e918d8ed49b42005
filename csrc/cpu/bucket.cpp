// The bucket registry's ops, which Python calls when it makes or drops a plan's bucket:
// bucket_new / bucket_free keep a bucket's lists between steps, bucket_grads_match looks at its
// params' grads. What a twin runs on each step is bucket.h's. The ops are registered for
// CompositeExplicitAutograd: they take no tensor to dispatch on.
#include "bucket.h"

#include <c10/util/Exception.h>

namespace fused_optim {
namespace {

int64_t bucket_new(at::TensorList tensors, c10::IntArrayRef lengths) {
  auto lists = std::make_shared<TensorLists>();
  size_t offset = 0;
  for (const int64_t n : lengths) {
    TORCH_CHECK(n >= 0 && offset + n <= tensors.size(), "fused_optim::bucket_new: lengths exceed the tensors");
    lists->emplace_back(tensors.begin() + offset, tensors.begin() + offset + n);
    offset += n;
  }
  TORCH_CHECK(offset == tensors.size(), "fused_optim::bucket_new: lengths do not add up to the tensors");
  std::lock_guard<std::mutex> lock(bucket_registry.mutex);
  bucket_registry.lists.emplace(bucket_registry.next_id, std::move(lists));
  return bucket_registry.next_id++;
}

void bucket_free(int64_t id) {
  std::lock_guard<std::mutex> lock(bucket_registry.mutex);
  bucket_registry.lists.erase(id);
}

// Whether every param of the bucket has a dense grad of its shape and dtype (a twin call with them
// cannot fail on its grads).
bool bucket_grads_match(int64_t id) {
  for (const auto& p : (*get_bucket(id))[0]) {
    const at::Tensor& g = p.mutable_grad();
    if (!g.defined() || g.layout() != c10::kStrided || g.sizes() != p.sizes() || g.scalar_type() != p.scalar_type()) {
      return false;
    }
  }
  return true;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  m.impl("bucket_new", &bucket_new);
  m.impl("bucket_free", &bucket_free);
  m.impl("bucket_grads_match", &bucket_grads_match);
}

}  // namespace fused_optim
