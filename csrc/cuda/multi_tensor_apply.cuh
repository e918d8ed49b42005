// The only CUDA launcher: applies a functor to every element of several lists of equally long
// tensors (params, grads, state...) in as few launches as the kernel-argument space allows.
//
// Needs only CUDA: tensors arrive as pointers and sizes, scalars as values or device pointers
// (lr, grad_scale, found_inf stay on the device: no host sync, graph-capturable). The torch
// binding (a thin file) turns tensor lists into these arrays.
//
// Work split: each tensor is cut into chunks of kChunkSize elements; one block handles one chunk.
// A launch carries up to MaxTensors<Depth> tensors and kMaxBlocks chunks in its metadata, passed
// by value in the kernel arguments (under the 4 KB limit every architecture has); a tensor whose
// chunks do not fit continues in the next launch. Offsets are 64-bit, so tensors over 2^31
// elements work.
//
// Inside a chunk, for_each_element gives the functor's op registers of opmath (float for
// half/bfloat16/float, double for double): 16-byte vector loads and stores when every list's
// pointer is 16-byte aligned, else scalar ones; a chunk's tail shorter than a vector is scalar.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_launch.cuh"
#include "launch.h"

namespace fused_optim {
namespace cuda {

constexpr int kBlockSize = 512;
constexpr int kMaxBlocks = 320;

template <int Depth>
struct MaxTensors;  // as many tensors as fit next to kMaxBlocks chunks in ~3.5 KB
template <> struct MaxTensors<1> { static constexpr int value = 96; };
template <> struct MaxTensors<2> { static constexpr int value = 64; };
template <> struct MaxTensors<3> { static constexpr int value = 48; };
template <> struct MaxTensors<4> { static constexpr int value = 36; };
template <> struct MaxTensors<5> { static constexpr int value = 30; };
template <>
struct MaxTensors<6> {
  static constexpr int value = 26;
};

template <int Depth>
struct TensorListMetadata {
  static constexpr int kMaxTensors = MaxTensors<Depth>::value;
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  int32_t tensor_index[kMaxTensors];  // position in the caller's lists (per-tensor values, norms)
  unsigned char block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
};

static_assert(sizeof(TensorListMetadata<6>) <= 3600, "kernel arguments must stay under 4 KB");
static_assert(sizeof(TensorListMetadata<5>) <= 3600, "kernel arguments must stay under 4 KB");
static_assert(sizeof(TensorListMetadata<1>) <= 3600, "kernel arguments must stay under 4 KB");

template <typename T> struct OpMath { using type = float; };
template <> struct OpMath<double> { using type = double; };
template <typename T> using opmath_t = typename OpMath<T>::type;

template <typename T> __device__ __forceinline__ opmath_t<T> to_opmath(T x) { return static_cast<opmath_t<T>>(x); }
template <> __device__ __forceinline__ float to_opmath<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_opmath<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_opmath(opmath_t<T> x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half from_opmath<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_opmath<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Calls f(Tag<T>{}) with the storage type T of dtype (host side: picks the kernels to launch).
template <typename T>
struct Tag {
  using type = T;
};

template <typename F>
void dispatch_dtype(DType dtype, const F& f) {
  switch (dtype) {
    case DType::kFloat: return f(Tag<float>{});
    case DType::kDouble: return f(Tag<double>{});
    case DType::kHalf: return f(Tag<__half>{});
    case DType::kBFloat16: return f(Tag<__nv_bfloat16>{});
  }
}

// The per-step scalars (launch.h), read by every block.
__device__ __forceinline__ bool skip_step(const DeviceScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.f;
}
__device__ __forceinline__ float inv_scale_of(const DeviceScalars& s) {
  return s.grad_scale != nullptr ? 1.f / *s.grad_scale : 1.f;
}
__device__ __forceinline__ double lr_of(const DeviceScalars& s) { return s.lr != nullptr ? *s.lr : s.lr_value; }

// The chunk a block works on: tensor slot, caller's tensor index, element range [begin, end).
struct Chunk {
  int slot;
  int32_t tensor;
  int64_t begin, end;
  __device__ int64_t index() const { return begin / kChunkSize; }  // the chunk's number in its tensor
};

template <int Depth>
__device__ __forceinline__ Chunk chunk_of_block(const TensorListMetadata<Depth>& meta) {
  const int slot = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = begin + kChunkSize < meta.sizes[slot] ? begin + kChunkSize : meta.sizes[slot];
  return {slot, meta.tensor_index[slot], begin, end};
}

// One element: x[d] = list d's value (element(d), a T&) in opmath; op(x); lists [0, Mutable) stored back.
template <typename T, int Depth, int Mutable, typename Op, typename Element>
__device__ __forceinline__ void apply_at(Op& op, Element element) {
  opmath_t<T> x[Depth];
#pragma unroll
  for (int d = 0; d < Depth; ++d) x[d] = to_opmath<T>(element(d));
  op(x);
#pragma unroll
  for (int d = 0; d < Mutable; ++d) element(d) = from_opmath<T>(x[d]);
}

// Calls op(x) on each element of the chunk, x[d] being list d's element in opmath, for the first
// Lists lists (all of T; lists after them carry other per-tensor pointers, e.g. step counters);
// lists [0, Mutable) are stored back.
template <typename T, int Lists, int Mutable, int Depth, typename Op>
__device__ __forceinline__ void for_each_element(const TensorListMetadata<Depth>& meta, const Chunk& chunk, Op op) {
  static_assert(Mutable <= Lists && Lists <= Depth, "lists: mutable first, element lists before the others");
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  T* ptrs[Lists];
  bool aligned = true;
  for (int d = 0; d < Lists; ++d) {
    ptrs[d] = static_cast<T*>(meta.addresses[d][chunk.slot]);
    aligned = aligned && (reinterpret_cast<uintptr_t>(ptrs[d]) % 16 == 0);
  }
  int64_t i = chunk.begin;
  if (aligned) {  // begin is a multiple of kChunkSize, hence of kVec: the vectors stay aligned
    const int64_t vec_end = chunk.begin + (chunk.end - chunk.begin) / kVec * kVec;
    for (int64_t v = chunk.begin + static_cast<int64_t>(threadIdx.x) * kVec; v < vec_end;
         v += static_cast<int64_t>(blockDim.x) * kVec) {
      alignas(16) T raw[Lists][kVec];
      for (int d = 0; d < Lists; ++d) *reinterpret_cast<uint4*>(raw[d]) = *reinterpret_cast<const uint4*>(ptrs[d] + v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) apply_at<T, Lists, Mutable>(op, [&](int d) -> T& { return raw[d][e]; });
      for (int d = 0; d < Mutable; ++d) *reinterpret_cast<uint4*>(ptrs[d] + v) = *reinterpret_cast<const uint4*>(raw[d]);
    }
    i = vec_end;
  }
  for (int64_t j = i + threadIdx.x; j < chunk.end; j += blockDim.x) {
    apply_at<T, Lists, Mutable>(op, [&](int d) -> T& { return ptrs[d][j]; });
  }
}

template <int Depth, typename Functor, typename Args>
__global__ void __launch_bounds__(kBlockSize) multi_tensor_kernel(TensorListMetadata<Depth> meta, Args args) {
  Functor::apply(meta, args);
}

// Launches Functor::apply(meta, args) over n tensors; pointers[d * n + t] is list d's tensor t,
// sizes[t] its element count (every list's tensor t has it), index[t] its index in the caller's
// lists (meta.tensor_index; t when index is nullptr). Empty tensors are skipped.
template <int Depth, typename Functor, typename Args>
void multi_tensor_apply(int64_t n, void* const* pointers, const int64_t* sizes, const Args& args, cudaStream_t stream,
                        const int32_t* index = nullptr) {
  constexpr int kMaxTensors = MaxTensors<Depth>::value;
  TensorListMetadata<Depth> meta;
  int tensors = 0, blocks = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (sizes[t] == 0) continue;
    for (int d = 0; d < Depth; ++d) meta.addresses[d][tensors] = pointers[d * n + t];
    meta.sizes[tensors] = sizes[t];
    meta.tensor_index[tensors] = index != nullptr ? index[t] : static_cast<int32_t>(t);
    ++tensors;
    const int64_t chunks = chunks_of(sizes[t]);
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<unsigned char>(tensors - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxBlocks || (tensors == kMaxTensors && last_chunk)) {
        FUSED_OPTIM_LAUNCH((multi_tensor_kernel<Depth, Functor>), blocks, kBlockSize, stream, meta, args);
        blocks = 0;
        if (last_chunk) {
          tensors = 0;
        } else {  // the tensor goes on in the next launch, as its first slot
          for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][tensors - 1];
          meta.sizes[0] = meta.sizes[tensors - 1];
          meta.tensor_index[0] = meta.tensor_index[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) FUSED_OPTIM_LAUNCH((multi_tensor_kernel<Depth, Functor>), blocks, kBlockSize, stream, meta, args);
}

}  // namespace cuda
}  // namespace fused_optim
