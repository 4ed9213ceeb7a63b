// The count sketch of a GPU gradient at memory bandwidth (issue 33, item 1): one pass over the
// values, bins privatised in shared memory, one merge into global memory per thread block. Loaded
// and launched from Python through the CUDA driver API (rankscope/_cuda_sketch.py); built by nvcc
// into rankscope/_sketch.fatbin (trainer_shim/cuda/CMakeLists.txt).
//
// Contract. rankscope_sketch_{f32,bf16,f16} add the values x[0 .. n) as the coordinates
// [offset, offset + n), and rankscope_sketch_pieces_{f32,bf16,f16} the pieces of a piece table (a
// DDP bucket's segments, one launch: SketchKernel below), to a count sketch of `dim` bins (32 <=
// dim, and the shared memory below fits the device) into `bins` (float32[dim], global memory, added
// to with atomicAdd) and their float64 sum of squares into *ss (also atomicAdd). Bins and signs are
// sketch.h's SketchHash, through sketch_hash.cuh (the host test checks that header against
// sketch.h): the same coordinate goes to the same bin with the same sign as the C++ kernel, the
// torch ops and the Triton kernels. Each bin is a float32 sum (values within a warp's private
// sketch in coordinate order, then the warps of a block, then the blocks in whatever order their
// atomics land): within float32 rounding of the torch-op path's float64 sum, not bit-reproducible
// run to run. Squares are exact float64 products summed in float64. Nothing synchronises with the
// host; the kernel runs on the stream it is launched on.
//
// Design (why this should run near copy bandwidth; measured on no GPU yet: docs/PERFORMANCE.md).
//  * A block is kWarps = 8 warps. Each warp owns a PRIVATE sketch of dim float32 bins in shared
//    memory, so a bin is updated with a plain ld.shared/st.shared, no atomic: within one warp
//    instruction the 32 lanes hold the 32 coordinates of ONE hash block, whose bins start + 0 ..
//    start + 31 (mod dim) are distinct, and consecutive, so the 32 accesses hit 32 banks (one
//    wavefront; two where the block wraps a dim that is not a multiple of 32).
//  * A warp takes tiles of 32 hash blocks (1,024 coordinates, 4 KiB of float32 or 2 KiB of 16-bit
//    values) with 16-byte loads: each lane issues 32 / V loads of V values (V = 4 float32 or 8
//    bfloat16/float16), all before using any, so a warp has its whole tile (2-4 KiB) in flight and
//    an SM with 8-24 warps 16-96 KiB, above the ~20 KiB Little's law asks per SM on an H100 (about
//    25 B/ns per SM x ~700 ns). A warp-instruction's 32 loads are 512 contiguous bytes: coalesced.
//  * 16-byte loads give each lane V consecutive coordinates of one block, while the private-sketch
//    update wants a lane per coordinate of the same block; the tile therefore goes through a
//    per-warp staging buffer in shared memory (16-byte stores, conflict-free; then lane o reads
//    offset o of block b, 2 or 4 bytes, conflict-free). Per value: 1/V stage store, 1 stage load,
//    1 bin load, 1 bin store: ~3.3 shared accesses, ~12 of the SM's 32 a clock at 3.7 float32
//    values a clock (H100 copy bandwidth spread over 132 SMs), so shared memory is not the limit.
//  * The hash: lane b of a tile computes SketchMix of block b once (64-bit multiplies, ~20
//    instructions amortised over 32 coordinates) and the block's start bin and sign word reach the
//    other lanes by two shuffles per block. A sign is an XOR into the float's sign bit.
//  * A tile not wholly inside [offset, offset + n), or whose first value is not 16-byte aligned
//    (a segment at an odd offset), is read element by element into the stage (zeros outside):
//    correct for any offset and pointer, slower only on those tiles.
//  * Lanes of a warp are not in lockstep under the memory model (independent thread scheduling):
//    a __syncwarp after each block's update orders it before the next block's, whose lanes may
//    touch the same bins; the one after the stage's stores orders them before its loads, and the
//    last block's before the next tile's stores.
//  * After the last tile: __syncthreads, then thread t sums bin t of the 8 private sketches and
//    makes one atomicAdd into global memory (bins that stayed 0 are skipped): dim atomics a block,
//    against 1,024 x tiles values, so the merge costs little while there are >= a few tiles a warp
//    (the loader sizes the grid so: _cuda_sketch.py). The squares: a double per lane, a warp sum by
//    shuffles, one atomicAdd per warp.
//  * Shared memory per block: 8 dim float32 (sketches) + 8 x 1,024 values (stages) = 32 dim +
//    32 KiB (float32) or 32 dim + 16 KiB (16-bit): dim 1,024 -> 64 / 48 KiB (3 / 4 blocks an
//    H100 SM: 24 / 32 warps); dim 4,096 -> 160 / 144 KiB (1 block, 8 warps: 12.5 % occupancy,
//    still 32 / 16 KiB in flight). Above the device's opt-in limit per block (227 KiB on sm_90,
//    plus the 1 KiB the system reserves a block: dim > 6,240 for float32, > 6,752 for 16-bit
//    values) the loader does not choose this kernel: the Triton one runs (rankscope._backend). All
//    of it is dynamic shared memory (the launch sizes it), none static.
//  * Registers: asserted <= 64 a thread with no spills and no local memory by
//    tests/python/test_cuda_sketch_build.py (cuobjdump -res-usage), so registers never limit
//    the blocks an SM holds below what shared memory allows.
#include <cuda_fp16.h>
#include <stdint.h>

#include "sketch_hash.cuh"

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
using rankscope_cuda::kTileBlocks;
using rankscope_cuda::kTileValues;

template <typename T>
struct Value;
template <>
struct Value<float> {
  static __device__ __forceinline__ float ToFloat(float v) { return v; }
};
template <>
struct Value<uint16_t> {  // bfloat16 bits: the high half of a float32
  static __device__ __forceinline__ float ToFloat(uint16_t v) {
    return __uint_as_float(static_cast<uint32_t>(v) << 16);
  }
};
struct Half {
  uint16_t bits;
};
template <>
struct Value<Half> {
  static __device__ __forceinline__ float ToFloat(Half v) {
    return __half2float(__ushort_as_half(v.bits));
  }
};

// Tile `block0` of the walk over the values x[0 .. n) as coordinates [offset, offset + n) into the
// warp's private `sketch`, through its `stage`; the squares into `squares`.
template <typename T>
__device__ __forceinline__ void SketchTile(const T* __restrict__ x, long long n, long long offset,
                                           long long block0, unsigned long long seed,
                                           unsigned int dim, float* sketch, T* stage, uint32_t lane,
                                           double& squares) {
  static_assert(16 % sizeof(T) == 0, "16-byte loads of whole values");
  constexpr int kVec = 16 / sizeof(T);                             // values a 16-byte load
  constexpr int kLoads = kTileValues / (32 * kVec);                // 16-byte loads a lane a tile
  const long long i0 = rankscope_cuda::TileIndex(block0, offset);  // x index of its first
  if (rankscope_cuda::VectorTile(reinterpret_cast<uintptr_t>(x), sizeof(T), i0, n)) {
    const uint4* src = reinterpret_cast<const uint4*>(x + i0);
    uint4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) v[u] = __ldcs(src + u * 32 + lane);  // streamed once
#pragma unroll
    for (int u = 0; u < kLoads; ++u) reinterpret_cast<uint4*>(stage)[u * 32 + lane] = v[u];
  } else {
    for (int e = lane; e < kTileValues; e += 32) {
      const long long i = i0 + e;
      stage[e] = (i >= 0 && i < n) ? x[i] : T{};
    }
  }
  // Lane b hashes block b of the tile; the others read its start and signs by shuffles.
  const rankscope_cuda::BlockHash mine = rankscope_cuda::HashBlock(
      static_cast<uint64_t>(block0 + lane), static_cast<uint64_t>(seed), dim);
  __syncwarp();
#pragma unroll 4  // 8 spills in the piece-table bfloat16 kernel (ptxas 13.0)
  for (int b = 0; b < kTileBlocks; ++b) {
    const uint32_t start = __shfl_sync(0xffffffffu, mine.start, b);
    const uint32_t signs = __shfl_sync(0xffffffffu, mine.signs, b);
    const float value = Value<T>::ToFloat(stage[b * 32 + lane]);
    squares += static_cast<double>(value) * static_cast<double>(value);
    const uint32_t bin = rankscope_cuda::BinOf(start, lane, dim);
    sketch[bin] += __uint_as_float(__float_as_uint(value) ^ rankscope_cuda::SignBit(signs, lane));
    // Block b + 1 may put another lane on this bin: its read must see this store (the CUDA
    // memory model orders lanes of a warp only at a sync; a converged warp pays ~nothing). The
    // last one also orders this tile's stage reads before the next tile's stores.
    __syncwarp();
  }
}

// The whole kernel. kPieces false: the values x[0 .. n) as coordinates [offset, offset + n),
// tiles dealt to the grid's warps in turn. kPieces true: a piece table of n pieces (the Triton
// kernels' table, triton_kernels.piece_table: piece p holds coordinates [goffs[p], goffs[p] +
// counts[p]) at x + starts[p], a start of any sign), pieces dealt to the warps in turn, each
// walked whole (a piece of at most 2,048 coordinates in one aligned 2,048 window: 2 tiles).
template <typename T, bool kPieces>
__device__ __forceinline__ void SketchKernel(const T* __restrict__ x, long long n, long long offset,
                                             const long long* __restrict__ starts,
                                             const long long* __restrict__ counts,
                                             const long long* __restrict__ goffs,
                                             unsigned long long seed, unsigned int dim,
                                             float* __restrict__ bins, double* __restrict__ ss) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5;
  const uint32_t lane = threadIdx.x & 31;
  float* sketch = reinterpret_cast<float*>(smem) + warp * dim;
  T* stage =
      reinterpret_cast<T*>(reinterpret_cast<float*>(smem) + kWarps * dim) + warp * kTileValues;

  for (uint32_t b = lane; b < dim; b += 32) sketch[b] = 0.0f;
  __syncwarp();

  double squares = 0.0;
  const long long first = static_cast<long long>(blockIdx.x) * kWarps + warp;
  const long long warps = static_cast<long long>(gridDim.x) * kWarps;
  if (kPieces) {
    for (long long p = first; p < n; p += warps) {
      const long long count = counts[p];
      if (count <= 0) continue;
      const long long goff = goffs[p];
      const T* piece = x + starts[p];
      const rankscope_cuda::TileWalk walk = rankscope_cuda::Walk(goff, count);
      for (long long t = 0; t < walk.tiles; ++t) {
        SketchTile(piece, count, goff, rankscope_cuda::TileBlock(walk, t), seed, dim, sketch, stage,
                   lane, squares);
      }
    }
  } else if (n > 0) {
    const rankscope_cuda::TileWalk walk = rankscope_cuda::Walk(offset, n);
    for (long long t = first; t < walk.tiles; t += warps) {
      SketchTile(x, n, offset, rankscope_cuda::TileBlock(walk, t), seed, dim, sketch, stage, lane,
                 squares);
    }
  }

  for (int s = 16; s > 0; s >>= 1) squares += __shfl_down_sync(0xffffffffu, squares, s);
  if (lane == 0 && squares != 0.0) atomicAdd(ss, squares);
  __syncthreads();
  const float* all = reinterpret_cast<const float*>(smem);
  for (uint32_t b = threadIdx.x; b < dim; b += kThreads) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += all[w * dim + b];
    if (sum != 0.0f) atomicAdd(bins + b, sum);
  }
}

}  // namespace

// The entry points (unmangled: the loader looks them up by name); launch with blockDim kThreads
// (256) and 32 dim + 8 x 1,024 x (value size) bytes of dynamic shared memory
// (rankscope/_cuda_sketch.py, shared_bytes). bfloat16 and float16 values come as their bits.
#define RANKSCOPE_SKETCH_ENTRY(suffix, T, V)                                                       \
  extern "C" __global__ void __launch_bounds__(kThreads) rankscope_sketch_##suffix(                \
      const T* x, long long n, long long offset, unsigned long long seed, unsigned int dim,        \
      float* bins, double* ss) {                                                                   \
    SketchKernel<V, false>(reinterpret_cast<const V*>(x), n, offset, nullptr, nullptr, nullptr,    \
                           seed, dim, bins, ss);                                                   \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(kThreads) rankscope_sketch_pieces_##suffix(         \
      const T* x, const long long* starts, const long long* counts, const long long* goffs,        \
      long long n_pieces, unsigned long long seed, unsigned int dim, float* bins, double* ss) {    \
    SketchKernel<V, true>(reinterpret_cast<const V*>(x), n_pieces, 0, starts, counts, goffs, seed, \
                          dim, bins, ss);                                                          \
  }

RANKSCOPE_SKETCH_ENTRY(f32, float, float)
RANKSCOPE_SKETCH_ENTRY(bf16, uint16_t, uint16_t)
RANKSCOPE_SKETCH_ENTRY(f16, uint16_t, Half)
