// Sums of squares per tensor on CUDA (the CPU twin: csrc/cpu/norm.cpp), for l2norm, sum_squares_
// and the LARS trust ratios: per chunk in opmath (float for half/bfloat16/float, double for
// double), reduced in a fixed order (reduce.cuh), then per tensor in double:
//   out[t * lists + k] = Σ_chunks Σ_elements x_k^2
#include "launch.h"
#include "reduce.cuh"

namespace fused_optim {
namespace cuda {
namespace {

template <typename T, int K>
struct SumSquaresFunctor {
  __device__ static void apply(const TensorListMetadata<K>& meta, const ChunkSums& sums) {
    using M = opmath_t<T>;
    const Chunk chunk = chunk_of_block(meta);
    M acc[K] = {};
    for_each_element<T, K, 0>(meta, chunk, [&](M(&x)[K]) {
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = fma(x[k], x[k], acc[k]);
    });
    store_chunk_sums<K>(acc, chunk, sums);
  }
};

template <int K>
__global__ void __launch_bounds__(kBlockSize) sum_chunks_kernel(ChunkSums sums) {
  const int64_t t = blockIdx.x;
  double v[K] = {};
  for (int64_t c = threadIdx.x; c < sums.max_chunks; c += blockDim.x) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += sums.partials[(t * sums.max_chunks + c) * K + k];
  }
  block_sum<K>(v);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) sums.out[t * K + k] = v[k];
  }
}

}  // namespace

void sum_squares_launch(DType dtype, int lists, int64_t n, void* const* pointers, const int64_t* sizes,
                        const int32_t* index, const ChunkSums& sums, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (lists == 1) {
      multi_tensor_apply<1, SumSquaresFunctor<T, 1>>(n, pointers, sizes, sums, stream, index);
    } else {
      multi_tensor_apply<2, SumSquaresFunctor<T, 2>>(n, pointers, sizes, sums, stream, index);
    }
  });
}

void sum_chunks_launch(int lists, int64_t n, const ChunkSums& sums, cudaStream_t stream) {
  if (n == 0) return;
  if (lists == 1) {
    FUSED_OPTIM_LAUNCH((sum_chunks_kernel<1>), static_cast<unsigned>(n), kBlockSize, stream, sums);
  } else {
    FUSED_OPTIM_LAUNCH((sum_chunks_kernel<2>), static_cast<unsigned>(n), kBlockSize, stream, sums);
  }
}

}  // namespace cuda
}  // namespace fused_optim
