// FUSED_OPTIM_HD marks the functions the CPU and CUDA kernels share (the update rules of this
// folder): __host__ __device__ __forceinline__ under nvcc; otherwise (the CPU build, and a host
// compiler building the .cu files with __host__ / __device__ defined empty) inline, and always
// inlined where the compiler allows saying so: the rules run inside the CPU's SIMD loops, where
// GCC left some out of line (called through the PLT of the -fPIC library, once per block).
// Nothing else in csrc/shared may depend on __CUDACC__: the shared headers compile with nvcc
// without torch headers and with a host compiler without CUDA headers. csrc/shared is the
// torch-free math (update rules, bias corrections, trust ratios, element formats); the host code
// both devices' ops share that uses ATen (argument checks, index draws) is csrc/host.
// tests/test_math_headers_torch_free.py compiles each header here without torch.
#pragma once

#if defined(__CUDACC__)
#define FUSED_OPTIM_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define FUSED_OPTIM_HD inline __attribute__((always_inline))
#else
#define FUSED_OPTIM_HD inline
#endif
