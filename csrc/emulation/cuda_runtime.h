// The CPU emulation of the CUDA the kernels use: put this folder first on the include path and
// the unchanged csrc/cuda sources compile with a host compiler and run on the CPU as a GPU would run
// them (fused_optim/_build.py builds them so, fused_optim.testing.emulated_cuda() runs them).
//
// Given here: the function qualifiers (__global__, __device__, __host__, __forceinline__,
// __launch_bounds__), __shared__, the built-in variables (threadIdx, blockIdx, blockDim, gridDim,
// warpSize), __syncthreads(), the warp shuffles with their masks (__shfl_sync, __shfl_up_sync,
// __shfl_down_sync, __shfl_xor_sync), streams and errors (cudaStream_t, cudaGetLastError,
// cudaGetErrorString), the float/double math the device code calls unqualified (math.h), and the
// launch: csrc/cuda/kernel_launch.cuh's FUSED_OPTIM_LAUNCH calls FUSED_OPTIM_EMULATED_LAUNCH in
// place of <<<...>>>. A launch is checked as CUDA checks it (grid and block dimensions, at most 1024
// threads; the kernel arguments' 4 KB at compile time) and then runs every block (scheduler.h);
// errors are set as CUDA's and read with cudaGetLastError(). __launch_bounds__ is accepted and
// not checked: a host function carries no attribute the launch could read back. Launches are
// counted (emulation::launches).
#pragma once

#include <math.h>  // sqrt, fma, fmin, fmax, pow with their float overloads, as CUDA declares them

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "scheduler.h"
#include "vector_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static

#define threadIdx (::fused_optim::emulation::builtins.thread_idx)
#define blockIdx (::fused_optim::emulation::builtins.block_idx)
#define blockDim (::fused_optim::emulation::builtins.block_dim)
#define gridDim (::fused_optim::emulation::builtins.grid_dim)
constexpr int warpSize = 32;

inline void __syncthreads() { ::fused_optim::emulation::scheduler().barrier(); }

namespace fused_optim {
namespace emulation {

// A shuffle of `var` (up to 8 bytes, as CUDA's) by the current lane, reading lane source(lane, w)
// of segments of `width` lanes (a power of two up to 32).
template <typename T, typename Source>
T shuffle(const char* op, unsigned mask, T var, int width, Source source) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "warp shuffles move values of up to 8 bytes");
  const unsigned w = static_cast<unsigned>(width);
  if (width <= 0 || w > kWarpSize || (w & (w - 1)) != 0) {
    scheduler().fail(std::string(op) + ": width " + std::to_string(width) + " is not a power of two up to 32");
  }
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = scheduler().exchange(op, mask, bits, source(scheduler().lane(), w));
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace emulation
}  // namespace fused_optim

// The lane's segment is [lane & ~(width - 1), + width); a source outside it reads the lane itself.
template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return fused_optim::emulation::shuffle("__shfl_sync", mask, var, width, [&](unsigned lane, unsigned w) {
    return (lane & ~(w - 1)) + (static_cast<unsigned>(src_lane) & (w - 1));
  });
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return fused_optim::emulation::shuffle("__shfl_up_sync", mask, var, width, [&](unsigned lane, unsigned w) {
    return lane % w >= delta ? lane - delta : lane;
  });
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return fused_optim::emulation::shuffle("__shfl_down_sync", mask, var, width, [&](unsigned lane, unsigned w) {
    return lane % w + delta < w ? lane + delta : lane;
  });
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return fused_optim::emulation::shuffle("__shfl_xor_sync", mask, var, width, [&](unsigned lane, unsigned w) {
    const unsigned source = (lane ^ static_cast<unsigned>(lane_mask)) % fused_optim::emulation::kWarpSize;
    return source / w > lane / w ? lane : source;  // a later segment: the lane's own value
  });
}

// Streams are accepted and ignored: a launch runs to completion before it returns.
using cudaStream_t = struct CUstream_st*;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};

namespace fused_optim {
namespace emulation {

// The OS thread's last error (cleared by cudaGetLastError) and the message of the last failure.
struct LastError {
  cudaError_t code = cudaSuccess;
  cudaError_t described = cudaSuccess;
  std::string detail, text;
};
inline thread_local LastError last_error;

inline void set_error(cudaError_t code, const std::string& detail) {
  last_error.code = code;
  last_error.described = code;
  last_error.detail = detail;
}

// The dimensions CUDA accepts for a launch (any device of compute capability 3.0 or newer), or why not.
inline std::string configuration_error(dim3 grid, dim3 block) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return "a grid dimension is 0";
  if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u) return "a grid dimension is too large";
  if (threads == 0) return "a block dimension is 0";
  if (block.x > 1024u || block.y > 1024u || block.z > 64u || threads > 1024u) {
    return "a block of " + std::to_string(threads) + " threads (" + std::to_string(block.x) + " x " +
           std::to_string(block.y) + " x " + std::to_string(block.z) + "): at most 1024, z at most 64";
  }
  return "";
}

// The launches that ran (valid configurations), in the process: the device passes a step takes
// (the emulated library's op `emulated_launches`, csrc/cuda/binding.cpp).
inline std::atomic<int64_t> launches{0};

// kernel<<<grid, block, 0, stream>>>(args...), `call(args...)` calling the kernel: the arguments
// are copied once (CUDA's parameter space), then every thread calls the kernel with them.
template <typename Call, typename... Args>
void launch(const Call& call, dim3 grid, dim3 block, cudaStream_t, Args&&... args) {
  static_assert((sizeof(std::decay_t<Args>) + ... + 0) <= 4096, "kernel arguments are limited to 4 KB");
  const std::string bad = configuration_error(grid, block);
  if (!bad.empty()) return set_error(cudaErrorInvalidConfiguration, bad);
  ++launches;
  const std::tuple<std::decay_t<Args>...> parameters(std::forward<Args>(args)...);
  const auto thread = [&] { std::apply(call, parameters); };
  const std::string failure = scheduler().run(grid, block, thread);
  if (!failure.empty()) set_error(cudaErrorLaunchFailure, failure);
}

}  // namespace emulation
}  // namespace fused_optim

// In place of kernel<<<grid, block, 0, stream>>>(...) (kernel: a name, template arguments allowed).
#define FUSED_OPTIM_EMULATED_LAUNCH(kernel, grid, block, stream, ...) \
  ::fused_optim::emulation::launch([](const auto&... a) { kernel(a...); }, grid, block, stream, __VA_ARGS__)

inline cudaError_t cudaGetLastError() {
  const cudaError_t code = fused_optim::emulation::last_error.code;
  fused_optim::emulation::last_error.code = cudaSuccess;
  return code;
}

// CUDA's text for the error; for the last launch's error, the emulation's detail after it.
inline const char* cudaGetErrorString(cudaError_t error) {
  auto& e = fused_optim::emulation::last_error;
  switch (error) {
    case cudaSuccess: e.text = "no error"; break;
    case cudaErrorInvalidConfiguration: e.text = "invalid configuration argument"; break;
    case cudaErrorLaunchFailure: e.text = "unspecified launch failure"; break;
    default: e.text = "unrecognized error code"; break;
  }
  if (error != cudaSuccess && error == e.described) e.text += " (emulation: " + e.detail + ")";
  return e.text.c_str();
}
