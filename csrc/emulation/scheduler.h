// How the CPU emulation runs a kernel launch (the CUDA surface is cuda_runtime.h here).
//
// One launch runs at a time in the process (launches from several OS threads take turns: the
// emulated GPU has one stream), its blocks one after another on the launching OS thread. A block
// runs its real threads, each CUDA thread a fiber: its own stack (with a guard page), started with
// ucontext and switched with _setjmp/_longjmp (no signal-mask system call per switch: a round trip
// takes ~60 ns, swapcontext's ~1 µs). The scheduler resumes the threads in rank order; a thread
// runs until it exits or waits:
//
//   __syncthreads()        waits until every thread of the block has arrived (the barrier's
//                          generation then advances, releasing them all);
//   warp exchanges         (__shfl_*_sync) wait until every lane named in the mask has arrived with
//                          the same shuffle and mask; then each lane reads its source lane's value.
//
// CUDA leaves misuse undefined (a hang or garbage on the GPU); here it fails the launch with
// cudaErrorLaunchFailure and a message naming the threads: a barrier reached after threads of the
// block exited, or that a thread leaves while others wait at it; a lane calling a shuffle outside
// its mask, lanes of a warp calling different shuffles or masks, a mask naming lanes that do not
// exist or have exited, a lane reading from a lane outside the mask; threads that all wait with
// nothing to release them (deadlock). The failing block is abandoned (its fibers restart from
// scratch next time) and no further block runs.
//
// __shared__ variables are statics: one copy, for the one block running. Between blocks the values
// persist (uninitialized shared memory on a GPU).
//
// Under AddressSanitizer every switch is announced (__sanitizer_start/finish_switch_fiber), so
// reports on fiber stacks are right. _FORTIFY_SOURCE must be off: its longjmp refuses to jump to
// another stack.
#pragma once

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "vector_types.h"

#if defined(__USE_FORTIFY_LEVEL) && __USE_FORTIFY_LEVEL > 0
#error "the CUDA emulation switches fibers with _longjmp, which _FORTIFY_SOURCE forbids: compile with -U_FORTIFY_SOURCE"
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FUSED_OPTIM_EMULATION_ASAN 1
#endif

namespace fused_optim {
namespace emulation {

constexpr unsigned kWarpSize = 32;
constexpr size_t kStackBytes = size_t{256} << 10;  // per CUDA thread (a kernel's frames take a few KB)

// The built-in variables of the running CUDA thread (threadIdx, blockIdx, blockDim, gridDim): a
// plain global (one launch runs at a time), read as fast as CUDA's registers.
struct Builtins {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
};
inline Builtins builtins;

enum class Wait { kNone, kBarrier, kWarp };

// One CUDA thread of the current block, on a fiber kept for the next blocks and launches.
struct Fiber {
  uint3 thread_idx{};
  unsigned rank = 0;  // x + y*blockDim.x + z*blockDim.x*blockDim.y; lane rank % 32 of warp rank / 32
  bool done = false;
  Wait wait = Wait::kNone;
  uint64_t generation = 0;  // of the barrier or warp exchange it waits for

  char* stack = nullptr;  // [stack, stack + kStackBytes), a guard page below
  jmp_buf context;        // where it was suspended
  bool started = false;   // false: (re)starts at fiber_main
  void* fake_stack = nullptr;  // AddressSanitizer's, kept across a switch

  Fiber() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* region = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (region == MAP_FAILED) throw std::bad_alloc();
    mprotect(region, page, PROT_NONE);  // an overflow faults instead of overwriting a neighbour
    stack = static_cast<char*>(region) + page;
  }
  ~Fiber() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    munmap(stack - page, kStackBytes + page);
  }
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
};

// The pending shuffle of a warp: the lanes that arrived, their values and source lanes.
struct WarpExchange {
  const char* op = nullptr;
  unsigned mask = 0, arrived = 0, exited = 0;
  uint64_t generation = 0;
  uint64_t value[kWarpSize], result[kWarpSize];
  unsigned source[kWarpSize];
};

class Scheduler {
 public:
  // Runs body() as every thread of every block of a grid, after the launches running in other OS
  // threads; returns the error message of a failed launch, or "" (see the file comment).
  template <typename Body>
  std::string run(dim3 grid, dim3 block, const Body& body) {
    const std::lock_guard<std::mutex> lock(mutex_);
    threads_ = block.x * block.y * block.z;
    while (fibers_.size() < threads_) fibers_.push_back(std::make_unique<Fiber>());
    warps_.resize((threads_ + kWarpSize - 1) / kWarpSize);
    builtins.block_dim = block;
    builtins.grid_dim = grid;
    body_ = [](const void* b) { (*static_cast<const Body*>(b))(); };
    body_arg_ = &body;
    error_.clear();
    for (unsigned z = 0; z < grid.z && error_.empty(); ++z) {
      for (unsigned y = 0; y < grid.y && error_.empty(); ++y) {
        for (unsigned x = 0; x < grid.x && error_.empty(); ++x) {
          builtins.block_idx = {x, y, z};
          run_block();
        }
      }
    }
    body_ = nullptr;
    return error_;
  }

  // __syncthreads(): every thread of the block arrives before any goes on.
  void barrier() {
    Fiber& f = *current_;
    if (exited_ != 0) {
      fail("__syncthreads() reached by thread " + std::to_string(f.rank) + " after " + std::to_string(exited_) +
           " threads of the block exited: every thread of the block must reach it");
    }
    if (++barrier_arrived_ == threads_) {
      barrier_arrived_ = 0;
      ++barrier_generation_;
      return;
    }
    f.wait = Wait::kBarrier;
    f.generation = barrier_generation_;
    suspend();
  }

  // A warp shuffle `op` by the current lane: `value` offered, read from lane `source` of the warp
  // (the lane itself when the shuffle's source is out of its segment). Returns the value read.
  uint64_t exchange(const char* op, unsigned mask, uint64_t value, unsigned source) {
    Fiber& f = *current_;
    const unsigned lane = f.rank % kWarpSize, first = f.rank - lane, bit = 1u << lane;
    const unsigned lanes = threads_ - first < kWarpSize ? threads_ - first : kWarpSize;
    const unsigned existing = lanes == kWarpSize ? ~0u : (1u << lanes) - 1u;
    WarpExchange& w = warps_[f.rank / kWarpSize];
    const auto misuse = [&](const std::string& what) {
      fail(std::string(op) + " by lane " + std::to_string(lane) + " of warp " + std::to_string(f.rank / kWarpSize) +
           " (mask " + hex(mask) + "): " + what);
    };
    if ((mask & bit) == 0) misuse("the calling lane is not in the mask");
    if ((mask & ~existing) != 0) misuse("the mask names lanes the block does not have");
    if ((mask & w.exited) != 0) misuse("the mask names lanes that have exited (" + hex(mask & w.exited) + ")");
    if (w.arrived == 0) {
      w.op = op;
      w.mask = mask;
    } else if (w.mask != mask || std::strcmp(w.op, op) != 0) {
      misuse(std::string("other lanes of the warp wait at ") + w.op + " with mask " + hex(w.mask));
    }
    w.value[lane] = value;
    w.source[lane] = source;
    w.arrived |= bit;
    if (w.arrived == mask) {
      for (unsigned l = 0; l < kWarpSize; ++l) {
        if ((mask >> l & 1u) == 0) continue;
        if ((mask >> w.source[l] & 1u) == 0) {
          misuse("lane " + std::to_string(l) + " reads lane " + std::to_string(w.source[l]) +
                 ", which is not in the mask");
        }
        w.result[l] = w.value[w.source[l]];
      }
      w.arrived = 0;
      ++w.generation;
      return w.result[lane];
    }
    f.wait = Wait::kWarp;
    f.generation = w.generation;
    suspend();
    return w.result[lane];
  }

  // The current thread's lane in its warp.
  unsigned lane() const { return current_->rank % kWarpSize; }

  // Records the launch's error (inside a fiber) and leaves the thread for good.
  [[noreturn]] void fail(const std::string& message) {
    if (error_.empty()) error_ = "block (" + std::to_string(builtins.block_idx.x) + ", " +
                                 std::to_string(builtins.block_idx.y) + ", " +
                                 std::to_string(builtins.block_idx.z) + "): " + message;
    current_->done = false;  // abandon_block restarts it
    suspend();
    __builtin_unreachable();  // an abandoned fiber is never resumed
  }

 private:
  // The entry of every fiber: runs the current block's body as one thread after another.
  static void fiber_main();

  void run_block() {
    barrier_arrived_ = 0;
    exited_ = 0;
    for (auto& w : warps_) w = WarpExchange{};
    const dim3 b = builtins.block_dim;
    for (unsigned t = 0; t < threads_; ++t) {
      Fiber& f = *fibers_[t];
      f.rank = t;
      f.thread_idx = {t % b.x, t / b.x % b.y, t / (b.x * b.y)};
      f.done = false;
      f.wait = Wait::kNone;
    }
    unsigned remaining = threads_;
    while (remaining > 0) {
      bool progressed = false;
      for (unsigned t = 0; t < threads_; ++t) {
        Fiber& f = *fibers_[t];
        if (f.done || !runnable(f)) continue;
        f.wait = Wait::kNone;
        resume(f);
        progressed = true;
        if (!error_.empty()) return abandon_block();
        if (f.done) --remaining;
      }
      if (!progressed) {
        error_ = deadlock();
        return abandon_block();
      }
    }
  }

  bool runnable(const Fiber& f) const {
    switch (f.wait) {
      case Wait::kNone: return true;
      case Wait::kBarrier: return f.generation != barrier_generation_;
      case Wait::kWarp: return f.generation != warps_[f.rank / kWarpSize].generation;
    }
    return false;
  }

  // What the block's remaining threads wait for, when none can go on.
  std::string deadlock() const {
    unsigned at_barrier = 0, at_shuffle = 0;
    std::string shuffles;
    for (unsigned t = 0; t < threads_; ++t) {
      const Fiber& f = *fibers_[t];
      if (f.done) continue;
      if (f.wait == Wait::kBarrier) {
        ++at_barrier;
      } else if (at_shuffle++ == 0) {
        shuffles = std::string(" (thread ") + std::to_string(t) + " at " + warps_[t / kWarpSize].op + ")";
      }
    }
    return "deadlock: " + std::to_string(at_barrier) + " threads wait at __syncthreads(), " +
           std::to_string(at_shuffle) + " at warp shuffles" + shuffles + ", " + std::to_string(exited_) +
           " exited; none can go on";
  }

  // After a failure: fibers stopped inside the kernel start afresh next time.
  void abandon_block() {
    for (unsigned t = 0; t < threads_; ++t) {
      Fiber& f = *fibers_[t];
      if (f.done || !f.started) continue;
      f.started = false;
#ifdef FUSED_OPTIM_EMULATION_ASAN
      __asan_unpoison_memory_region(f.stack, kStackBytes);  // its frames' redzones stay behind otherwise
#endif
    }
  }

  // The current thread returned from the kernel.
  void thread_exit() {
    Fiber& f = *current_;
    f.done = true;
    ++exited_;
    if (barrier_arrived_ != 0) {
      fail("thread " + std::to_string(f.rank) + " exited while " + std::to_string(barrier_arrived_) +
           " threads of the block wait at __syncthreads(): every thread of the block must reach it");
    }
    WarpExchange& w = warps_[f.rank / kWarpSize];
    const unsigned bit = 1u << (f.rank % kWarpSize);
    w.exited |= bit;
    if (w.arrived != 0 && (w.mask & bit) != 0) {
      fail("lane " + std::to_string(f.rank % kWarpSize) + " of warp " + std::to_string(f.rank / kWarpSize) +
           " exited while lanes " + hex(w.arrived) + " wait for it at " + w.op + " with mask " + hex(w.mask));
    }
    suspend();
  }

  // Scheduler -> fiber f, until it suspends.
  void resume(Fiber& f) {
    current_ = &f;
    builtins.thread_idx = f.thread_idx;
    if (_setjmp(scheduler_context_) == 0) {
#ifdef FUSED_OPTIM_EMULATION_ASAN
      __sanitizer_start_switch_fiber(&scheduler_fake_stack_, f.stack, kStackBytes);
#endif
      if (!f.started) {
        f.started = true;
        ucontext_t entry;
        getcontext(&entry);
        entry.uc_stack.ss_sp = f.stack;
        entry.uc_stack.ss_size = kStackBytes;
        entry.uc_link = nullptr;  // fiber_main never returns
        makecontext(&entry, &Scheduler::fiber_main, 0);
        setcontext(&entry);
      }
      _longjmp(f.context, 1);
    }
#ifdef FUSED_OPTIM_EMULATION_ASAN
    __sanitizer_finish_switch_fiber(scheduler_fake_stack_, nullptr, nullptr);
#endif
  }

  // Fiber -> scheduler; returns when the scheduler resumes this fiber.
  void suspend() {
    Fiber& f = *current_;
    if (_setjmp(f.context) == 0) {
#ifdef FUSED_OPTIM_EMULATION_ASAN
      __sanitizer_start_switch_fiber(&f.fake_stack, scheduler_stack_, scheduler_stack_size_);
#endif
      _longjmp(scheduler_context_, 1);
    }
#ifdef FUSED_OPTIM_EMULATION_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
  }

  static std::string hex(unsigned v) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0x%08x", v);
    return buf;
  }

  std::mutex mutex_;  // held by the running launch
  std::vector<std::unique_ptr<Fiber>> fibers_;
  std::vector<WarpExchange> warps_;
  unsigned threads_ = 0;  // per block
  unsigned barrier_arrived_ = 0, exited_ = 0;
  uint64_t barrier_generation_ = 0;
  void (*body_)(const void*) = nullptr;  // the launch's thread body, called with body_arg_
  const void* body_arg_ = nullptr;
  Fiber* current_ = nullptr;
  jmp_buf scheduler_context_;
  void* scheduler_fake_stack_ = nullptr;
  const void* scheduler_stack_ = nullptr;  // the OS thread's stack (AddressSanitizer's switches back)
  size_t scheduler_stack_size_ = 0;
  std::string error_;
};

// The process's scheduler (its fibers are kept until the process exits).
inline Scheduler& scheduler() {
  static Scheduler instance;
  return instance;
}

inline void Scheduler::fiber_main() {
  Scheduler& s = scheduler();
#ifdef FUSED_OPTIM_EMULATION_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.scheduler_stack_, &s.scheduler_stack_size_);
#endif
  for (;;) {
    s.body_(s.body_arg_);
    s.thread_exit();
  }
}

}  // namespace emulation
}  // namespace fused_optim
