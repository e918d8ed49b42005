// Compact optimizer state in the CPU kernels: bf16 moments of fp32 values (rounded to nearest
// even or stochastically), blockwise 8-bit moments, and bf16 params rounded stochastically. The
// formats are defined in fused_optim/state_formats.py (the reference); the code books are
// generated from it into ../shared/state_codes.h.
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
#include "../shared/state_codes.h"

#include <ATen/core/List.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fused_optim {

constexpr int64_t kQuantBlock = 256;

// The bijective 32-bit mix of the random bits (state_formats.hash32).
C10_ALWAYS_INLINE uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The seed of stream `stream` of a param's step with rounding key `key` (state_formats.stream_seed).
inline uint32_t stream_seed(int64_t key, int stream) {
  const auto k = static_cast<uint64_t>(key);
  const uint32_t mixed = hash32(static_cast<uint32_t>(k) ^ hash32(static_cast<uint32_t>(k >> 32)));
  return hash32(mixed ^ (static_cast<uint32_t>(stream) * 0x9E3779B9u));
}

// bf16 <-> fp32 of n elements (the compiler vectorizes these loops).
inline void decode_bf16(const c10::BFloat16* in, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = c10::bit_cast<float>(static_cast<uint32_t>(in[j].x) << 16);
}

// Round to nearest even (c10::BFloat16's rounding; a NaN becomes 0x7fc0).
inline void encode_bf16_nearest(const float* in, c10::BFloat16* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = c10::bit_cast<uint32_t>(in[j]);
    const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    out[j].x = static_cast<uint16_t>(in[j] != in[j] ? 0x7fc0u : r);
  }
}

// Stochastic rounding: elements [at, at + n) of a stream with seed `seed` (state_formats.round_bf16
// with random_bits): 16 random bits added below the bf16 mantissa, then truncated; a NaN keeps its
// sign and high bits and becomes quiet.
inline void encode_bf16_stochastic(const float* in, c10::BFloat16* out, int64_t n, uint32_t seed, int64_t at) {
  const uint32_t s = seed ^ hash32(static_cast<uint32_t>(static_cast<uint64_t>(at) >> 32));
  const auto lo = static_cast<uint32_t>(at);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = c10::bit_cast<uint32_t>(in[j]);
    const uint32_t r = (b + (hash32((lo + static_cast<uint32_t>(j)) ^ s) & 0xffffu)) >> 16;
    out[j].x = static_cast<uint16_t>(in[j] != in[j] ? ((b >> 16) | 0x40u) : r);
  }
}

// The 8-bit format: code books, their midpoints (state_codes.h) and a lookup table that finds
// the nearest code without a search. x / absmax is in [-1, 1]; its sign, its binade (the 27 from
// 2^-26 to 1, all smaller magnitudes in the first) and the top kLutBits bits of its mantissa pick
// a bucket of values holding at most one midpoint (checked when the table is made: neighbouring
// codes are >= 0.7% apart, a bucket spans <= 0.4%). The bucket's entry holds the number of
// midpoints below the bucket and, if one lies in it, that midpoint's remaining kLowBits mantissa
// bits: the code (the number of midpoints below x) is the count, plus one if x's low bits are past
// the midpoint's. One table read per element, exact: the count the reference's search gives.
constexpr int kLutBits = 8;
constexpr int kLowBits = 23 - kLutBits;
constexpr uint32_t kLowMask = (1u << kLowBits) - 1;
constexpr int kLutBinades = 27;
constexpr uint32_t kLutLowestExponent = 127 - kLutBinades + 1;  // 2^-26
constexpr int kLutHalf = (kLutBinades + 1) << kLutBits;           // buckets of one sign
constexpr uint32_t kHasMidpoint = 1u << 8;                         // entry: count | flag | low bits << 9

C10_ALWAYS_INLINE uint32_t lut_bucket(float x) {
  const uint32_t bits = c10::bit_cast<uint32_t>(x);
  const uint32_t exponent = (bits >> 23) & 0xffu;
  const uint32_t binade =
      exponent < kLutLowestExponent ? 0u : std::min(exponent - kLutLowestExponent + 1, uint32_t{kLutBinades});
  const uint32_t mantissa = exponent < kLutLowestExponent ? 0u : (bits >> kLowBits) & ((1u << kLutBits) - 1);
  return (bits >> 31) * kLutHalf + (binade << kLutBits) + mantissa;
}

struct CodeBook {
  const float* code;
  const uint32_t* entry;  // per bucket (lut_bucket)
  bool is_signed;
};

// The number of midpoints below x (a branchless binary search over the 255): what makes the table.
inline uint32_t count_below(const float* mid, float x) {
  uint32_t idx = 0;
  for (uint32_t step = 128; step >= 1; step >>= 1) idx += mid[idx + step - 1] < x ? step : 0u;
  return idx;
}

// The table of one code book, from every bucket's lowest and highest values.
struct CodeTable {
  uint32_t entry[2 * kLutHalf];

  explicit CodeTable(const float* mid) {
    std::fill(entry, entry + 2 * kLutHalf, 0u);
    for (int sign = 0; sign < 2; ++sign) {
      for (uint32_t binade = 0; binade <= kLutBinades; ++binade) {
        for (uint32_t m = 0; m < (binade == 0 ? 1u : 1u << kLutBits); ++m) {
          // the bucket's magnitudes: [lo, hi] (binade 0: every magnitude below 2^-26, and 0)
          const uint32_t first = binade == 0 ? 0u : ((binade + kLutLowestExponent - 1) << 23) | (m << kLowBits);
          const uint32_t last = binade == 0 ? (kLutLowestExponent << 23) - 1 : first + kLowMask;
          float lo = c10::bit_cast<float>(first), hi = c10::bit_cast<float>(last);
          if (sign) {
            const float negated_hi = -hi;
            hi = -lo;
            lo = negated_hi;
          }
          const uint32_t below_lo = count_below(mid, lo), below_hi = count_below(mid, hi);
          TORCH_CHECK(below_hi <= below_lo + (binade == 0 ? 0u : 1u),
                      "fused_optim: the 8-bit code lookup needs finer buckets");
          uint32_t e = below_lo;
          if (below_hi > below_lo) e |= kHasMidpoint | ((c10::bit_cast<uint32_t>(mid[below_lo]) & kLowMask) << 9);
          entry[sign * kLutHalf + (binade << kLutBits) + m] = e;
        }
      }
    }
  }
};

inline CodeBook code_book(bool is_signed) {
  static const CodeTable signed_table(kSignedMid), unsigned_table(kUnsignedMid);
  return is_signed ? CodeBook{kSignedCode, signed_table.entry, true}
                   : CodeBook{kUnsignedCode, unsigned_table.entry, false};
}

inline void decode_8bit(const uint8_t* in, float scale, const CodeBook& book, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = book.code[in[j]] * scale;
}

// The code of x (already divided by the block's absmax), scalar: the bucket's count, plus one if
// x is past the bucket's midpoint (larger low bits for x > 0, smaller for x < 0); an unsigned
// book never gives a positive x the code 0.
C10_ALWAYS_INLINE uint8_t code_of(const CodeBook& book, float x) {
  const uint32_t bits = c10::bit_cast<uint32_t>(x);
  const uint32_t e = book.entry[lut_bucket(x)];
  const uint32_t low = bits & kLowMask, mid_low = e >> 9;
  const bool past = (e & kHasMidpoint) != 0 && ((bits >> 31) != 0 ? mid_low > low : mid_low < low);
  const uint32_t idx = (e & 0xffu) + (past ? 1u : 0u);
  return static_cast<uint8_t>(!book.is_signed && x > 0.0f ? std::max(idx, 1u) : idx);
}

// The same on SIMD lanes (one gather per lane); returns how many elements it coded.
inline int64_t codes_simd(const CodeBook& book, const float* in, float divisor, uint8_t* out, int64_t n) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 d = _mm512_set1_ps(divisor);
  const __m512i lowest = _mm512_set1_epi32(kLutLowestExponent), one = _mm512_set1_epi32(1);
  const __m512i low_mask = _mm512_set1_epi32(kLowMask);
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(in + j), d);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(0xff));
    const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, lowest);
    const __m512i binade = _mm512_min_epu32(_mm512_sub_epi32(e, _mm512_sub_epi32(lowest, one)),
                                            _mm512_set1_epi32(kLutBinades));
    const __m512i mantissa =
        _mm512_and_si512(_mm512_srli_epi32(bits, kLowBits), _mm512_set1_epi32((1 << kLutBits) - 1));
    __m512i key = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~tiny),
                                         _mm512_add_epi32(_mm512_slli_epi32(binade, kLutBits), mantissa));
    key = _mm512_add_epi32(key, _mm512_and_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(kLutHalf)));
    const __m512i entry = _mm512_i32gather_epi32(key, book.entry, 4);
    const __m512i low = _mm512_and_si512(bits, low_mask), mid_low = _mm512_srli_epi32(entry, 9);
    const __mmask16 negative = _mm512_movepi32_mask(bits);
    const __mmask16 past = _mm512_test_epi32_mask(entry, _mm512_set1_epi32(kHasMidpoint)) &
                           ((_mm512_cmplt_epu32_mask(mid_low, low) & static_cast<__mmask16>(~negative)) |
                            (_mm512_cmpgt_epu32_mask(mid_low, low) & negative));
    __m512i idx = _mm512_and_si512(entry, _mm512_set1_epi32(0xff));
    idx = _mm512_mask_add_epi32(idx, past, idx, one);
    if (!book.is_signed) {
      idx = _mm512_mask_max_epu32(idx, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), idx, one);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(idx));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 d = _mm256_set1_ps(divisor);
  const __m256i one = _mm256_set1_epi32(1), low_mask = _mm256_set1_epi32(kLowMask);
  const __m256i has_midpoint = _mm256_set1_epi32(kHasMidpoint);
  alignas(32) int32_t lanes[8];
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(in + j), d);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i e = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff));
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(kLutLowestExponent), e);
    const __m256i binade = _mm256_min_epu32(_mm256_sub_epi32(e, _mm256_set1_epi32(kLutLowestExponent - 1)),
                                            _mm256_set1_epi32(kLutBinades));
    const __m256i mantissa =
        _mm256_and_si256(_mm256_srli_epi32(bits, kLowBits), _mm256_set1_epi32((1 << kLutBits) - 1));
    __m256i key = _mm256_andnot_si256(tiny, _mm256_add_epi32(_mm256_slli_epi32(binade, kLutBits), mantissa));
    key = _mm256_add_epi32(key, _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(kLutHalf)));
    const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(book.entry), key, 4);
    const __m256i low = _mm256_and_si256(bits, low_mask), mid_low = _mm256_srli_epi32(entry, 9);
    const __m256i has = _mm256_cmpeq_epi32(_mm256_and_si256(entry, has_midpoint), has_midpoint);
    const __m256i past = _mm256_and_si256(  // (values < 2^15: signed compares are exact)
        has, _mm256_blendv_epi8(_mm256_cmpgt_epi32(low, mid_low), _mm256_cmpgt_epi32(mid_low, low),
                                _mm256_srai_epi32(bits, 31)));
    __m256i idx = _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xff)), past);  // true is -1
    if (!book.is_signed) {
      const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
      idx = _mm256_max_epu32(idx, _mm256_and_si256(positive, one));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), idx);
    for (int k = 0; k < 8; ++k) out[j + k] = static_cast<uint8_t>(lanes[k]);
  }
#endif
  return j;
}

// One block: its absmax, then each element's nearest code (the number of midpoints below
// x/absmax; a non-zero unsigned value never codes 0).
inline float encode_8bit(const float* in, const CodeBook& book, uint8_t* out, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  Vec most(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) most = at::vec::maximum(most, Vec::loadu(in + j).abs());
  float lanes[Vec::size()];
  most.store(lanes);
  float absmax = 0.0f;
  for (const float lane : lanes) absmax = std::max(absmax, lane);
  for (; j < n; ++j) absmax = std::max(absmax, std::abs(in[j]));
  const float divisor = absmax > 0.0f ? absmax : 1.0f;  // absmax 0: every x is 0
  for (int64_t j = codes_simd(book, in, divisor, out, n); j < n; ++j) out[j] = code_of(book, in[j] / divisor);
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
    decode_8bit(s.codes + at, s.absmax[at / kQuantBlock], code_book(s.is_signed), buf, n);
    return buf;
  }
  void out(const Q8State& s, int64_t at, int64_t n) const {
    s.absmax[at / kQuantBlock] = encode_8bit(buf, code_book(s.is_signed), s.codes + at, n);
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

enum class StateFormat { kPlain, kBf16, k8bit };

// What a compact op (<name>compact_) adds to its list op: the absmax tensors of its 8-bit state
// lists (list-major: slot q of tensor t at q*n + t), the params' rounding keys (int64, one per
// param, advanced by one per step) and which roundings are stochastic. A plain op has none.
struct CompactArgs {
  at::TensorList absmaxes, keys;
  bool stochastic_state = false, stochastic_params = false;
  StateFormat format = StateFormat::kPlain;
  std::vector<int64_t> key_values;  // read before the update

  bool stochastic() const { return stochastic_state || stochastic_params; }
};

// The format of a call's state lists (every compact list of a call has the same): that of the
// first non-empty one's dtype against the values' (params or masters).
inline StateFormat format_of(at::ScalarType state, at::ScalarType values) {
  if (state == values) return StateFormat::kPlain;
  if (state == at::kBFloat16 && values != at::kDouble) return StateFormat::kBf16;
  if (state == at::kByte && values != at::kDouble) return StateFormat::k8bit;
  return StateFormat::kPlain;  // check_state_list names the mismatch
}

// Checks a state list of the call's format (dtype, device, contiguity, size) and, for 8-bit, its
// absmax tensors at `slot`; returns the next free slot.
inline int check_state_list(const char* op, const char* what, const UpdatedParams& params, at::TensorList ts,
                            const CompactArgs& c, int slot) {
  const auto values = params.values();
  check_same_size(op, what, values, ts);
  const size_t n = values.size();
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    const at::ScalarType want = c.format == StateFormat::kBf16  ? at::kBFloat16
                                : c.format == StateFormat::k8bit ? at::kByte
                                                                 : values[i].scalar_type();
    TORCH_CHECK(t.device() == values[0].device() && t.layout() == at::kStrided && t.is_contiguous(), "fused_optim::",
                op, ": ", what, "[", i, "] must be a dense contiguous tensor on ", values[0].device(),
                " (it is updated in place)");
    TORCH_CHECK(t.scalar_type() == want, "fused_optim::", op, ": ", what, "[", i, "] has dtype ", t.scalar_type(),
                " but this call's state is ", want, " (its value is ", values[i].scalar_type(),
                "); every state list of a call has one format");
    TORCH_CHECK(t.numel() == values[i].numel(), "fused_optim::", op, ": ", what, "[", i, "] has ", t.numel(),
                " elements but its param has ", values[i].numel());
  }
  if (c.format != StateFormat::k8bit || ts.empty()) return slot;
  TORCH_CHECK(c.absmaxes.size() >= (slot + 1) * n, "fused_optim::", op, ": absmaxes has ", c.absmaxes.size(),
              " tensors; 8-bit state needs one per param for each 8-bit state list (", what, " is list ", slot + 1,
              ")");
  for (size_t i = 0; i < n; ++i) {
    const auto& a = c.absmaxes[slot * n + i];
    const int64_t blocks = (values[i].numel() + kQuantBlock - 1) / kQuantBlock;
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.device() == values[0].device() &&
                    a.numel() == blocks,
                "fused_optim::", op, ": the absmax of ", what, "[", i, "] must be a contiguous float32 tensor of ",
                blocks, " elements (one per block of ", kQuantBlock, ")");
  }
  return slot + 1;
}

// The compact arguments of a call after its checks: the format from `first` (a state list), the
// keys read.
inline CompactArgs compact_args(const char* op, const UpdatedParams& params, at::TensorList first,
                                at::TensorList absmaxes, at::TensorList keys, bool stochastic_state,
                                bool stochastic_params) {
  CompactArgs c{absmaxes, keys, stochastic_state, stochastic_params};
  const auto values = params.values();
  if (!first.empty()) c.format = format_of(first[0].scalar_type(), values[0].scalar_type());
  // bf16 state of bf16 params rounded stochastically: decoded and encoded like bf16 state of fp32
  if (stochastic_state && !first.empty() && first[0].scalar_type() == at::kBFloat16) c.format = StateFormat::kBf16;
  TORCH_CHECK(!stochastic_state || c.format == StateFormat::kBf16, "fused_optim::", op,
              ": stochastic_state rounds bf16 state; this call's state is not bf16");
  if (stochastic_params) {
    TORCH_CHECK(params.masters.empty() && values[0].scalar_type() == at::kBFloat16, "fused_optim::", op,
                ": stochastic_params rounds bf16 params without master weights");
  }
  if (c.stochastic()) {
    check_same_size(op, "rounding_keys", values, keys);
    for (size_t i = 0; i < keys.size(); ++i) {
      TORCH_CHECK(keys[i].scalar_type() == at::kLong && keys[i].numel() == 1 && keys[i].is_cpu(), "fused_optim::",
                  op, ": rounding_keys[", i, "] must be a one-element int64 CPU tensor");
      c.key_values.push_back(*static_cast<const int64_t*>(keys[i].data_ptr()));
    }
  }
  return c;
}

// After the update: every param's key advanced by one.
inline void advance_keys(const CompactArgs& c) {
  if (!c.stochastic()) return;
  for (size_t i = 0; i < c.keys.size(); ++i) *static_cast<int64_t*>(c.keys[i].data_ptr()) = c.key_values[i] + 1;
}

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
