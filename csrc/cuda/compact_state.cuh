// Compact optimizer state in the CUDA kernels (the CPU twin: csrc/cpu/compact_state.h): bf16
// moments of fp32 values (rounded to nearest even or stochastically), blockwise 8-bit moments, and
// bf16 params without masters rounded stochastically. The formats: fused_optim/state_formats.py,
// per element csrc/shared/state_codes.h (the same functions as the CPU's, so the same bits).
//
// A list of a launch may hold codes instead of values: its ListTypes entry is one of the tags
// below, and for_each_element (multi_tensor_apply.cuh) then runs for_each_coded_element, which
// opens each list as a Coded<S>: load(i) decodes element i to fp32, store() encodes a lane's
// elements back. An 8-bit block (kQ8Block = 256 elements) belongs to one warp: its 32 lanes hold
// its elements lane + 32e (e < 8), and its absmax is the warp's maximum of |x| by shuffles (NaN if
// any element is, as on the CPU), taken before any byte is encoded. Chunks start at multiples of
// kChunkSize, itself a multiple of 256, so every block is whole in one chunk (a tensor's last
// block may be partial: its missing elements count as 0).
//
// Random bits (bf16 stochastic rounding): element i of stream k of a tensor whose rounding key is `key` takes
// random_bits(seed_at(stream_seed(key, k), i), i), the CPU's and the reference's bits, i its index in the whole tensor
// (the element offset of a shard plus its local index). Stream 0 is the params, 1 + j the op's state list j. The keys
// reach the kernels as a device array of the step's key values (DeviceScalars::rounding_keys, by the caller's tensor
// index); the binding advances the int64 key tensors, which stay on the CPU, on the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../shared/primitives.h"
#include "../shared/state_codes.h"

namespace fused_optim {
namespace cuda {

// bf16 state of fp32 values: rounded to nearest even, or stochastically (Coding::stochastic_state).
struct Bf16Coded {};
// bf16 params without masters, rounded stochastically (always: the stochastic_params flag).
struct SrBf16 {};
// The 8-bit codes of a signed moment (3 mantissa bits and the sign) or of an unsigned one (4).
template <bool Signed>
struct Q8Coded {};
// The state type of an 8-bit update: each moment list is Q8Coded<signed> (moment_t).
struct Q8 {};

// The storage of a moment list of state type S: S, or the 8-bit code of the moment's sign.
template <typename S, bool Signed>
using moment_t = std::conditional_t<std::is_same_v<S, Q8>, Q8Coded<Signed>, S>;

template <typename S>
constexpr bool kCoded = false;
template <>
constexpr bool kCoded<Bf16Coded> = true;
template <>
constexpr bool kCoded<SrBf16> = true;
template <bool Signed>
constexpr bool kCoded<Q8Coded<Signed>> = true;

template <typename S>
constexpr bool kQ8List = false;
template <bool Signed>
constexpr bool kQ8List<Q8Coded<Signed>> = true;

// What a launch with coded lists needs besides its metadata: the rounding keys of the step and the
// tensors' element offsets (by the caller's tensor index; nullptr without stochastic rounding,
// resp. all offsets 0), whether bf16 state rounds stochastically, and the random stream of list 0
// (list d uses first_stream + d).
struct Coding {
  const int64_t* keys = nullptr;
  const int64_t* offsets = nullptr;
  bool stochastic_state = false;
  int first_stream = 0;
};

// Elements of an 8-bit block per lane.
constexpr int kPerLane = kQ8Block / 32;

// A list of plain storage S (fp32 / fp16 / bf16 values) among coded ones: multi_tensor_apply.cuh.
template <typename S>
struct Coded;

// bf16 moments (or params, stochastic): element i of the list `data`, element offset + i of its
// whole tensor (the index its random bits are drawn by).
struct Bf16Elements {
  uint16_t* data;
  uint32_t seed;  // the list's stream seed (stochastic rounding)
  int64_t offset;
  bool stochastic;

  __device__ float load(int64_t i) const { return bf16_value(data[i]); }

  // Writes the lane's elements block + lane + 32e (e < kPerLane) below end.
  __device__ void store(const float (&v)[kPerLane], int64_t block, int64_t end) const {
    const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t i = block + lane + 32 * e;
      if (i >= end) continue;
      const int64_t index = offset + i;
      data[i] = static_cast<uint16_t>(
          stochastic ? bf16_stochastic(v[e], random_bits(seed_at(seed, index), static_cast<uint32_t>(index)))
                     : bf16_nearest(v[e]));
    }
  }
};

template <>
struct Coded<Bf16Coded> : Bf16Elements {
  __device__ Coded(void* data, float*, uint32_t seed, int64_t offset, const Coding& c)
      : Bf16Elements{static_cast<uint16_t*>(data), seed, offset, c.stochastic_state} {}
};

template <>
struct Coded<SrBf16> : Bf16Elements {
  __device__ Coded(void* data, float*, uint32_t seed, int64_t offset, const Coding&)
      : Bf16Elements{static_cast<uint16_t*>(data), seed, offset, true} {}
};

template <bool Signed>
struct Coded<Q8Coded<Signed>> {
  uint8_t* codes;
  float* absmax;  // one per block

  __device__ Coded(void* data, float* absmax_, uint32_t, int64_t, const Coding&)
      : codes(static_cast<uint8_t*>(data)), absmax(absmax_) {}

  __device__ float load(int64_t i) const {
    return q8_entry<Signed>(static_cast<uint32_t>(codes[i])) * q8_decode_scale<Signed>(absmax[i / kQ8Block]);
  }

  // The block's absmax (every lane of the warp calls this: a warp-wide maximum), then the lane's
  // bytes. Elements past `end` hold 0 (the caller's), which leaves the maximum alone.
  __device__ void store(const float (&v)[kPerLane], int64_t block, int64_t end) const {
    const int lane = static_cast<int>(threadIdx.x % 32);
    float most = 0.f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) most = max_of(fabsf(v[e]), most);
    for (int offset = 16; offset > 0; offset /= 2) most = max_of(__shfl_xor_sync(0xffffffffu, most, offset), most);
    const float inv = q8_encode_scale<Signed>(most);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t i = block + lane + 32 * e;
      if (i < end) codes[i] = static_cast<uint8_t>(q8_encode<Signed>(v[e], inv));
    }
    if (lane == 0) absmax[block / kQ8Block] = most;
  }
};

}  // namespace cuda
}  // namespace fused_optim
