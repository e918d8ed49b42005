// Checks of the CPU emulation of CUDA (csrc/emulation), compiled and run by test_cuda_emulation.py
// with csrc/emulation and csrc/cuda on the include path: barriers and shared memory, warp shuffles,
// the launch checks and the errors of misused barriers and shuffles, the fp16/bf16 conversions.
// Prints "FAIL <check>: <why>" for each failure; the exit status is the number of failures.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_launch.cuh"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// The message FUSED_OPTIM_LAUNCH threw, or "" when the launch succeeded.
template <typename Launch>
std::string launch_error(const Launch& launch) {
  try {
    launch();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- barriers and shared memory ----------------------------------------------------------------

// Each thread writes its slot, and after the barrier reads the mirrored thread's: every write
// of the block is visible after __syncthreads().
__global__ void mirror(int* out) {
  __shared__ int slots[1024];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x * 3 + blockIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slots[blockDim.x - 1 - threadIdx.x];
}

void check_barriers() {
  for (const unsigned threads : {512u, 100u, 1u}) {  // 100: the last warp has 4 lanes
    std::vector<int> out(3 * threads, -1);
    FUSED_OPTIM_LAUNCH((mirror), 3, threads, nullptr, out.data());
    for (unsigned b = 0; b < 3; ++b) {
      for (unsigned t = 0; t < threads; ++t) {
        check(out[b * threads + t] == static_cast<int>((threads - 1 - t) * 3 + b),
              "mirror: block " + std::to_string(b) + " thread " + std::to_string(t) + " of " + std::to_string(threads));
      }
    }
  }
}

// Every (block, thread) coordinate of a 3-D grid of 3-D blocks runs exactly once.
__global__ void coordinates(int* seen) {
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  seen[block * blockDim.x * blockDim.y * blockDim.z + thread] += 1;
}

void check_coordinates() {
  std::vector<int> seen(2 * 3 * 2 * 4 * 2 * 3, 0);
  FUSED_OPTIM_LAUNCH((coordinates), dim3(2, 3, 2), dim3(4, 2, 3), nullptr, seen.data());
  for (size_t i = 0; i < seen.size(); ++i) check(seen[i] == 1, "coordinates: thread " + std::to_string(i));
}

// ---- warp shuffles -------------------------------------------------------------------------------

// Per lane, the values read by each shuffle of value 100*lane + 7, over the full warp (width 32 and
// 8), and by the lanes of mask 0x0000ffff alone (the others do not call).
__global__ void shuffles(int* out) {
  const unsigned lane = threadIdx.x % 32;
  const int v = static_cast<int>(100 * lane + 7);
  int* o = out + 8 * threadIdx.x;
  o[0] = __shfl_down_sync(0xffffffffu, v, 3);
  o[1] = __shfl_up_sync(0xffffffffu, v, 5);
  o[2] = __shfl_xor_sync(0xffffffffu, v, 9);
  o[3] = __shfl_sync(0xffffffffu, v, 13);
  o[4] = __shfl_down_sync(0xffffffffu, v, 3, 8);
  o[5] = __shfl_up_sync(0xffffffffu, v, 2, 8);
  o[6] = __shfl_sync(0xffffffffu, v, 6, 8);
  o[7] = lane < 16 ? __shfl_xor_sync(0x0000ffffu, v, 1, 16) : -1;
}

void check_shuffles() {
  std::vector<int> out(8 * 64, 0);
  FUSED_OPTIM_LAUNCH((shuffles), 1, 64, nullptr, out.data());
  const auto value = [](unsigned lane) { return static_cast<int>(100 * lane + 7); };
  for (unsigned t = 0; t < 64; ++t) {
    const unsigned l = t % 32, segment8 = l / 8 * 8;
    const int expected[8] = {value(l + 3 < 32 ? l + 3 : l), value(l >= 5 ? l - 5 : l), value(l ^ 9), value(13),
                             value(l % 8 + 3 < 8 ? l + 3 : l), value(l % 8 >= 2 ? l - 2 : l), value(segment8 + 6),
                             l < 16 ? value(l ^ 1) : -1};
    for (int k = 0; k < 8; ++k) {
      check(out[8 * t + k] == expected[k], "shuffle " + std::to_string(k) + " of thread " + std::to_string(t) +
                                               ": " + std::to_string(out[8 * t + k]) + " != " +
                                               std::to_string(expected[k]));
    }
  }
}

// A block sum as reduce.cuh computes it (shuffles down, then the first warp over the warps' sums).
__global__ void block_sum(double* out) {
  __shared__ double warp_sums[32];
  double v = threadIdx.x + 0.5;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  if (threadIdx.x == 0) out[blockIdx.x] = v;
}

void check_block_sum() {
  std::vector<double> out(2, 0.0);
  FUSED_OPTIM_LAUNCH((block_sum), 2, 512, nullptr, out.data());
  check(out[0] == 512.0 * 511.0 / 2 + 256.0 && out[1] == out[0], "block sum: " + std::to_string(out[0]));
}

// ---- misuse: the launch fails naming what happened; the next launch works ---------------------

__global__ void early_exit_before_barrier(int* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}
__global__ void lane_outside_mask(int* out) { out[threadIdx.x] = __shfl_down_sync(0xfffffffeu, 1, 1); }
__global__ void different_masks(int* out) {
  out[threadIdx.x] = __shfl_down_sync(threadIdx.x == 1 ? 0x3u : 0xffffffffu, 1, 1);
}
__global__ void reads_outside_mask(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_sync(0x0000ffffu, 1, 20);
}
__global__ void exits_while_awaited(int* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1, 1);
}
__global__ void awaits_exited(int* out) {
  if (threadIdx.x >= 16) out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1, 1);
}
__global__ void deadlock(int* out) {
  if (threadIdx.x < 31) out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1, 1);
  __syncthreads();
}
__global__ void bad_width(int* out) { out[threadIdx.x] = __shfl_down_sync(0xffffffffu, 1, 1, 12); }

void check_misuse() {
  std::vector<int> out(1024, 0);
  int* o = out.data();
  const struct {
    const char* name;
    std::string error;
    const char* expected;
  } cases[] = {
      {"early exit", launch_error([&] { FUSED_OPTIM_LAUNCH((early_exit_before_barrier), 2, 64, nullptr, o); }),
       "exited while"},
      {"lane outside its mask", launch_error([&] { FUSED_OPTIM_LAUNCH((lane_outside_mask), 1, 32, nullptr, o); }),
       "the calling lane is not in the mask"},
      {"different masks", launch_error([&] { FUSED_OPTIM_LAUNCH((different_masks), 1, 32, nullptr, o); }),
       "other lanes of the warp wait at __shfl_down_sync with mask 0xffffffff"},
      {"read outside the mask", launch_error([&] { FUSED_OPTIM_LAUNCH((reads_outside_mask), 1, 32, nullptr, o); }),
       "reads lane 20, which is not in the mask"},
      {"exit while awaited", launch_error([&] { FUSED_OPTIM_LAUNCH((exits_while_awaited), 1, 32, nullptr, o); }),
       "exited while lanes 0x0000ffff wait for it at __shfl_down_sync"},
      {"awaits exited lanes", launch_error([&] { FUSED_OPTIM_LAUNCH((awaits_exited), 1, 32, nullptr, o); }),
       "the mask names lanes that have exited (0x0000ffff)"},
      {"deadlock", launch_error([&] { FUSED_OPTIM_LAUNCH((deadlock), 1, 64, nullptr, o); }), "deadlock"},
      {"bad width", launch_error([&] { FUSED_OPTIM_LAUNCH((bad_width), 1, 32, nullptr, o); }), "width 12"},
      {"empty grid", launch_error([&] { FUSED_OPTIM_LAUNCH((mirror), 0, 32, nullptr, o); }),
       "invalid configuration argument (emulation: a grid dimension is 0)"},
      {"1025 threads", launch_error([&] { FUSED_OPTIM_LAUNCH((mirror), 1, 1025, nullptr, o); }),
       "invalid configuration argument (emulation: a block of 1025 threads"},
      {"2048 threads in 3-D", launch_error([&] { FUSED_OPTIM_LAUNCH((coordinates), 1, dim3(32, 32, 2), nullptr, o); }),
       "invalid configuration argument"},
  };
  for (const auto& c : cases) {
    check(contains(c.error, "cuda_emulation_checks.cpp:") && contains(c.error, "CUDA kernel launch failed: ") &&
              contains(c.error, c.expected),
          std::string("misuse: ") + c.name + ": got \"" + c.error + "\"");
    check(cudaGetLastError() == cudaSuccess, std::string("misuse: ") + c.name + ": the error was not cleared");
  }
  const std::string runtime = cases[0].error;
  check(contains(runtime, "unspecified launch failure (emulation: block (0, 0, 0): "), "failure text: " + runtime);
  check_barriers();  // fibers abandoned by the failed launches start afresh
  check_block_sum();
}

// ---- fp16 and bf16 conversions -------------------------------------------------------------------

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round trips, ties to even between neighbours, NaN and inf, for a 16-bit format whose values
// widen exactly to float (to_float) and narrow by round to nearest even (from_float).
template <typename ToFloat, typename FromFloat>
void check_format(const char* name, ToFloat to_float, FromFloat from_float, uint16_t inf) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = to_float(static_cast<uint16_t>(h));
    const bool nan = (h & 0x7fffu) > inf;
    if (nan) {
      check(std::isnan(f), std::string(name) + ": NaN " + std::to_string(h) + " widens to a NaN");
      continue;
    }
    check(from_float(f) == h, std::string(name) + ": round trip of " + std::to_string(h));
    const float next = to_float(static_cast<uint16_t>(h + 1));  // the next value up in magnitude
    if (std::isinf(f) || std::isinf(next)) continue;  // (rounding to inf: checked below)
    // Their midpoint is exact in float: it rounds to the even one, a float ulp either side of it to
    // the nearer one.
    const float mid = f + (next - f) / 2;
    const uint32_t even = (h & 1u) == 0 ? h : h + 1;
    check(from_float(mid) == even, std::string(name) + ": tie after " + std::to_string(h));
    check(from_float(from_bits(bits(mid) - 1)) == h, std::string(name) + ": below the tie after " + std::to_string(h));
    check(from_float(from_bits(bits(mid) + 1)) == h + 1,
          std::string(name) + ": above the tie after " + std::to_string(h));
  }
  check(from_float(from_bits(0x7fc00001u)) == 0x7fffu && from_float(-from_bits(0x7f800001u)) == 0x7fffu,
        std::string(name) + ": NaN narrows to 0x7fff");
  check(from_float(from_bits(0x7f800000u)) == inf && from_float(-from_bits(0x7f800000u)) == (0x8000u | inf),
        std::string(name) + ": inf");
  check(from_float(3.4e38f) == inf, std::string(name) + ": the largest floats round to inf");
}

void check_conversions() {
  check_format(
      "fp16", [](uint16_t h) { return __half2float(__half{h}); }, [](float f) { return __float2half_rn(f).__x; },
      0x7c00u);
  check_format(
      "bf16", [](uint16_t h) { return __bfloat162float(__nv_bfloat16{h}); },
      [](float f) { return __float2bfloat16_rn(f).__x; }, 0x7f80u);
  check(bits(__half2float(__half{0xfe01u})) == 0x7fffffffu, "fp16: a NaN widens to CUDA's 0x7fffffff");
  check(__float2half_rn(65519.99f).__x == 0x7bffu && __float2half_rn(65520.0f).__x == 0x7c00u,
        "fp16: 65520 is where rounding reaches inf");
  check(__float2half_rn(0x1p-25f).__x == 0 && __float2half_rn(0x1.000002p-25f).__x == 1,
        "fp16: 2^-25 ties to 0, above it the smallest subnormal");
  // GCC's _Float16 (IEEE binary16, round to nearest even) as an independent oracle, on random floats.
  std::mt19937 gen(7);
  for (int i = 0; i < 2000000; ++i) {
    const float f = from_bits(static_cast<uint32_t>(gen()));
    if (std::isnan(f)) continue;
    const _Float16 ieee = static_cast<_Float16>(f);
    uint16_t expected;
    std::memcpy(&expected, &ieee, sizeof expected);
    if (__float2half_rn(f).__x != expected) {
      check(false, "fp16: " + std::to_string(bits(f)) + " rounds unlike _Float16");
      break;
    }
  }
}

}  // namespace

int main() {
  check_barriers();
  check_coordinates();
  check_shuffles();
  check_block_sum();
  check_misuse();
  check_conversions();
  std::printf("%d failures\n", failures);
  return failures;
}
