// The CUDA kernel's hash helpers (trainer_shim/cuda/sketch_hash.cuh), compiled for the host, give
// sketch.h's bins and signs: the GPU sketch and the CPU sketch agree coordinate by coordinate.
// Runs without a GPU (the kernel's own launch is checked on one: tests/python/test_gpu.py).

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "rankscope/sketch.h"
#include "trainer_shim/cuda/sketch_hash.cuh"

namespace {

TEST(CudaSketchHashTest, ConstantsAreSketchH) {
  EXPECT_EQ(rankscope_cuda::kGolden, rankscope::kSketchMixGolden);
  EXPECT_EQ(rankscope_cuda::kM1, rankscope::kSketchMixM1);
  EXPECT_EQ(rankscope_cuda::kM2, rankscope::kSketchMixM2);
  EXPECT_EQ(rankscope_cuda::kBlock, rankscope::kSketchBlock);
}

TEST(CudaSketchHashTest, MixIsSketchMix) {
  std::mt19937_64 rng(33);
  for (int i = 0; i < 10000; ++i) {
    const uint64_t index = rng() >> (i % 40);  // small and large block indices
    const uint64_t seed = i % 3 == 0 ? rankscope::kDefaultSketchSeed : rng();
    ASSERT_EQ(rankscope_cuda::Mix(index, seed), rankscope::SketchMix(index, seed))
        << index << " " << seed;
  }
}

// Every coordinate of many blocks, for power-of-two dims and others (>= 32, the kernel's domain),
// through the kernel's split of the work: a block's hash once, then a bin and sign per offset.
TEST(CudaSketchHashTest, BinAndSignAreSketchHash) {
  std::mt19937_64 rng(5);
  const uint32_t dims[] = {32, 33, 100, 1000, 1024, 4096, 6000, 6240};
  for (uint32_t dim : dims) {
    for (int trial = 0; trial < 300; ++trial) {
      const uint64_t block = trial < 100 ? static_cast<uint64_t>(trial) : rng() >> 26;
      const uint64_t seed = trial % 2 ? rankscope::kDefaultSketchSeed : rng();
      const rankscope_cuda::BlockHash h = rankscope_cuda::HashBlock(block, seed, dim);
      ASSERT_LT(h.start, dim);
      for (uint32_t o = 0; o < 32; ++o) {
        const rankscope::SketchSlot want = rankscope::SketchHash(block * 32 + o, seed, dim);
        const uint32_t bin = rankscope_cuda::BinOf(h.start, o, dim);
        // The sign as the kernel applies it: XOR into the sign bit of +1.0f.
        const uint32_t one = 0x3F800000u ^ rankscope_cuda::SignBit(h.signs, o);
        float sign;
        static_assert(sizeof(sign) == sizeof(one));
        std::memcpy(&sign, &one, sizeof(sign));
        ASSERT_EQ(bin, want.bin) << "dim " << dim << " block " << block << " o " << o;
        ASSERT_EQ(sign, want.sign) << "dim " << dim << " block " << block << " o " << o;
      }
    }
  }
}

// The kernel's walk (sketch.cu): tile t's value e = 32 b + lane (staged from x[i0 + e] by either
// read path) is hashed as offset `lane` of block TileBlock + b. Over every tile, each of the n
// values is visited exactly once, as its own coordinate's block and offset; a tile read with
// 16-byte loads lies wholly inside the values, its first value 16-byte aligned.
TEST(CudaSketchHashTest, TileWalkCoversEachCoordinateOnceInItsBlock) {
  const long long offsets[] = {0, 1, 5, 31, 32, 77, 1000005, (1LL << 37) + 3};
  const long long lengths[] = {1, 2, 31, 32, 33, 1023, 1024, 1025, 3000, 70003};
  const unsigned sizes[] = {4, 2};
  for (long long offset : offsets) {
    for (long long n : lengths) {
      for (unsigned size : sizes) {
        for (uintptr_t base : {uintptr_t{0x10000}, uintptr_t{0x10000} + size}) {
          const rankscope_cuda::TileWalk walk = rankscope_cuda::Walk(offset, n);
          std::vector<int> seen(static_cast<size_t>(n), 0);
          for (long long t = 0; t < walk.tiles; ++t) {
            const long long block0 = rankscope_cuda::TileBlock(walk, t);
            const long long i0 = rankscope_cuda::TileIndex(block0, offset);
            const bool vector = rankscope_cuda::VectorTile(base, size, i0, n);
            if (vector) {
              ASSERT_EQ((base + static_cast<uintptr_t>(i0) * size) % 16, 0u);
              ASSERT_TRUE(i0 >= 0 && i0 + rankscope_cuda::kTileValues <= n);
            }
            for (long long b = 0; b < rankscope_cuda::kTileBlocks; ++b) {
              for (long long lane = 0; lane < 32; ++lane) {
                const long long i = i0 + 32 * b + lane;
                if (i < 0 || i >= n) {
                  ASSERT_FALSE(vector);  // a vector tile has no value outside
                  continue;
                }
                ++seen[static_cast<size_t>(i)];
                ASSERT_EQ((offset + i) >> 5, block0 + b) << offset << " " << n << " " << i;
                ASSERT_EQ((offset + i) & 31, lane) << offset << " " << n << " " << i;
              }
            }
          }
          for (long long i = 0; i < n; ++i) {
            ASSERT_EQ(seen[static_cast<size_t>(i)], 1) << offset << " " << n << " " << i;
          }
        }
      }
    }
  }
  // An aligned, whole-tile case does take the 16-byte path.
  EXPECT_TRUE(rankscope_cuda::VectorTile(0x10000, 4, 0, 1024));
  EXPECT_FALSE(rankscope_cuda::VectorTile(0x10004, 4, 0, 1024));
  EXPECT_FALSE(rankscope_cuda::VectorTile(0x10000, 4, 0, 1023));
}

// sketch.h's test vectors, through the helpers.
TEST(CudaSketchHashTest, TestVectors) {
  EXPECT_EQ(rankscope_cuda::Mix(0, 0), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(rankscope_cuda::Mix(385, rankscope::kDefaultSketchSeed), 0xFD1FA0A8C3134223ULL);
  const rankscope_cuda::BlockHash h =
      rankscope_cuda::HashBlock(12345 / 32, rankscope::kDefaultSketchSeed, 1024);
  EXPECT_EQ(rankscope_cuda::BinOf(h.start, 12345 % 32, 1024), 193u);
  EXPECT_NE(rankscope_cuda::SignBit(h.signs, 12345 % 32), 0u);  // sign -1
}

}  // namespace
