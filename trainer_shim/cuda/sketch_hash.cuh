// The count sketch's hash for the CUDA kernel (sketch.cu), written once for the host and the
// device: the same arithmetic as agent/include/rankscope/sketch.h (SketchMix, SketchHash), which is
// the contract. The host compiler builds this header too (tests/cuda_sketch_hash_test.cc compares
// every function here with sketch.h's over many indices, seeds and dims), so a change that breaks
// CPU/GPU agreement fails on a machine without a GPU.
//
// The hash must not change here alone: bench/sketch_accuracy.py measured the sketch's accuracy with
// this hash, and the CPU kernel, the torch ops and the Triton kernels use it.
#ifndef RANKSCOPE_TRAINER_SHIM_CUDA_SKETCH_HASH_CUH_
#define RANKSCOPE_TRAINER_SHIM_CUDA_SKETCH_HASH_CUH_

#include <stdint.h>

#if defined(__CUDACC__)
#define RANKSCOPE_HD __host__ __device__ __forceinline__
#else
#define RANKSCOPE_HD inline
#endif

namespace rankscope_cuda {

// sketch.h's kSketchMixGolden, kSketchMixM1, kSketchMixM2 (the host test compares them).
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kM2 = 0x94D049BB133111EBULL;
constexpr uint32_t kBlock = 32;  // coordinates per hash block (sketch.h kSketchBlock)

// SketchMix(index, seed): output `index` of SplitMix64 seeded with `seed` (uint64, logical shifts).
RANKSCOPE_HD uint64_t Mix(uint64_t index, uint64_t seed) {
  uint64_t z = seed + (index + 1) * kGolden;
  z = (z ^ (z >> 30)) * kM1;
  z = (z ^ (z >> 27)) * kM2;
  return z ^ (z >> 31);
}

// What a hash block contributes: its start bin ((mix >> 32) % dim) and its 32 sign bits (bit o set:
// offset o has sign -1). One per 32 coordinates; the kernel computes it in one lane and broadcasts.
struct BlockHash {
  uint32_t start;
  uint32_t signs;
};

RANKSCOPE_HD BlockHash HashBlock(uint64_t block, uint64_t seed, uint32_t dim) {
  const uint64_t mix = Mix(block, seed);
  return BlockHash{static_cast<uint32_t>(mix >> 32) % dim, static_cast<uint32_t>(mix)};
}

// The bin of offset `o` (< 32) of a block starting at `start` (< dim), for dim >= 32: wraps at most
// once, so a compare and subtract replaces sketch.h's second remainder.
RANKSCOPE_HD uint32_t BinOf(uint32_t start, uint32_t o, uint32_t dim) {
  const uint32_t bin = start + o;
  return bin >= dim ? bin - dim : bin;
}

// The sign of offset `o` as the bit to XOR into a float's sign bit (0 or 0x80000000).
RANKSCOPE_HD uint32_t SignBit(uint32_t signs, uint32_t o) { return ((signs >> o) & 1u) << 31; }

// The kernel's walk over the coordinates [offset, offset + n), n > 0: tiles of kTileBlocks whole
// hash blocks from the block holding `offset`. Pure index arithmetic, so the host test checks
// that the walk covers every coordinate once, each with its own block and offset.
constexpr int kTileBlocks = 32;                                      // hash blocks a warp's tile
constexpr int kTileValues = kTileBlocks * static_cast<int>(kBlock);  // 1,024 coordinates

struct TileWalk {
  long long first_block;  // the hash block of coordinate `offset`
  long long tiles;        // tiles to cover [offset, offset + n)
};

RANKSCOPE_HD TileWalk Walk(long long offset, long long n) {
  const long long first_block = offset >> 5;
  const long long blocks = ((offset + n - 1) >> 5) - first_block + 1;
  return TileWalk{first_block, (blocks + kTileBlocks - 1) / kTileBlocks};
}

// The first hash block of tile t, and the index into the values of its first coordinate (negative
// for the first tile when `offset` is not a multiple of 32): value i is coordinate offset + i.
RANKSCOPE_HD long long TileBlock(TileWalk walk, long long t) {
  return walk.first_block + t * kTileBlocks;
}
RANKSCOPE_HD long long TileIndex(long long tile_block, long long offset) {
  return tile_block * static_cast<long long>(kBlock) - offset;
}

// Whether a tile is read with 16-byte loads: wholly inside the n values and its first value, at
// address x + i0 * size (x: the values' address), on a 16-byte boundary.
RANKSCOPE_HD bool VectorTile(uintptr_t x, unsigned size, long long i0, long long n) {
  const uintptr_t first = x + static_cast<uintptr_t>(i0) * size;  // wraps as the address would
  return (first & 15) == 0 && i0 >= 0 && i0 + kTileValues <= n;
}

}  // namespace rankscope_cuda

#endif  // RANKSCOPE_TRAINER_SHIM_CUDA_SKETCH_HASH_CUH_
