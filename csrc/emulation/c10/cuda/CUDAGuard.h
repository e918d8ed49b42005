// c10::cuda::CUDAGuard for the CPU emulation build of the CUDA binding (see ../../cuda_runtime.h):
// the "device" is the host, so there is no current device to set.
#pragma once

#include <c10/core/Device.h>

namespace c10 {
namespace cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};

}  // namespace cuda
}  // namespace c10
