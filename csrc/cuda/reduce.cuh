// Deterministic reductions for the per-tensor sums of the kernels (norms, LARS/LAMB trust ratios):
// a block sums its threads' values in a fixed tree (warp shuffles, then the first warp over the
// warps' sums), writes one partial per (tensor, chunk), and sum_chunks_launch (norm.cu) adds a
// tensor's partials in chunk order. No atomics: the same inputs give the same bits every run.
#pragma once

#include "multi_tensor_apply.cuh"

namespace fused_optim {
namespace cuda {

// Sums v[k] over the block; the totals are valid in thread 0. Every thread must call it.
template <int K, typename M>
__device__ __forceinline__ void block_sum(M (&v)[K]) {
  constexpr int kWarps = kBlockSize / 32;
  __shared__ M warp_sums[K][kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int offset = 16; offset > 0; offset /= 2) v[k] += __shfl_down_sync(0xffffffffu, v[k], offset);
    if (lane == 0) warp_sums[k][warp] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      v[k] = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[k][lane] : M(0);
      for (int offset = 16; offset > 0; offset /= 2) v[k] += __shfl_down_sync(0xffffffffu, v[k], offset);
    }
  }
  __syncthreads();  // warp_sums may be reused by the next call
}

// The block's sums of v[k] become the chunk's partials (see ChunkSums in launch.h).
template <int K, typename M>
__device__ __forceinline__ void store_chunk_sums(M (&v)[K], const Chunk& chunk, const ChunkSums& sums) {
  block_sum<K>(v);
  if (threadIdx.x == 0) {
    const int64_t base = (static_cast<int64_t>(chunk.tensor) * sums.max_chunks + chunk.index()) * K;
#pragma unroll
    for (int k = 0; k < K; ++k) sums.partials[base + k] = static_cast<double>(v[k]);
  }
}

}  // namespace cuda
}  // namespace fused_optim
