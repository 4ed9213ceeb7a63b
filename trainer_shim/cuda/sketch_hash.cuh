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

}  // namespace rankscope_cuda

#endif  // RANKSCOPE_TRAINER_SHIM_CUDA_SKETCH_HASH_CUH_
