// Sums of squares per tensor on CUDA (the CPU twin: csrc/cpu/norm.cpp), for l2norm, sum_squares_
// and the LARS trust ratios: per chunk in opmath (float for half/bfloat16/float, double for
// double), reduced in a fixed order (reduce.cuh), then per tensor in double (with master weights
// the LARS sums read the fp32 masters and the fp16/bf16 grads as they are, no fp32 copy):
//   out[t * lists + k] = Σ_chunks Σ_elements x_k^2
#include "launch.h"
#include "reduce.cuh"

namespace fused_optim {
namespace cuda {
namespace {

// Lists: Types (ListTypes, e.g. fp32 masters and fp16 grads), all read.
template <typename Types>
struct SumSquaresFunctor {
  static constexpr int K = Types::size;

  __device__ static void apply(const TensorListMetadata<K>& meta, const ChunkSums& sums) {
    using M = typename Types::opmath;
    const Chunk chunk = chunk_of_block(meta);
    M acc[K] = {};
    for_each_element<Types, 0>(meta, chunk, [&](M(&x)[K]) {
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = fma(x[k], x[k], acc[k]);
    });
    store_chunk_sums<K>(acc, chunk, sums);
  }
};

template <int K>
__global__ void __launch_bounds__(kBlockSize) sum_chunks_kernel(ChunkSums sums, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) return;
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

void sum_squares_launch(DType dtype, int64_t n, void* const* pointers, const int64_t* sizes, const int32_t* index,
                        const ChunkSums& sums, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    multi_tensor_apply<1, SumSquaresFunctor<ListTypes<T>>>(n, pointers, sizes, sums, stream, index);
  });
}

void value_grad_squares_launch(const UpdateDTypes& dtypes, int64_t n, void* const* values, void* const* grads,
                               const int64_t* sizes, const ChunkSums& sums, cudaStream_t stream) {
  const auto lists = concat_lists(n, {values, grads});
  dispatch_update(dtypes, [&](auto types) {
    using U = decltype(types);
    using Types = ListTypes<typename U::value_t, typename U::grad_t>;
    multi_tensor_apply<2, SumSquaresFunctor<Types>>(n, lists.data(), sizes, sums, stream);
  });
}

void sum_chunks_launch(int lists, int64_t n, const ChunkSums& sums, cudaStream_t stream, const float* found_inf) {
  if (n == 0) return;
  if (lists == 1) {
    FUSED_OPTIM_LAUNCH((sum_chunks_kernel<1>), static_cast<unsigned>(n), kBlockSize, stream, sums, found_inf);
  } else {
    FUSED_OPTIM_LAUNCH((sum_chunks_kernel<2>), static_cast<unsigned>(n), kBlockSize, stream, sums, found_inf);
  }
}

}  // namespace cuda
}  // namespace fused_optim
