// Compact optimizer state in the CPU kernels: bf16 moments of fp32 values (rounded to nearest
// even or stochastically), blockwise 8-bit moments, and bf16 params rounded stochastically. The
// formats are defined in fused_optim/state_formats.py (the reference) and, per element, in
// ../shared/state_codes.h (shared with the CUDA kernels).
//
// One mechanism for every format: for_each_chunk() walks [begin, end) of a tensor in chunks of
// kQuantBlock elements that never straddle an 8-bit block, and runs the op's unchanged
// for_each_block/rule over each chunk with its compact streams as streams of for_each_block that
// decode as the rule loads a SIMD block and (bf16) encode as it stores one: no pass of their own.
// An 8-bit stream stores the updated values to an fp32 stack buffer with their largest magnitude,
// and after the rule encodes the buffer with that absmax. Encoding and decoding run on SIMD lanes
// (state_code_lanes.h): the per-element templates instantiated on lanes, a block's tail on floats.
// The launchers cut tensors between threads only at multiples of kAlign (multi_tensor.h), itself
// a multiple of kQuantBlock: a block is encoded by the one thread that owns it. A kernel's loop,
// written once for its list op and its compact twin, gets these streams from CompactStreams
// (dispatch_streams on CompactArgs), as it gets plain ones from update_args.h's PlainStreams.
#pragma once

#include "multi_tensor.h"
#include "update_args.h"
#include "state_code_lanes.h"
#include "../host/checks.h"
#include "../host/compact_args.h"
#include "../shared/primitives.h"
#include "../shared/state_codes.h"

#include <ATen/core/List.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fused_optim {

constexpr int64_t kQuantBlock = kQ8Block;

// One block's bytes (n <= kQuantBlock elements) given its absmax.
template <bool Signed>
inline void encode_8bit(const float* in, float absmax, uint8_t* out, int64_t n) {
  const float inv = q8_encode_scale<Signed>(absmax);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store_codes(out + j, q8_encode<Signed>(load_lanes<FLanes>(in + j), inv));
  for (; j < n; ++j) out[j] = static_cast<uint8_t>(q8_encode<Signed>(in[j], inv));
}

// ---- compact streams (for_each_chunk) --------------------------------------------------------

// A bf16 state tensor of fp32 values: rounded to nearest even, or stochastically with `seed`, its
// element i by the random bits of index offset + i (CompactArgs::offset: a shard's in its whole tensor).
struct Bf16State {
  c10::BFloat16* data;
  uint32_t seed;
  bool stochastic;
  int64_t offset;
};

// An 8-bit state tensor: codes and one absmax per block of kQuantBlock.
struct Q8State {
  uint8_t* codes;
  float* absmax;
  bool is_signed;
};

// A bf16 param without master updated in fp32 and rounded stochastically with `seed` (and
// `offset`, as Bf16State's).
struct SrParam {
  c10::BFloat16* data;
  uint32_t seed;
  int64_t offset;
};

// How for_each_chunk opens a stream for one chunk [at, at + n) of its tensor: Opened::in gives
// the chunk's stream for for_each_block (a plain stream advanced, a compact one as one of the
// stream types below); out() finishes the chunk (an 8-bit one: its bytes and absmax).
template <typename Stream>
struct Opened {
  Stream in(const Stream& s, int64_t at, int64_t) const { return advance(s, at); }
  void out(const Stream&, int64_t, int64_t) const {}
};

// A bf16 chunk as a stream of for_each_block: widened to fp32 as the rule loads it, rounded
// (to nearest even, or stochastically with the random bits of each element's index) as it stores
// it. Bf16Read: the same, read-only.
struct Bf16Read {
  const c10::BFloat16* data;
};

struct Bf16Values {
  c10::BFloat16* data;
  uint32_t seed;   // seed_at(the stream's seed, index): constant over 2^32 elements, so over a chunk
  uint32_t index;  // the low 32 bits of the first element's index
  bool stochastic;
};

C10_ALWAYS_INLINE Bf16Read advance(const Bf16Read& s, int64_t i) { return {s.data + i}; }
C10_ALWAYS_INLINE Bf16Values advance(const Bf16Values& s, int64_t i) {
  return {s.data + i, s.seed, s.index + static_cast<uint32_t>(i), s.stochastic};
}

template <typename T>
C10_ALWAYS_INLINE Block<T> load_as(const Bf16Read& s) {
  Block<T> b;
  for (int h = 0; h < kHalves<T>; ++h) {
    const FLanes x = load_bf16_lanes(s.data + h * kLanes);
    b.v[h] = at::vec::Vectorized<float>::loadu(&x);
  }
  return b;
}

template <typename T>
C10_ALWAYS_INLINE Block<T> load_as(const Bf16Values& s) {
  return load_as<T>(Bf16Read{s.data});
}

template <typename T>
C10_ALWAYS_INLINE void store_as(const Bf16Read&, const Block<T>&) {}

template <typename T>
C10_ALWAYS_INLINE void store_as(const Bf16Values& s, const Block<T>& b) {
  for (int h = 0; h < kHalves<T>; ++h) {
    FLanes x;
    b.v[h].store(&x);
    const ULanes i = lane_index() + (s.index + static_cast<uint32_t>(h * kLanes));
    store_bf16_lanes(s.data + h * kLanes, s.stochastic ? bf16_stochastic(x, hash32(i ^ s.seed) & 0xffffu)
                                                       : bf16_nearest(x));
  }
}

// The tail of a chunk (for_each_block's staging): copied to a zero-padded block and back (a
// Bf16Values only); the lanes keep their elements' indices.
template <typename S, int64_t L>
struct Bf16Staging {
  std::array<c10::BFloat16, L> data{};
  S in(S s, int64_t n) {
    std::memcpy(data.data(), s.data, n * sizeof(c10::BFloat16));
    s.data = data.data();
    return s;
  }
  void out(const S& s, int64_t n) const {
    if constexpr (std::is_same_v<S, Bf16Values>) std::memcpy(s.data, data.data(), n * sizeof(c10::BFloat16));
  }
};

template <int64_t L>
struct Staging<Bf16Read, L> : Bf16Staging<Bf16Read, L> {};

template <int64_t L>
struct Staging<Bf16Values, L> : Bf16Staging<Bf16Values, L> {};

// The bf16 stream from element `at` of a tensor whose element 0 has index `offset` in its whole tensor.
inline Bf16Values bf16_values(c10::BFloat16* data, uint32_t seed, bool stochastic, int64_t offset, int64_t at) {
  const int64_t index = offset + at;
  return {data + at, seed_at(seed, index), static_cast<uint32_t>(index), stochastic};
}

template <>
struct Opened<Bf16State> {
  Bf16Values in(const Bf16State& s, int64_t at, int64_t) const {
    return bf16_values(s.data, s.seed, s.stochastic, s.offset, at);
  }
  void out(const Bf16State&, int64_t, int64_t) const {}
};

template <>
struct Opened<SrParam> {
  Bf16Values in(const SrParam& s, int64_t at, int64_t) const { return bf16_values(s.data, s.seed, true, s.offset, at); }
  void out(const SrParam&, int64_t, int64_t) const {}
};

// An 8-bit chunk as a stream of for_each_block: each SIMD block decoded from its bytes in
// registers (Q8Codes; read-only), and for a mutable stream (Q8Chunk) each updated block stored as
// fp32 to the chunk's buffer and its magnitudes folded into the running maximum `most`, so that
// out() has the absmax and only encodes.
struct Q8Codes {
  const uint8_t* codes;
  float scale;  // absmax / kTop
  bool is_signed;
};

struct Q8Chunk : Q8Codes {
  float* values;
  ULanes* most;
};

C10_ALWAYS_INLINE Q8Codes advance(const Q8Codes& s, int64_t i) { return {s.codes + i, s.scale, s.is_signed}; }
C10_ALWAYS_INLINE Q8Chunk advance(const Q8Chunk& s, int64_t i) { return {advance(static_cast<const Q8Codes&>(s), i), s.values + i, s.most}; }

C10_ALWAYS_INLINE at::vec::Vectorized<float> decode_lanes(const Q8Codes& s, int64_t at) {
  const ULanes codes = load_codes(s.codes + at);
  const FLanes entries = s.is_signed ? q8_entry<true>(codes) : q8_entry<false>(codes);
  return at::vec::Vectorized<float>::loadu(&entries) * at::vec::Vectorized<float>(s.scale);
}

template <typename T>
C10_ALWAYS_INLINE Block<T> load_as(const Q8Codes& s) {
  Block<T> b;
  for (int h = 0; h < kHalves<T>; ++h) b.v[h] = decode_lanes(s, h * kLanes);
  return b;
}

template <typename T>
C10_ALWAYS_INLINE void store_as(const Q8Codes&, const Block<T>&) {}

template <typename T>
C10_ALWAYS_INLINE void store_as(const Q8Chunk& s, const Block<T>& b) {
  for (int h = 0; h < kHalves<T>; ++h) {
    b.v[h].store(s.values + h * kLanes);
    FLanes x;
    b.v[h].store(&x);
    *s.most = max_magnitude(*s.most, x);
  }
}

// The tail of a chunk (for_each_block's staging): its bytes copied to a zero-padded block; the
// values of a Q8Chunk copied back and only those folded into the maximum.
template <int64_t L>
struct Staging<Q8Codes, L> {
  std::array<uint8_t, L> codes{};
  Q8Codes in(const Q8Codes& s, int64_t n) {
    std::memcpy(codes.data(), s.codes, n);
    return {codes.data(), s.scale, s.is_signed};
  }
  void out(const Q8Codes&, int64_t) const {}
};

template <int64_t L>
struct Staging<Q8Chunk, L> {
  Staging<Q8Codes, L> codes;
  std::array<float, L> values{};
  ULanes most{};
  Q8Chunk in(const Q8Chunk& s, int64_t n) { return {codes.in(s, n), values.data(), &most}; }
  void out(const Q8Chunk& s, int64_t n) const {
    std::memcpy(s.values, values.data(), n * sizeof(float));
    for (int64_t j = 0; j < n; ++j) (*s.most)[0] = max_magnitude(*s.most, FLanes{} + values[j])[0];
  }
};

inline Q8Codes q8_codes(const Q8State& s, int64_t at) {
  const float absmax = s.absmax[at / kQuantBlock];
  return {s.codes + at, s.is_signed ? q8_decode_scale<true>(absmax) : q8_decode_scale<false>(absmax), s.is_signed};
}

template <>
struct Opened<Q8State> {
  alignas(64) float buf[kQuantBlock];
  ULanes most;
  Q8Chunk in(const Q8State& s, int64_t at, int64_t) {
    most = ULanes{};
    return {q8_codes(s, at), buf, &most};
  }
  void out(const Q8State& s, int64_t at, int64_t n) const {
    const float absmax = max_lane(most);
    s.absmax[at / kQuantBlock] = absmax;
    s.is_signed ? encode_8bit<true>(buf, absmax, s.codes + at, n) : encode_8bit<false>(buf, absmax, s.codes + at, n);
  }
};

// A compact stream that is read, never written back (LAMB's second pass reads the moments its
// first pass stored): decoded, not encoded. read_only() makes one of a compact stream (of a plain
// one: update_args.h).
template <typename Stream>
struct ReadOnly {
  Stream stream;
};

template <typename Stream>
ReadOnly<Stream> read_only(const Stream& s) {
  return {s};
}

template <>
struct Opened<ReadOnly<Bf16State>> {
  Bf16Read in(const ReadOnly<Bf16State>& s, int64_t at, int64_t) const { return {s.stream.data + at}; }
  void out(const ReadOnly<Bf16State>&, int64_t, int64_t) const {}
};

template <>
struct Opened<ReadOnly<Q8State>> {
  Q8Codes in(const ReadOnly<Q8State>& s, int64_t at, int64_t) const { return q8_codes(s.stream, at); }
  void out(const ReadOnly<Q8State>&, int64_t, int64_t) const {}
};

template <typename Stream>
constexpr bool kCompact = std::is_same_v<Stream, Bf16State> || std::is_same_v<Stream, Q8State> ||
                          std::is_same_v<Stream, SrParam>;

template <typename Stream>
constexpr bool kCompact<ReadOnly<Stream>> = true;

template <typename T, typename Body, typename... Stream, size_t... I>
inline void run_chunks(int64_t begin, int64_t end, const Body& body, std::index_sequence<I...>,
                       const Stream&... streams) {
  std::tuple<Opened<Stream>...> opened;
  for (int64_t at = begin; at < end;) {
    const int64_t stop = std::min(end, (at / kQuantBlock + 1) * kQuantBlock);
    const int64_t n = stop - at;
    for_each_block<T>(0, n, body, std::get<I>(opened).in(streams, at, n)...);
    (std::get<I>(opened).out(streams, at, n), ...);
    at = stop;
  }
}

// for_each_block over elements [begin, end) of one tensor whose streams may be compact (they take
// positions in the tensor; an 8-bit stream is encoded per block, so a caller hands whole blocks:
// `begin` a multiple of kQuantBlock, `end` one or the tensor's end, as the launchers do).
template <typename T, typename Body, typename... Stream>
inline void for_each_chunk(int64_t begin, int64_t end, const Body& body, Stream... streams) {
  if constexpr ((kCompact<Stream> || ...)) {
    run_chunks<T>(begin, end, body, std::make_index_sequence<sizeof...(Stream)>{}, streams...);
  } else {
    for_each_block<T>(begin, end, body, streams...);
  }
}

// ---- the streams of a compact update ------------------------------------------------------

// The streams of a compact update (CompactArgs c, state format F), as update_args.h's
// PlainStreams: state() the stream of state list `list` of tensor t (position k among the op's
// state lists: random stream 1 + k; 8-bit absmax slot `slot`) in format F (the tensor's S data,
// a Bf16State or a Q8State); with_param() the param's stream (an SrParam under stochastic
// rounding of bf16 params); for_each() walks the elements in chunks (for_each_chunk).
template <typename T, typename S, StateFormat F>
struct CompactStreams {
  static constexpr bool kPlainState = F == StateFormat::kPlain;  // (a compact twin given plain state)
  const UpdatedParams& params;
  const CompactArgs& c;

  auto state(at::TensorList list, int64_t t, int k, int slot, bool is_signed) const {
    if constexpr (F == StateFormat::kPlain) {
      return ptr<S>(list[t]);
    } else if constexpr (F == StateFormat::kFp32) {  // of fp16 / bf16 values: read and written as fp32
      return ptr<float>(list[t]);
    } else if constexpr (F == StateFormat::kBf16) {
      return Bf16State{ptr<c10::BFloat16>(list[t]), c.stochastic_state ? stream_seed(c.key_values[t], 1 + k) : 0u,
                       c.stochastic_state, c.offset(t)};
    } else {
      return Q8State{ptr<uint8_t>(list[t]), ptr<float>(c.absmaxes[slot * list.size() + t]), is_signed};
    }
  }
  template <typename Fn>
  void with_param(int64_t t, const Fn& f) const {
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<S, T>) {
      if (c.stochastic_params) return f(SrParam{ptr<T>(params.model[t]), stream_seed(c.key_values[t], 0), c.offset(t)});
    }
    f(param_stream<T, S>(params, t));
  }
  template <typename Body, typename... Stream>
  void for_each(int64_t begin, int64_t end, const Body& body, Stream... streams) const {
    for_each_chunk<T>(begin, end, body, streams...);
  }
};

// f(CompactStreams) for an update of types (T, S) in the call's format; compact formats only for
// fp32 math (the decoded buffers are fp32).
template <typename T, typename S, typename F>
void dispatch_streams(const UpdatedParams& params, const CompactArgs& c, const F& f) {
  auto run = [&](auto format) { f(CompactStreams<T, S, decltype(format)::value>{params, c}); };
  if constexpr (std::is_same_v<opmath_t<T>, float>) {
    switch (c.format) {
      case StateFormat::kBf16: return run(std::integral_constant<StateFormat, StateFormat::kBf16>{});
      case StateFormat::k8bit: return run(std::integral_constant<StateFormat, StateFormat::k8bit>{});
      case StateFormat::kFp32:  // (fp32 values' fp32 state is plain)
        if constexpr (!std::is_same_v<T, float>) return run(std::integral_constant<StateFormat, StateFormat::kFp32>{});
        break;
      case StateFormat::kPlain: break;
    }
  } else {
    TORCH_CHECK(c.format == StateFormat::kPlain,
                "fused_optim: compact state needs float32, float16 or bfloat16 params");
  }
  return run(std::integral_constant<StateFormat, StateFormat::kPlain>{});
}

}  // namespace fused_optim
