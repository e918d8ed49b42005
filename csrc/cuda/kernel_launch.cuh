// FUSED_OPTIM_LAUNCH((kernel), grid, block, stream, args...): kernel<<<grid, block, 0, stream>>>(args...),
// then the launch's error, if any, thrown as a std::runtime_error naming the file, the line and
// CUDA's error string (what C10_CUDA_KERNEL_LAUNCH_CHECK() does; the kernel files include no torch
// header). The kernel's name goes in parentheses: template arguments hold commas.
//
// The CPU emulation (csrc/emulation/cuda_runtime.h) defines FUSED_OPTIM_EMULATED_LAUNCH, which
// runs the kernel in place of <<<...>>>; the check after it is the same.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace fused_optim {
namespace cuda {

inline void throw_on_launch_error(cudaError_t error, const char* file, int line) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(file) + ":" + std::to_string(line) +
                             ": CUDA kernel launch failed: " + cudaGetErrorString(error));
  }
}

}  // namespace cuda
}  // namespace fused_optim

#define FUSED_OPTIM_UNPARENTHESIZE(...) __VA_ARGS__

#ifdef FUSED_OPTIM_EMULATED_LAUNCH
#define FUSED_OPTIM_LAUNCH_ONLY(kernel, grid, block, stream, ...) \
  FUSED_OPTIM_EMULATED_LAUNCH(FUSED_OPTIM_UNPARENTHESIZE kernel, grid, block, stream, __VA_ARGS__)
#else
#define FUSED_OPTIM_LAUNCH_ONLY(kernel, grid, block, stream, ...) \
  FUSED_OPTIM_UNPARENTHESIZE kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif

#define FUSED_OPTIM_LAUNCH(kernel, grid, block, stream, ...)                                   \
  do {                                                                                          \
    FUSED_OPTIM_LAUNCH_ONLY(kernel, grid, block, stream, __VA_ARGS__);                          \
    ::fused_optim::cuda::throw_on_launch_error(cudaGetLastError(), __FILE__, __LINE__);        \
  } while (false)
