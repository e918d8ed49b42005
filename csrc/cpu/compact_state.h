// Compact optimizer state in the CPU kernels: bf16 moments of fp32 values (rounded to nearest
// even or stochastically), blockwise 8-bit moments, and bf16 params rounded stochastically. The
// formats are defined in fused_optim/state_formats.py (the reference) and, per element, in
// ../shared/state_codes.h (shared with the CUDA kernels).
//
// One mechanism for every format: for_each_chunk() walks [begin, end) of a tensor in chunks of
// kQuantBlock elements that never straddle an 8-bit block. Each compact stream decodes its chunk
// into an fp32 stack buffer (cache-resident), the op's unchanged for_each_block/rule runs over
// the buffers and the plain streams, and each mutable compact stream encodes its buffer back.
// The launchers cut tensors between threads only at multiples of kAlign (multi_tensor.h), itself
// a multiple of kQuantBlock: a block is encoded by the one thread that owns it.
#pragma once

#include "simd_blocks.h"
#include "master_weights.h"
#include "../shared/checks.h"
#include "../shared/compact_args.h"
#include "../shared/primitives.h"
#include "../shared/state_codes.h"

#include <ATen/core/List.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fused_optim {

constexpr int64_t kQuantBlock = kQ8Block;

// bf16 <-> fp32 of n elements (the compiler vectorizes these loops; the per-element formats are
// ../shared/state_codes.h).
inline void decode_bf16(const c10::BFloat16* in, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = bf16_value(in[j].x);
}

inline void encode_bf16_nearest(const float* in, c10::BFloat16* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j].x = bf16_nearest(in[j]);
}

// Stochastic rounding: elements [at, at + n) of a stream with seed `seed` (state_formats.round_bf16
// with random_bits).
inline void encode_bf16_stochastic(const float* in, c10::BFloat16* out, int64_t n, uint32_t seed, int64_t at) {
  const uint32_t s = seed_at(seed, at);
  const auto lo = static_cast<uint32_t>(at);
  for (int64_t j = 0; j < n; ++j) out[j].x = bf16_stochastic(in[j], random_bits(s, lo + static_cast<uint32_t>(j)));
}

// One 8-bit block (n <= kQuantBlock elements) to fp32: each byte's entry times absmax / kTop.
template <bool Signed>
inline void decode_8bit(const uint8_t* in, float absmax, float* out, int64_t n) {
  const float scale = q8_decode_scale<Signed>(absmax);
  for (int64_t j = 0; j < n; ++j) out[j] = q8_entry<Signed>(in[j]) * scale;
}

// One block: its absmax (the largest magnitude; NaN if any is), then each element's byte.
template <bool Signed>
inline float encode_8bit(const float* in, uint8_t* out, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  Vec most(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) most = at::vec::maximum(most, Vec::loadu(in + j).abs());
  float lanes[Vec::size()];
  most.store(lanes);
  float absmax = 0.0f;
  for (const float lane : lanes) absmax = max_of(lane, absmax);
  for (; j < n; ++j) absmax = max_of(std::abs(in[j]), absmax);
  const float inv = q8_encode_scale<Signed>(absmax);
  for (j = 0; j < n; ++j) out[j] = static_cast<uint8_t>(q8_encode<Signed>(in[j], inv));
  return absmax;
}

// ---- compact streams (for_each_chunk) --------------------------------------------------------

// A bf16 state tensor of fp32 values: rounded to nearest even, or stochastically with `seed`.
struct Bf16State {
  c10::BFloat16* data;
  uint32_t seed;
  bool stochastic;
};

// An 8-bit state tensor: codes and one absmax per block of kQuantBlock.
struct Q8State {
  uint8_t* codes;
  float* absmax;
  bool is_signed;
};

// A bf16 param without master updated in fp32 and rounded stochastically with `seed`.
struct SrParam {
  c10::BFloat16* data;
  uint32_t seed;
};

// How for_each_chunk opens a stream for one chunk [at, at + n) of its tensor: a plain stream is
// advanced (Opened::in), a compact one decoded into `buf`; out() encodes a mutable one back.
template <typename Stream>
struct Opened {
  Stream in(const Stream& s, int64_t at, int64_t) const { return advance(s, at); }
  void out(const Stream&, int64_t, int64_t) const {}
};

struct ChunkBuffer {
  alignas(64) float buf[kQuantBlock];
};

template <>
struct Opened<Bf16State> : ChunkBuffer {
  float* in(const Bf16State& s, int64_t at, int64_t n) {
    decode_bf16(s.data + at, buf, n);
    return buf;
  }
  void out(const Bf16State& s, int64_t at, int64_t n) const {
    if (s.stochastic) return encode_bf16_stochastic(buf, s.data + at, n, s.seed, at);
    encode_bf16_nearest(buf, s.data + at, n);
  }
};

template <>
struct Opened<SrParam> : ChunkBuffer {
  float* in(const SrParam& s, int64_t at, int64_t n) {
    decode_bf16(s.data + at, buf, n);
    return buf;
  }
  void out(const SrParam& s, int64_t at, int64_t n) const { encode_bf16_stochastic(buf, s.data + at, n, s.seed, at); }
};

template <>
struct Opened<Q8State> : ChunkBuffer {
  float* in(const Q8State& s, int64_t at, int64_t n) {
    const float absmax = s.absmax[at / kQuantBlock];
    s.is_signed ? decode_8bit<true>(s.codes + at, absmax, buf, n) : decode_8bit<false>(s.codes + at, absmax, buf, n);
    return buf;
  }
  void out(const Q8State& s, int64_t at, int64_t n) const {
    s.absmax[at / kQuantBlock] =
        s.is_signed ? encode_8bit<true>(buf, s.codes + at, n) : encode_8bit<false>(buf, s.codes + at, n);
  }
};

// A compact stream that is read, never written back (LAMB's second pass reads the moments its
// first pass stored): decoded per chunk, not encoded. read_only() makes one of any stream.
template <typename Stream>
struct ReadOnly {
  Stream stream;
};

template <typename Stream>
auto read_only(const Stream& s) {
  if constexpr (std::is_pointer_v<Stream>) {
    return static_cast<const std::remove_pointer_t<Stream>*>(s);  // a plain stream: read through const
  } else {
    return ReadOnly<Stream>{s};
  }
}

template <typename Stream>
struct Opened<ReadOnly<Stream>> : Opened<Stream> {
  float* in(const ReadOnly<Stream>& s, int64_t at, int64_t n) { return Opened<Stream>::in(s.stream, at, n); }
  void out(const ReadOnly<Stream>&, int64_t, int64_t) const {}
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

// ---- the compact arguments of an op --------------------------------------------------------

// The stream of state list `list` (position k among the op's state lists: random stream 1 + k,
// 8-bit absmax slot `slot`) of tensor t, in format F: the tensor's S data, Bf16State or Q8State.
template <StateFormat F, typename S>
auto state_stream(const CompactArgs& c, at::TensorList list, int64_t t, int k, int slot, bool is_signed) {
  if constexpr (F == StateFormat::kPlain) {
    return ptr<S>(list[t]);
  } else if constexpr (F == StateFormat::kBf16) {
    return Bf16State{ptr<c10::BFloat16>(list[t]),
                     c.stochastic_state ? stream_seed(c.key_values[t], 1 + k) : 0u, c.stochastic_state};
  } else {
    return Q8State{ptr<uint8_t>(list[t]), ptr<float>(c.absmaxes[slot * list.size() + t]), is_signed};
  }
}

// f(std::integral_constant<StateFormat, format>) for the call's format; compact formats only for
// fp32 math (the decoded buffers are fp32).
template <typename T, typename F>
void dispatch_format(const CompactArgs& c, const F& f) {
  if constexpr (std::is_same_v<opmath_t<T>, float>) {
    switch (c.format) {
      case StateFormat::kBf16: return f(std::integral_constant<StateFormat, StateFormat::kBf16>{});
      case StateFormat::k8bit: return f(std::integral_constant<StateFormat, StateFormat::k8bit>{});
      case StateFormat::kPlain: break;
    }
  } else {
    TORCH_CHECK(c.format == StateFormat::kPlain,
                "fused_optim: compact state needs float32, float16 or bfloat16 params");
  }
  return f(std::integral_constant<StateFormat, StateFormat::kPlain>{});
}

// f(param stream): the param_stream of master_weights.h, or an SrParam for stochastic rounding.
template <typename T, typename S, typename F>
void with_param_stream(const UpdatedParams& params, const CompactArgs& c, int64_t t, const F& f) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<S, T>) {
    if (c.stochastic_params) return f(SrParam{ptr<T>(params.model[t]), stream_seed(c.key_values[t], 0)});
  }
  f(param_stream<T, S>(params, t));
}

}  // namespace fused_optim
