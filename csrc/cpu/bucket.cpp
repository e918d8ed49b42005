// The bucket registry: bucket_new / bucket_free keep a bucket's lists between steps,
// bucket_grads_match looks at its params' grads, and what a twin calls on each step (bucket.h).
// The ops are registered for CompositeExplicitAutograd: they take no tensor to dispatch on.
#include "bucket.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

namespace fused_optim {
namespace {

std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<const TensorLists>> registry;
int64_t next_id = 1;

int64_t bucket_new(at::TensorList tensors, c10::IntArrayRef lengths) {
  auto lists = std::make_shared<TensorLists>();
  size_t offset = 0;
  for (const int64_t n : lengths) {
    TORCH_CHECK(n >= 0 && offset + n <= tensors.size(), "fused_optim::bucket_new: lengths exceed the tensors");
    lists->emplace_back(tensors.begin() + offset, tensors.begin() + offset + n);
    offset += n;
  }
  TORCH_CHECK(offset == tensors.size(), "fused_optim::bucket_new: lengths do not add up to the tensors");
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace(next_id, std::move(lists));
  return next_id++;
}

void bucket_free(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(id);
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

std::shared_ptr<const TensorLists> get_bucket(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry.find(id);
  TORCH_CHECK(it != registry.end(), "fused_optim: bucket ", id, " does not exist (freed, or from another process)");
  return it->second;
}

void bump_versions(const std::vector<at::Tensor>& list) {
  for (const auto& t : list) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

// Flattened: GCC otherwise may leave each grad's reference count increment out of line, a call
// through the PLT per param and step (which it decides by the size of the translation unit).
#if defined(__GNUC__)
__attribute__((flatten))
#endif
std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) {
    const at::Tensor& g = p.mutable_grad();  // grad() also checks is_leaf for a warning: ~12 ns more
    if (!g.defined()) return {};
    grads.push_back(g);
  }
  return grads;
}

TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  m.impl("bucket_new", &bucket_new);
  m.impl("bucket_free", &bucket_free);
  m.impl("bucket_grads_match", &bucket_grads_match);
}

}  // namespace fused_optim
