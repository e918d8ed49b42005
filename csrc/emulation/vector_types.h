// The CUDA vector types the kernels use, for the CPU emulation (see cuda_runtime.h here): the
// launch dimensions (uint3, dim3) and uint4, the 16-byte unit of vector loads and stores. uint4
// may alias any type, as the CUDA kernels read and write other types' storage through it; it is
// 16-byte aligned as on the GPU, so UndefinedBehaviorSanitizer reports a misaligned vector access.
#pragma once

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct __attribute__((may_alias, aligned(16))) uint4 {
  unsigned x, y, z, w;
};
