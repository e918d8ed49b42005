// AdaScale's gradient norms, in C++ (no Python, no GIL per parameter and backward pass), for params
// on any device with a fused_optim::sum_squares_ kernel (called through the dispatcher):
//   grad_norm_hooks(params, index, sums, counts) registers on params[i] a hook that, for each
//   micro-batch gradient g of it, does  sums[index[i]] += Σ g²  (as sum_squares_ would; CPU grads
//   without the dispatcher and its allocations) and counts the backward passes it
//   sees: counts = [backward passes, autograd graph task id of the last one, window length w,
//   window handle]; a hook running in a graph task other than the last one counted starts a new
//   backward pass. The pass that brings the count to w (w > 0) ends the window: at the end of that
//   backward pass, after every callback already queued (DDP's gradient all-reduce among them),
//   fused_optim::adascale_window_end(counts) runs (a Python op: AdaScale's statistics). Returns
//   each hook's position; remove_grad_hooks(params, positions) removes them again.
//   grad_sum_squares_(sums, params, index):  sums[index[i]] += Σ params[i].grad²  for the params
//   that have a grad (read here: Python would wrap each .grad in a new object, ~1 µs a param).
#include "../host/checks.h"
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/macros/Export.h>
#include <torch/csrc/autograd/engine.h>  // queue_callback; get_current_graph_task_id (graph_task.h)
#include <torch/library.h>

#include <array>
#include <mutex>

namespace fused_optim {
namespace {

// Backward passes on several devices run hooks on several engine threads.
std::mutex hooks_mutex;

void sum_squares(const at::Tensor& sums, at::TensorList tensors, c10::IntArrayRef index) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fused_optim::sum_squares_", "")
                             .typed<void(const at::Tensor&, at::TensorList, c10::IntArrayRef)>();
  op.call(sums, tensors, index);
}

// Runs fused_optim::adascale_window_end(counts) at the end of the current backward pass. Queued
// from the pass's first hook, the callback queues itself again, so it runs after the callbacks that
// hooks queue later in the pass (DDP queues its all-reduce's completion at its last bucket).
void queue_window_end(const at::Tensor& counts) {
  auto& engine = torch::autograd::Engine::get_default_engine();
  engine.queue_callback([counts, &engine] {
    engine.queue_callback([counts] {
      static const auto op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fused_optim::adascale_window_end", "")
                                 .typed<void(const at::Tensor&)>();
      op.call(counts);
    });
  });
}

void add_grad_squares(const at::Tensor& sums, const at::Tensor& counts, int64_t index, const at::Tensor& grad) {
  std::lock_guard<std::mutex> lock(hooks_mutex);
  if (grad.device().is_cpu()) {  // (sums is then on the CPU too: checked at registration)
    sums.mutable_data_ptr<double>()[index] += squares_cpu(grad, "fused_optim::grad_norm_hooks");
  } else {
    const std::array<at::Tensor, 1> grads{grad};
    sum_squares(sums, grads, c10::IntArrayRef(&index, 1));
  }
  int64_t* count = counts.mutable_data_ptr<int64_t>();
  const int64_t task = torch::autograd::get_current_graph_task_id();
  if (count[1] != task) {
    count[1] = task;
    count[0] += 1;
    if (count[0] == count[2]) queue_window_end(counts);
  }
}

std::vector<int64_t> grad_norm_hooks(at::TensorList params, c10::IntArrayRef index, const at::Tensor& sums,
                                     const at::Tensor& counts) {
  const char* op = "fused_optim::grad_norm_hooks";
  check_sums_index(op, "param", params.size(), index, sums.numel());
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.numel() == 4 &&
                  counts.is_contiguous(),
              op, ": counts must be a contiguous int64 CPU tensor of 4 elements");
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.dim() == 1 && sums.is_contiguous(), op,
              ": sums must be a contiguous 1-D float64 tensor");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].requires_grad(), op, ": params[", i, "] does not require grad; hook only those that do");
    TORCH_CHECK(params[i].device() == sums.device(), op, ": params[", i, "] is on ", params[i].device(),
                " and sums on ", sums.device(), "; give sums the params' device");
  }
  std::vector<int64_t> positions;
  positions.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    positions.push_back(params[i].register_hook(
        [sums, counts, group = index[i]](const at::Tensor& grad) { add_grad_squares(sums, counts, group, grad); }));
  }
  return positions;
}

void remove_grad_hooks(at::TensorList params, c10::IntArrayRef positions) {
  TORCH_CHECK(positions.size() == params.size(), "fused_optim::remove_grad_hooks: ", positions.size(),
              " positions for ", params.size(), " params");
  for (size_t i = 0; i < params.size(); ++i) params[i].remove_hook(static_cast<unsigned>(positions[i]));
}

void grad_sum_squares_(const at::Tensor& sums, at::TensorList params, c10::IntArrayRef index) {
  check_sums_index("fused_optim::grad_sum_squares_", "param", params.size(), index, sums.numel());
  std::vector<at::Tensor> grads;
  std::vector<int64_t> grad_index;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].grad().defined()) {
      grads.push_back(params[i].grad());
      grad_index.push_back(index[i]);
    }
  }
  if (!grads.empty()) sum_squares(sums, grads, grad_index);
}

}  // namespace

// For CompositeExplicitAutograd: the norms call sum_squares_ for their tensors' device.
TORCH_LIBRARY_IMPL(fused_optim, CompositeExplicitAutograd, m) {
  m.impl("grad_norm_hooks", &grad_norm_hooks);
  m.impl("remove_grad_hooks", &remove_grad_hooks);
  m.impl("grad_sum_squares_", &grad_sum_squares_);
}

}  // namespace fused_optim
