// Buckets: tensor lists an optimizer registers once and refers to by id on every step; the
// update ops' twins read the grads from the params, so a step passes no tensor list through the
// dispatcher (see fused_optim/_ops.py). This header holds all a twin runs: the registry's lists,
// the twins, generated from their list ops' kernels, and impl_twin, which each kernel file
// registers its twins with; bucket.cpp the ops Python calls when it makes or drops a bucket
// (bucket_new, bucket_free, bucket_grads_match).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fused_optim {

using TensorLists = std::vector<std::vector<at::Tensor>>;

// The registered buckets' lists by id (one registry per library: an inline variable).
struct BucketRegistry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<const TensorLists>> lists;
  int64_t next_id = 1;
};
inline BucketRegistry bucket_registry;

// The lists of bucket `id` (throws a clear error for an unknown id).
inline std::shared_ptr<const TensorLists> get_bucket(int64_t id) {
  std::lock_guard<std::mutex> lock(bucket_registry.mutex);
  const auto it = bucket_registry.lists.find(id);
  TORCH_CHECK(it != bucket_registry.lists.end(), "fused_optim: bucket ", id,
              " does not exist (freed, or from another process)");
  return it->second;
}

// Mark every tensor of the list as modified in place (what the list ops get from the dispatcher).
inline void bump_versions(const std::vector<at::Tensor>& list) {
  for (const auto& t : list) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

// The .grad of each param, or an empty vector when one of them has none (then nothing may change).
// Out of line and flattened: inlined into a large translation unit, GCC may leave each grad's
// reference count increment out of line, a call through the PLT per param and step.
#if defined(__GNUC__)
__attribute__((noinline, flatten))
#endif
inline std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) {
    const at::Tensor& g = p.mutable_grad();  // grad() also checks is_leaf for a warning: ~12 ns more
    if (!g.defined()) return {};
    grads.push_back(g);
  }
  return grads;
}

// What a bucket twin returns: whether it stepped.
constexpr int64_t kStepped = 0;
constexpr int64_t kMissingGrad = 1;

// The body of every twin: fetch bucket `id` (`num_lists` lists, params first), read the params'
// grads, run update(lists, grads), bump the versions (the grads' too when `scaled`: given a
// grad_scale, the update writes them back unscaled). Nothing changes when a grad is missing.
template <typename Update>
int64_t step_bucket(const char* op, int64_t id, size_t num_lists, bool scaled, const Update& update) {
  const auto lists = get_bucket(id);
  TORCH_CHECK(lists->size() == num_lists, "fused_optim::", op, ": bucket ", id, " holds ", lists->size(),
              " lists, the op needs ", num_lists);
  const auto grads = grads_of((*lists)[0]);
  if (grads.size() != (*lists)[0].size()) return kMissingGrad;
  update(*lists, grads);
  for (const auto& list : *lists) bump_versions(list);
  if (scaled) bump_versions(grads);
  return kStepped;
}

// Runs op `name` on the bucket's device: cpu(params, args...) for CPU tensors, else the
// implementation registered for their device (the CUDA library's) through the dispatcher, which
// the twins, registered as CompositeExplicitAutograd, do not pass through on their own.
template <typename Fn, typename... Args>
void run_on_device(const char* name, Fn* cpu, const std::vector<at::Tensor>& params, Args&&... args) {
  if (params.empty() || params[0].is_cpu()) return cpu(params, std::forward<Args>(args)...);
  c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>().call(params, std::forward<Args>(args)...);
}

// A list op's signature void(params, grads, state lists..., scalars...) split after its leading
// tensor lists: kLists of them, then Scalars<the rest>.
template <typename... Rest>
struct Scalars {};

template <typename... Args>
struct SplitLists {
  static constexpr size_t kLists = 0;
  using Rest = Scalars<Args...>;
};

template <typename... Args>
struct SplitLists<at::TensorList, Args...> {
  static constexpr size_t kLists = 1 + SplitLists<Args...>::kLists;
  using Rest = typename SplitLists<Args...>::Rest;
};

template <typename Fn>
struct ListOpSignature;

template <typename... Args>
struct ListOpSignature<void(Args...)> : SplitLists<Args...> {};

template <typename Fn, Fn* cpu, typename Rest>
struct BucketTwin;

template <typename Fn, Fn* cpu, typename... Rest>
struct BucketTwin<Fn, cpu, Scalars<Rest...>> {
  // The bucket holds the params and the state lists: every tensor list of the op but the grads.
  static constexpr size_t kBucketLists = ListOpSignature<Fn>::kLists - 1;

  static auto make(const std::string& list_op) {
    return [twin = list_op + "bucket", qualified = "fused_optim::" + list_op](int64_t bucket, Rest... rest) {
      // Every update op ends with lr_tensor, grad_scale, found_inf (fused_optim/spec.py AMP_ARGS).
      const std::optional<at::Tensor>& grad_scale = std::get<sizeof...(Rest) - 2>(std::tie(rest...));
      return step_bucket(twin.c_str(), bucket, kBucketLists, grad_scale.has_value() && grad_scale->defined(),
                         [&](const TensorLists& l, const std::vector<at::Tensor>& grads) {
                           call(qualified.c_str(), l, grads, std::make_index_sequence<kBucketLists - 1>{}, rest...);
                         });
    };
  }

  template <size_t... I>
  static void call(const char* qualified, const TensorLists& l, const std::vector<at::Tensor>& grads,
                   std::index_sequence<I...>, Rest... rest) {
    run_on_device(qualified, cpu, l[0], grads, l[I + 1]..., rest...);
  }
};

// The twin of list op `list_op` (e.g. "sgd_", implemented on the CPU by `cpu`): the kernel of
// "<list_op>bucket"(int bucket, the op's arguments after its tensor lists) -> int. It runs
// step_bucket over the registered lists {params, state lists...} (in the op's order), calling the
// list op with the params' grads; kMissingGrad, changing nothing, when a param has none.
template <auto* cpu>
auto bucket_twin(const std::string& list_op) {
  using Fn = std::remove_pointer_t<decltype(cpu)>;
  return BucketTwin<Fn, cpu, typename ListOpSignature<Fn>::Rest>::make(list_op);
}

// Registers "<list_op>bucket", the twin of list op `list_op` implemented on the CPU by `cpu`. Each
// kernel file registers its twins so, for CompositeExplicitAutograd: a twin may take no tensor
// argument at all, and it runs the op for its bucket's device itself (run_on_device).
template <auto* cpu>
void impl_twin(torch::Library& m, const std::string& list_op) {
  m.impl((list_op + "bucket").c_str(), bucket_twin<cpu>(list_op));
}

}  // namespace fused_optim
