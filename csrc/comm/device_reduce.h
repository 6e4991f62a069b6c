// The reduce-scatter kernel's arithmetic, compiled for the GPU and the host.
//
// A reduction is a list of segments, each `count` elements:
//   out[dst + i] = scale * (in[0][src + i] + in[1][src + i] + ... )
// summed in fp32 in peer order, rounded once to the output dtype (simd's
// bf16 rounding): the same order and rounding as the CPU's comm::reduce, so
// both give the same bits.
//
// Work is split into tiles so that one launch covers a whole parameter group
// whatever its segments' sizes. Inside a segment each thread moves 16 bytes
// of every input at a time; a segment whose input and output start at
// different offsets within 16 bytes falls back to one element at a time.
// Every function here is __host__ __device__: the C++ tests run the kernel's
// exact code on the host, block by block and thread by thread, to check its
// index arithmetic on tails, odd sizes and every dtype without a GPU.
#pragma once

#include <cstdint>
#include <cstring>

#include "simd/bf16.h"

#if defined(__CUDACC__)
#define HP_HD __host__ __device__ inline
#else
#define HP_HD inline
#endif
#if defined(__CUDA_ARCH__)
#define HP_UNROLL _Pragma("unroll")
#else
#define HP_UNROLL
#endif

namespace hp::comm::kernel {

using bf16_bits = uint16_t;

inline constexpr int kMaxPeers = 64;
// Kernel parameters stay under 4 KiB: longer lists take several launches.
inline constexpr int kMaxSegments = 48;
inline constexpr unsigned kThreads = 256;
inline constexpr unsigned kUnitsPerThread = 4;
inline constexpr uint64_t kUnitsPerTile = uint64_t(kThreads) * kUnitsPerThread;

struct Segment {
  uint64_t src = 0, dst = 0, count = 0;  // in elements
};

// A launch: the inputs (one per peer, 16-byte aligned), the output, the
// segments and where each segment's tiles start (first_tile[segments] is the
// grid size).
struct Args {
  const void* in[kMaxPeers];
  int peers = 0;
  void* out = nullptr;
  float scale = 1.0f;
  int segments = 0;
  Segment segment[kMaxSegments];
  uint64_t first_tile[kMaxSegments + 1];
};

using simd::from_float;
using simd::to_float;

// Elements of T in 16 bytes.
template <typename T>
HP_HD constexpr unsigned vector_width() {
  return 16 / sizeof(T);
}

// How a segment splits: `head` single elements up to the first 16-byte
// boundary of the input, `units` runs of `width` elements, `tail` single
// elements. `width` is 1 when input and output cannot both be aligned.
struct Split {
  uint64_t head = 0, units = 0, tail = 0;
  unsigned width = 1;
};

HP_HD Split split(const Segment& segment, unsigned vector) {
  Split s;
  if (segment.src % vector != segment.dst % vector) {
    s.units = segment.count;
    return s;
  }
  s.width = vector;
  s.head = (vector - segment.src % vector) % vector;
  if (s.head > segment.count) s.head = segment.count;
  s.units = (segment.count - s.head) / vector;
  s.tail = segment.count - s.head - s.units * vector;
  return s;
}

// Tiles a segment takes; one at least when it has single elements to do.
HP_HD uint64_t tiles_of(const Split& s) {
  uint64_t tiles = (s.units + kUnitsPerTile - 1) / kUnitsPerTile;
  return tiles == 0 && s.head + s.tail > 0 ? 1 : tiles;
}

// The segment whose tiles include `tile`.
HP_HD int segment_of(const Args& args, uint64_t tile) {
  int low = 0, high = args.segments - 1;
  while (low < high) {  // last segment with first_tile <= tile
    int mid = (low + high + 1) / 2;
    if (args.first_tile[mid] <= tile)
      low = mid;
    else
      high = mid - 1;
  }
  return low;
}

// out[dst + e] for one element, summed over the peers.
template <typename In, typename Out>
HP_HD void reduce_element(const Args& args, const Segment& segment, uint64_t e) {
  float sum = to_float(static_cast<const In*>(args.in[0])[segment.src + e]);
  for (int p = 1; p < args.peers; ++p) sum += to_float(static_cast<const In*>(args.in[p])[segment.src + e]);
  static_cast<Out*>(args.out)[segment.dst + e] = from_float<Out>(args.scale == 1.0f ? sum : sum * args.scale);
}

struct alignas(16) Bytes16 {
  uint32_t word[4];
};

// One 16-byte load: a vector load on the GPU.
HP_HD Bytes16 load16(const void* address) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const Bytes16*>(address);
#else
  Bytes16 value;
  memcpy(&value, address, sizeof value);
  return value;
#endif
}

// Stores `width` results at element e of the output, in 16-byte pieces
// where they make some (16 bytes of In may widen to 32 bytes of Out, or
// narrow to 8).
template <typename Out, unsigned kWidth>
HP_HD void store_vector(const Args& args, const Segment& segment, uint64_t e, const float* sum) {
  Out result[kWidth];
  for (unsigned i = 0; i < kWidth; ++i) result[i] = from_float<Out>(args.scale == 1.0f ? sum[i] : sum[i] * args.scale);
  Out* out = static_cast<Out*>(args.out) + segment.dst + e;
  if constexpr (sizeof(result) % 16 == 0) {
    for (unsigned piece = 0; piece < sizeof(result) / 16; ++piece) {
#if defined(__CUDA_ARCH__)
      reinterpret_cast<Bytes16*>(out)[piece] = reinterpret_cast<const Bytes16*>(result)[piece];
#else
      memcpy(reinterpret_cast<char*>(out) + 16 * piece, reinterpret_cast<const char*>(result) + 16 * piece, 16);
#endif
    }
  } else if constexpr (sizeof(result) == 8) {  // fp32 into bf16: 8-byte aligned, as the input is 16
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<uint64_t*>(out) = *reinterpret_cast<const uint64_t*>(result);
#else
    memcpy(out, result, 8);
#endif
  } else {
    memcpy(out, result, sizeof result);
  }
}

// Thread `thread` of block `block`: its units of the block's tile, and for a
// segment's first tile its share of the single head and tail elements. All
// of a thread's 16-byte loads from one peer are issued before any is summed,
// so that each thread keeps kUnitsPerThread loads in flight.
template <typename In, typename Out>
HP_HD void reduce_thread(const Args& args, uint64_t block, unsigned thread) {
  constexpr unsigned kWidth = vector_width<In>();
  const int index = segment_of(args, block);
  const Segment& segment = args.segment[index];
  const Split s = split(segment, kWidth);
  const uint64_t tile = block - args.first_tile[index];
  const uint64_t first = tile * kUnitsPerTile + thread;
  unsigned mine = 0;  // units of this thread: first, first + kThreads, ...
  while (mine < kUnitsPerThread && first + uint64_t(mine) * kThreads < s.units) ++mine;
  // Loops run their full constant count (guarded) so that the GPU compiler
  // unrolls them and keeps the arrays in registers.
  if (s.width == 1) {
    HP_UNROLL for (unsigned k = 0; k < kUnitsPerThread; ++k) {
      if (k < mine) reduce_element<In, Out>(args, segment, s.head + first + uint64_t(k) * kThreads);
    }
  } else if (mine > 0) {
    float sum[kUnitsPerThread][kWidth] = {};  // set by peer 0 (zeroed only for the host compiler's sake)
    for (int p = 0; p < args.peers; ++p) {
      Bytes16 bytes[kUnitsPerThread]{};
      HP_UNROLL for (unsigned k = 0; k < kUnitsPerThread; ++k) {
        if (k < mine)
          bytes[k] = load16(static_cast<const In*>(args.in[p]) + segment.src + s.head +
                            (first + uint64_t(k) * kThreads) * kWidth);
      }
      HP_UNROLL for (unsigned k = 0; k < kUnitsPerThread; ++k) {
        if (k >= mine) continue;
        In values[kWidth];
        memcpy(values, &bytes[k], sizeof values);
        HP_UNROLL for (unsigned i = 0; i < kWidth; ++i)
          sum[k][i] = p == 0 ? to_float(values[i]) : sum[k][i] + to_float(values[i]);
      }
    }
    HP_UNROLL for (unsigned k = 0; k < kUnitsPerThread; ++k) {
      if (k < mine)
        store_vector<Out, kWidth>(args, segment, s.head + (first + uint64_t(k) * kThreads) * kWidth, sum[k]);
    }
  }
  if (tile == 0) {
    if (thread < s.head) reduce_element<In, Out>(args, segment, thread);
    if (thread < s.tail) reduce_element<In, Out>(args, segment, s.head + s.units * s.width + thread);
  }
}

// Fills first_tile from the segments; returns the number of tiles (blocks).
HP_HD uint64_t plan_tiles(Args& args, unsigned vector) {
  uint64_t tiles = 0;
  for (int i = 0; i < args.segments; ++i) {
    args.first_tile[i] = tiles;
    tiles += tiles_of(split(args.segment[i], vector));
  }
  args.first_tile[args.segments] = tiles;
  return tiles;
}

}  // namespace hp::comm::kernel
