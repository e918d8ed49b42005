// c10::cuda::getCurrentCUDAStream() for the CPU emulation build of the CUDA binding (see
// ../../cuda_runtime.h): one stream, the null stream; an emulated launch runs before it returns.
#pragma once

#include <cuda_runtime.h>

namespace c10 {
namespace cuda {

struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};

inline CUDAStream getCurrentCUDAStream() { return {}; }

}  // namespace cuda
}  // namespace c10
