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
// The lists of a launch may hold different storage types (ListTypes): master weights read fp16 /
// bf16 grads, update fp32 masters and state, and write the rounded masters to a write-only list of
// fp16 / bf16 params, all in one pass. A list may also hold compact state (bf16 or 8-bit codes of
// fp32 moments, stochastically rounded bf16 params): compact_state.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "compact_state.cuh"
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
template <> struct MaxTensors<6> { static constexpr int value = 26; };
template <> struct MaxTensors<7> { static constexpr int value = 24; };
template <> struct MaxTensors<8> { static constexpr int value = 24; };  // (8-bit state: + the absmax lists)
template <> struct MaxTensors<9> { static constexpr int value = 22; };
template <> struct MaxTensors<10> { static constexpr int value = 20; };

template <int Depth>
struct TensorListMetadata {
  static constexpr int kMaxTensors = MaxTensors<Depth>::value;
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  int32_t tensor_index[kMaxTensors];  // position in the caller's lists (per-tensor values, norms)
  unsigned char block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
};

static_assert(sizeof(TensorListMetadata<10>) <= 3600, "kernel arguments must stay under 4 KB");
static_assert(sizeof(TensorListMetadata<9>) <= 3600, "kernel arguments must stay under 4 KB");
static_assert(sizeof(TensorListMetadata<8>) <= 3600, "kernel arguments must stay under 4 KB");
static_assert(sizeof(TensorListMetadata<7>) <= 3600, "kernel arguments must stay under 4 KB");
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

// The storage types of an update's lists (UpdateDTypes, launch.h): G of the grads, V of the values
// updated, S of the state, Model of the params written from the values (void: the values are the
// params). A functor instantiated for them puts the model list right after its element lists.
// Compact updates (compact_state.cuh): V may be SrBf16 (bf16 params rounded stochastically), S
// Bf16Coded or Q8 (each moment list then moment_t<Q8, signed>), or float beside fp16 / bf16 V.
template <typename G, typename V, typename S, typename Model>
struct UpdateTypes {
  using grad_t = G;
  using value_t = V;
  using state_t = S;
  using model_t = Model;
  static constexpr int kModelLists = std::is_void_v<Model> ? 0 : 1;
};

// f(UpdateTypes<G, V, S, Model>{}) with S the state type of the update's compact format.
template <typename G, typename V, typename Model, typename F>
void dispatch_state_format(StateFormat format, const F& f) {
  switch (format) {
    case StateFormat::kBf16: return f(UpdateTypes<G, V, Bf16Coded, Model>{});
    case StateFormat::k8bit: return f(UpdateTypes<G, V, Q8, Model>{});
    case StateFormat::kFp32:  // of fp16 / bf16 values (fp32 values' fp32 state is plain)
      if constexpr (!std::is_same_v<V, float>) return f(UpdateTypes<G, V, float, Model>{});
      break;
    case StateFormat::kPlain:
      if constexpr (std::is_same_v<V, SrBf16>) return f(UpdateTypes<G, V, __nv_bfloat16, Model>{});
      break;
  }
  throw std::invalid_argument("fused_optim CUDA: no compact update kernel for this state format");
}

// The compact instantiations: fp32, fp16 or bf16 params (bf16 ones also rounded stochastically),
// fp16 / bf16 params with fp32 masters; bf16 or 8-bit state (or the bf16 params' own bf16 state),
// or fp32 state of fp16 / bf16 params.
template <typename F>
void dispatch_compact_update(const UpdateDTypes& d, const F& f) {
  if (d.stochastic_params && d.grads == DType::kBFloat16 && d.values == DType::kBFloat16) {
    return dispatch_state_format<__nv_bfloat16, SrBf16, void>(d.format, f);
  }
  if (!d.stochastic_params && d.values == DType::kFloat) {
    if (d.grads == DType::kFloat) return dispatch_state_format<float, float, void>(d.format, f);
    if (d.grads == DType::kHalf) return dispatch_state_format<__half, float, __half>(d.format, f);
    if (d.grads == DType::kBFloat16) return dispatch_state_format<__nv_bfloat16, float, __nv_bfloat16>(d.format, f);
  }
  if (!d.stochastic_params && d.values == d.grads && d.format != StateFormat::kPlain) {
    if (d.grads == DType::kHalf) return dispatch_state_format<__half, __half, void>(d.format, f);
    if (d.grads == DType::kBFloat16) return dispatch_state_format<__nv_bfloat16, __nv_bfloat16, void>(d.format, f);
  }
  throw std::invalid_argument("fused_optim CUDA: no compact update kernel for these dtypes (float64 values?)");
}

// Calls f(UpdateTypes<...>{}) for the dtypes of an update (host side: picks the kernels to launch).
// Plain state only: the ops with compact twins call dispatch_any_update.
template <typename F>
void dispatch_update(const UpdateDTypes& dtypes, const F& f) {
  if (dtypes.compact()) throw std::invalid_argument("fused_optim CUDA: this op has no compact state kernel");
  if (dtypes.values == dtypes.grads && dtypes.state == dtypes.values) {
    return dispatch_dtype(dtypes.grads, [&](auto tag) {
      using T = typename decltype(tag)::type;
      f(UpdateTypes<T, T, T, void>{});
    });
  }
  if (dtypes.values == DType::kFloat && dtypes.state == DType::kFloat) {  // master weights
    if (dtypes.grads == DType::kHalf) return f(UpdateTypes<__half, float, float, __half>{});
    if (dtypes.grads == DType::kBFloat16) return f(UpdateTypes<__nv_bfloat16, float, float, __nv_bfloat16>{});
  }
  throw std::invalid_argument("fused_optim CUDA: no update kernel for these dtypes of grads, values and state");
}

// dispatch_update, or dispatch_compact_update for a compact update.
template <typename F>
void dispatch_any_update(const UpdateDTypes& dtypes, const F& f) {
  if (dtypes.compact()) return dispatch_compact_update(dtypes, f);
  dispatch_update(dtypes, f);
}

// The per-step scalars (launch.h), read by every block.
__device__ __forceinline__ bool skip_step(const DeviceScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.f;
}
__device__ __forceinline__ float inv_scale_of(const DeviceScalars& s) {
  return s.grad_scale != nullptr ? 1.f / *s.grad_scale : 1.f;
}
__device__ __forceinline__ double lr_of(const DeviceScalars& s) { return s.lr != nullptr ? *s.lr : s.lr_value; }
// The coding of a launch's compact lists whose list 0 uses random stream first_stream (compact_state.cuh).
__device__ __forceinline__ Coding coding_of(const DeviceScalars& s, int first_stream = 0) {
  return {s.rounding_keys, s.element_offsets, s.stochastic_state, first_stream};
}

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

// The storage types of the element lists of a launch, in list order (each list's tensors hold
// one type; the lists may differ, e.g. fp16 grads next to fp32 masters and state). Every type has
// the same opmath: float for half/bfloat16/float, double for double.
template <int D, typename S0, typename... S>
struct TypeAt {
  using type = typename TypeAt<D - 1, S...>::type;
};
template <typename S0, typename... S>
struct TypeAt<0, S0, S...> {
  using type = S0;
};

// The least of sizes A, B...
template <size_t A, size_t... B>
struct MinOf {
  static constexpr size_t value = A;
};
template <size_t A, size_t B, size_t... C>
struct MinOf<A, B, C...> {
  static constexpr size_t value = MinOf<(A < B ? A : B), C...>::value;
};

template <typename... S>
struct ListTypes {
  static constexpr int size = sizeof...(S);
  template <int D>
  using at = typename TypeAt<D, S...>::type;
  using opmath = opmath_t<at<0>>;
  static_assert((std::is_same_v<opmath_t<S>, opmath> && ...), "the lists of a launch share one opmath");
  static constexpr int kMinBytes = static_cast<int>(MinOf<sizeof(S)...>::value);
  static constexpr bool kCodedLists = (kCoded<S> || ...);  // compact state (compact_state.cuh)
  static constexpr int kQ8Lists = (0 + ... + static_cast<int>(kQ8List<S>));
  // The 8-bit lists before list D (the absmax list of an 8-bit list D is the launch's
  // Depth - kQ8Lists + q8_before<D>(): the absmaxes follow every other list, in list order).
  template <int D>
  static constexpr int q8_before() {
    constexpr bool q8[] = {kQ8List<S>...};
    int count = 0;
    for (int d = 0; d < D; ++d) count += q8[d] ? 1 : 0;
    return count;
  }
};

// f(Index<0>{}), ..., f(Index<N - 1>{}): a loop over lists of different types.
template <int D>
struct Index {
  static constexpr int value = D;
};
template <typename F, int... D>
__device__ __forceinline__ void each_index(F& f, std::integer_sequence<int, D...>) {
  (f(Index<D>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void static_for(F f) {
  each_index(f, std::make_integer_sequence<int, N>{});
}

// kVec elements of a list of S at p (16-byte aligned, kVec * sizeof(S) a multiple of 16) in
// 16-byte loads and stores.
template <int kVec, typename S>
__device__ __forceinline__ void load_vector(S (&raw)[kVec], const S* p) {
  static_assert(kVec * sizeof(S) % 16 == 0, "a vector of every list is whole 16-byte words");
#pragma unroll
  for (int q = 0; q < static_cast<int>(kVec * sizeof(S) / 16); ++q) {
    reinterpret_cast<uint4*>(raw)[q] = reinterpret_cast<const uint4*>(p)[q];
  }
}
template <int kVec, typename S>
__device__ __forceinline__ void store_vector(S* p, const S (&raw)[kVec]) {
  static_assert(kVec * sizeof(S) % 16 == 0, "a vector of every list is whole 16-byte words");
#pragma unroll
  for (int q = 0; q < static_cast<int>(kVec * sizeof(S) / 16); ++q) {
    reinterpret_cast<uint4*>(p)[q] = reinterpret_cast<const uint4*>(raw)[q];
  }
}

// The grads an update's last pass over them writes back unscaled (the contract: csrc/cpu/update_args.h
// AmpArgs): given GradScaler's grad_scale (a device pointer) other than 1, the launch's last
// element list, the grads, is stored back as g * (1/grad_scale) from the values loaded, before
// op runs, rounded to the grads' dtype.
template <typename M>
struct GradWriteBack {
  bool on;
  M inv_scale;
  __device__ explicit GradWriteBack(const float* grad_scale)
      : on(grad_scale != nullptr && *grad_scale != 1.f),
        inv_scale(on ? static_cast<M>(1.0 / static_cast<double>(*grad_scale)) : M(1)) {}
};

// for_each_element of lists of values only: 16-byte vectors where every list is aligned.
template <typename Types, int Mutable, typename Model, int Depth, typename Op>
__device__ __forceinline__ void for_each_plain_element(const TensorListMetadata<Depth>& meta, const Chunk& chunk,
                                                       Op op, const GradWriteBack<typename Types::opmath>& grads) {
  using M = typename Types::opmath;
  constexpr int kLists = Types::size;
  using G = typename Types::template at<kLists - 1>;
  constexpr bool kModel = !std::is_void_v<Model>;
  static_assert(Mutable <= kLists && kLists + kModel <= Depth, "lists: mutable first, element lists before the others");
  static_assert(!kModel || Mutable >= 1, "the model list receives list 0, which must be updated");
  // Elements per step: 16 bytes of the narrowest list, the model list included.
  using ModelOrByte = std::conditional_t<kModel, Model, char>;
  constexpr int kVec = 16 / static_cast<int>(MinOf<Types::kMinBytes, kModel ? sizeof(ModelOrByte) : 16>::value);
  bool aligned = true;
  for (int d = 0; d < kLists + kModel; ++d) {
    aligned = aligned && (reinterpret_cast<uintptr_t>(meta.addresses[d][chunk.slot]) % 16 == 0);
  }
  const auto list = [&](auto d) {
    using S = typename Types::template at<decltype(d)::value>;
    return static_cast<S*>(meta.addresses[decltype(d)::value][chunk.slot]);
  };
  Model* const model = kModel ? static_cast<Model*>(meta.addresses[kModel ? kLists : 0][chunk.slot]) : nullptr;
  int64_t i = chunk.begin;
  if (aligned) {  // begin is a multiple of kChunkSize, hence of kVec: the vectors stay aligned
    const int64_t vec_end = chunk.begin + (chunk.end - chunk.begin) / kVec * kVec;
    for (int64_t v = chunk.begin + static_cast<int64_t>(threadIdx.x) * kVec; v < vec_end;
         v += static_cast<int64_t>(blockDim.x) * kVec) {
      M x[kVec][kLists];
      static_for<kLists>([&](auto d) {
        using S = typename Types::template at<decltype(d)::value>;
        alignas(16) S raw[kVec];
        load_vector<kVec>(raw, list(d) + v);
#pragma unroll
        for (int e = 0; e < kVec; ++e) x[e][decltype(d)::value] = to_opmath<S>(raw[e]);
      });
      if (grads.on) {
        alignas(16) G raw[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) raw[e] = from_opmath<G>(x[e][kLists - 1] * grads.inv_scale);
        store_vector<kVec>(list(Index<kLists - 1>{}) + v, raw);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) op(x[e]);
      static_for<Mutable>([&](auto d) {
        using S = typename Types::template at<decltype(d)::value>;
        alignas(16) S raw[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) raw[e] = from_opmath<S>(x[e][decltype(d)::value]);
        store_vector<kVec>(list(d) + v, raw);
      });
      if constexpr (kModel) {
        alignas(16) Model raw[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) raw[e] = from_opmath<Model>(x[e][0]);
        store_vector<kVec>(model + v, raw);
      }
    }
    i = vec_end;
  }
  for (int64_t j = i + threadIdx.x; j < chunk.end; j += blockDim.x) {
    M x[kLists];
    static_for<kLists>([&](auto d) { x[decltype(d)::value] = to_opmath(list(d)[j]); });
    if (grads.on) list(Index<kLists - 1>{})[j] = from_opmath<G>(x[kLists - 1] * grads.inv_scale);
    op(x);
    static_for<Mutable>([&](auto d) {
      using S = typename Types::template at<decltype(d)::value>;
      list(d)[j] = from_opmath<S>(x[decltype(d)::value]);
    });
    if constexpr (kModel) model[j] = from_opmath<Model>(x[0]);
  }
}

// A list of plain storage S in for_each_coded_element: converted as for_each_plain_element does.
template <typename S>
struct Coded {
  S* data;

  __device__ Coded(void* data_, float*, uint32_t, int64_t, const Coding&) : data(static_cast<S*>(data_)) {}
  __device__ opmath_t<S> load(int64_t i) const { return to_opmath<S>(data[i]); }
  __device__ void store(const opmath_t<S> (&v)[kPerLane], int64_t block, int64_t end) const {
    const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      const int64_t i = block + lane + 32 * e;
      if (i < end) data[i] = from_opmath<S>(v[e]);
    }
  }
};

// for_each_element with compact lists (compact_state.cuh): each warp takes whole 8-bit blocks of
// the chunk (kQ8Block elements, kPerLane per lane, lane + 32e), decodes every list (Coded<S>),
// runs op on the elements below the chunk's end, and encodes the mutable lists and the model list.
template <typename Types, int Mutable, typename Model, int Depth, typename Op>
__device__ __forceinline__ void for_each_coded_element(const TensorListMetadata<Depth>& meta, const Chunk& chunk,
                                                       const Coding& coding, Op op,
                                                       const GradWriteBack<typename Types::opmath>& grads) {
  using M = typename Types::opmath;
  static_assert(std::is_same_v<M, float>, "compact state is decoded to float");
  constexpr int kLists = Types::size;
  constexpr int kQ8Base = Depth - Types::kQ8Lists;
  const int64_t key = coding.keys != nullptr ? coding.keys[chunk.tensor] : 0;
  const int64_t offset = coding.offsets != nullptr ? coding.offsets[chunk.tensor] : 0;
  const auto open = [&](auto d) {
    constexpr int D = decltype(d)::value;
    using S = typename Types::template at<D>;
    float* const absmax =
        kQ8List<S> ? static_cast<float*>(meta.addresses[kQ8Base + Types::template q8_before<D>()][chunk.slot])
                   : nullptr;
    const uint32_t seed = coding.keys != nullptr ? stream_seed(key, coding.first_stream + D) : 0u;
    return Coded<S>(meta.addresses[D][chunk.slot], absmax, seed, offset, coding);
  };
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t stride = static_cast<int64_t>(blockDim.x / 32) * kQ8Block;
  for (int64_t block = chunk.begin + static_cast<int64_t>(threadIdx.x / 32) * kQ8Block; block < chunk.end;
       block += stride) {
    M x[kPerLane][kLists];
    static_for<kLists>([&](auto d) {
      const auto list = open(d);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        const int64_t i = block + lane + 32 * e;
        x[e][decltype(d)::value] = i < chunk.end ? list.load(i) : M(0);
      }
    });
    if (grads.on) {
      M v[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) v[e] = x[e][kLists - 1] * grads.inv_scale;
      open(Index<kLists - 1>{}).store(v, block, chunk.end);
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      if (block + lane + 32 * e < chunk.end) op(x[e]);
    }
    static_for<Mutable>([&](auto d) {
      M v[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) v[e] = x[e][decltype(d)::value];
      open(d).store(v, block, chunk.end);
    });
    if constexpr (!std::is_void_v<Model>) {
      M v[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) v[e] = x[e][0];
      Coded<Model>(meta.addresses[kLists][chunk.slot], nullptr, 0u, 0, coding).store(v, block, chunk.end);
    }
  }
}

// Calls op(x) on each element of the chunk, x[d] being list d's element in opmath, for the element
// lists of Types (ListTypes: list d holds Types::at<d>); lists [0, Mutable) are stored back. With
// a Model type (not void), the next list is write-only: it receives x[0] after op, rounded to
// nearest even to Model (master weights: list 0 the fp32 masters, the model list their fp16/bf16
// params). Lists after these carry other per-tensor pointers (e.g. step counters), then, with
// 8-bit lists, one absmax list per 8-bit list. Lists of compact state are decoded and encoded as
// `coding` says (compact_state.cuh). An update's last pass over the grads, its last element list,
// passes `unscale_grads`, GradScaler's grad_scale (GradWriteBack).
template <typename Types, int Mutable, typename Model = void, int Depth, typename Op>
__device__ __forceinline__ void for_each_element(const TensorListMetadata<Depth>& meta, const Chunk& chunk, Op op,
                                                 const Coding& coding = {}, const float* unscale_grads = nullptr) {
  const GradWriteBack<typename Types::opmath> grads(unscale_grads);
  if constexpr (Types::kCodedLists) {
    for_each_coded_element<Types, Mutable, Model>(meta, chunk, coding, op, grads);
  } else {
    for_each_plain_element<Types, Mutable, Model>(meta, chunk, op, grads);
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
