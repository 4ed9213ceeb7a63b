// Count sketch kernel (see sketch.h for the hash and the rounding contract).
//
// The hash is per block of kBlock = 32 consecutive coordinates: one SplitMix64 mix gives the
// block a base bin and 32 sign bits, and the block's coordinates go to the window of 32
// consecutive bins base, base + 1, ... (mod dim). So the kernel hashes once per 32 coordinates,
// and every block is a few contiguous vector updates: load 32 values, flip their signs under the
// 32-bit mask, add them into the float partials base .. base + 31, and square them into 32 float
// partial sums. There are dim + 31 float partials (sketch.h "Rounding"): the part of a window
// that wraps past the last bin goes to partials dim .. dim + 30, which the segment's close adds
// into bins 0 .. 30. So no window is split, masked or branched on (the masked updates a split
// window took were a sixth of the AVX2 time at dim 1024: docs/PERFORMANCE.md).
//
// Add cuts its input at segment boundaries (the driver at the bottom closes segments: float
// partial -> double bin, in partial order), and each piece runs in three phases: a scalar head up
// to the next block boundary, a vector body over whole blocks, and a scalar tail. All paths
// (scalar, AVX2, AVX-512) compute the same integer hash, the same exact widening and the same
// float operations in the same order, so their results are bit-identical:
//   - bins: a block's 32 coordinates go to 32 distinct float partials, so each partial receives
//     at most one value per block, and blocks are added in ascending order: every float partial
//     receives its values in ascending index order, whatever dim (for dim < 32 a window wraps
//     onto itself more than once, and its partials still differ).
//   - squares: coordinate i goes to float partial i % 32 by a fused multiply-add (std::fma in the
//     scalar code, vfmadd in the vector code: one rounding either way); after the last
//     coordinate of each run of kRun coordinates (global positions) the partials go into the
//     double lanes.
// Where the time goes: docs/PERFORMANCE.md "## Sketch kernel".
#include "rankscope/sketch.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/cpu_isa.h"
#include "fold_partial_sums.h"
#include "isa_targets.h"

namespace rankscope {
namespace {

using sketch_internal::KernelIsa;

constexpr uint64_t kGolden = kSketchMixGolden;
constexpr uint64_t kMix1 = kSketchMixM1;
constexpr uint64_t kMix2 = kSketchMixM2;

// Coordinates per hash block, coordinates per run of float sums of squares (sketch.h), and the
// number of float partial sums of squares (one per offset in a block).
constexpr uint64_t kBlock = kSketchBlock;
constexpr uint64_t kRun = kSketchSquareRun;
constexpr size_t kLanes = kSketchBlock;
static_assert(kLanes == internal::kPartialSums, "one partial sum of squares per block offset");
static_assert(kRun % kBlock == 0, "a run holds whole blocks");

template <ScalarType kType>
constexpr size_t kElementSize = kType == ScalarType::kFloat32 ? 4 : 2;

// How a mix becomes a block's base bin: (mix >> 32) % dim, by a mask when dim is a power of two,
// else by Lemire's direct remainder (exact for every 32-bit numerator and divisor: Lemire, Kaser
// and Kurz, "Faster remainder by direct computation", 2019).
struct BinMap {
  uint32_t dim;
  uint32_t mask;     // dim - 1; used when dim is a power of two
  uint64_t fastmod;  // 2^64 / dim rounded up (wraps to 0 for dim 1, which gives remainder 0)
};

BinMap MakeBinMap(uint32_t dim) { return BinMap{dim, dim - 1, ~uint64_t{0} / dim + 1}; }

template <bool kPow2>
inline uint32_t BaseOf(uint64_t mix, const BinMap& map) {
  const uint32_t high = static_cast<uint32_t>(mix >> 32);
  if constexpr (kPow2) {
    return high & map.mask;
  } else {
#ifdef __SIZEOF_INT128__
    const uint64_t low = map.fastmod * high;
    return static_cast<uint32_t>((static_cast<unsigned __int128>(low) * map.dim) >> 64);
#else
    return high % map.dim;
#endif
  }
}

// What one piece of an Add writes to: the open segment's float partial bins, the open run's
// float partial squares and the double lanes they close into, and the double lanes of the call's
// own squares (the `squares` output of CountSketch::Add): each head, body and tail sums them in
// float partials of its own, like the run's, closed into these lanes at every run boundary and
// at its end, so a partial never holds squares of another call.
struct KernelArgs {
  uint64_t seed;
  BinMap map;
  float* partial_bins;     // dim + kBlock - 1 floats
  float* partial_squares;  // kLanes floats
  double* square_lanes;    // kLanes doubles
  double* call_lanes;      // kLanes doubles
};

// Closes a run: partial square l into double lane l, partial back to +0.
inline void CloseRunLanes(float* partial, double* lanes) {
  for (size_t l = 0; l < kLanes; ++l) {
    lanes[l] += static_cast<double>(partial[l]);
    partial[l] = 0.0f;
  }
}

template <ScalarType kType>
inline float LoadScalar(const unsigned char* p) {
  if constexpr (kType == ScalarType::kFloat32) {
    float f;
    std::memcpy(&f, p, sizeof f);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return kType == ScalarType::kBFloat16 ? BFloat16ToFloat(h) : Float16ToFloat(h);
  }
}

// SplitMix64 (sketch.h); inlined here, where the exported SketchMix may not be.
inline uint64_t Mix64(uint64_t index, uint64_t seed) {
  uint64_t z = seed + (index + 1) * kGolden;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

// The SplitMix64 finalizer of a state z = seed + (block + 1) * kGolden: Mix64 without the
// multiply, for loops that step z by kGolden from one block to the next.
inline uint64_t Finalize64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

// v with its sign flipped iff the lowest bit of `bits` is set (branch-free, exactly -v then).
inline float ApplySign(float v, uint64_t bits) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u ^= static_cast<uint32_t>(bits & 1) << 31;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// Adds coordinates [first, first + n) one at a time, block by block: the reference for the
// vector paths.
template <ScalarType kType, bool kPow2>
void AddScalar(const unsigned char* data, size_t n, uint64_t first, const KernelArgs& a) {
  float* const partial = a.partial_bins;
  // The call's partial squares in a local array (+0 on entry: closed at the end of every piece),
  // which the stores into the bins cannot alias.
  float call[kLanes] = {};
  size_t j = 0;
  while (j < n) {
    const uint64_t index = first + j;
    const uint64_t mix = Mix64(index / kBlock, a.seed);
    const uint32_t base = BaseOf<kPow2>(mix, a.map);
    const uint32_t first_offset = static_cast<uint32_t>(index % kBlock);
    const size_t count = std::min<size_t>(n - j, kBlock - first_offset);
    for (uint32_t o = first_offset; o < first_offset + count; ++o, ++j) {
      const float v = ApplySign(LoadScalar<kType>(data + j * kElementSize<kType>), mix >> o);
      a.partial_squares[o] = std::fma(v, v, a.partial_squares[o]);
      call[o] = std::fma(v, v, call[o]);
      partial[base + o] += v;  // base + o < dim + 31
      if ((first + j + 1) % kRun == 0) {
        CloseRunLanes(a.partial_squares, a.square_lanes);
        CloseRunLanes(call, a.call_lanes);
      }
    }
  }
  if (n > 0) CloseRunLanes(call, a.call_lanes);
}

// The vector body: `blocks` whole blocks of kBlock coordinates, the first one starting at
// coordinate `first` (a multiple of kBlock).
using BodyFn = void (*)(const unsigned char* data, size_t blocks, uint64_t first,
                        const KernelArgs& a);

template <ScalarType kType, bool kPow2>
void BodyScalar(const unsigned char* data, size_t blocks, uint64_t first, const KernelArgs& a) {
  AddScalar<kType, kPow2>(data, blocks * kBlock, first, a);
}

#ifdef RANKSCOPE_KERNEL_X86

// Software prefetch kPrefetchBytes ahead of the block being added: without it the kernel keeps
// too few misses in flight and reads DRAM at about half the speed (the hardware prefetchers alone
// do not keep up). One prefetch per 64-byte line of input, into L2 (prefetcht1) for every type:
// with prefetcht0 (L1) each miss to DRAM holds one of L1's few fill buffers, which the window's
// own loads then wait for; on AMD Zen 4 the 16-bit types ran 5-14 % slower on AVX-512 that way
// (docs/PERFORMANCE.md "Prefetching into L2"). A prefetch never faults, so running past the end
// of the input is harmless. Inline assembly because GCC 12 silently deleted _mm_prefetch here (it
// treats the builtin as free of side effects once it sits in a small inline function).
constexpr uintptr_t kPrefetchBytes = 8192;
template <ScalarType kType>
__attribute__((always_inline)) inline void PrefetchAhead(const unsigned char* p) {
  const char* ahead = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  asm volatile("prefetcht1 %0" : : "m"(*ahead));
  if constexpr (kType == ScalarType::kFloat32) {  // a block of 32 floats is two lines
    asm volatile("prefetcht1 %0" : : "m"(*(ahead + 64)));
  }
}

// Runs body(data, mix) for `blocks` consecutive blocks starting at block number first / kBlock,
// prefetching ahead of each, and end_run() after every block that ends a run of kRun
// coordinates. `body` adds one block and is inlined.
template <ScalarType kType, class Body, class EndRun>
__attribute__((always_inline)) inline void ForEachBlock(const unsigned char* data, size_t blocks,
                                                        uint64_t first, uint64_t seed, Body&& body,
                                                        EndRun&& end_run) {
  constexpr size_t kBytes = kBlock * kElementSize<kType>;  // 128 or 64
  constexpr uint64_t kBlocksPerRun = kRun / kBlock;
  uint64_t block = first / kBlock;
  uint64_t z = seed + (block + 1) * kGolden;
  while (blocks > 0) {
    const size_t in_run = std::min<uint64_t>(blocks, kBlocksPerRun - block % kBlocksPerRun);
    for (const unsigned char* const end = data + in_run * kBytes; data != end; data += kBytes) {
      PrefetchAhead<kType>(data);
      body(data, Finalize64(z));
      z += kGolden;
    }
    block += in_run;
    blocks -= in_run;
    if (block % kBlocksPerRun == 0) end_run();
  }
}

// ---- AVX2: a block is four vectors of 8 floats.

template <ScalarType kType>
RANKSCOPE_TARGET_AVX2 inline __m256 Load8Avx2(const unsigned char* p) {
  if constexpr (kType == ScalarType::kFloat32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kType == ScalarType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Long: one vector loop whose state (the partial squares, run's and call's) must stay in named
// registers across the inlined block and run-end lambdas; split into functions, it would be
// spilled to memory on every block (see the note on sq0 .. sq3).
template <ScalarType kType, bool kPow2>
RANKSCOPE_TARGET_AVX2 void BodyAvx2(const unsigned char* data, size_t blocks, uint64_t first,
                                    const KernelArgs& a) {
  constexpr size_t kSize = kElementSize<kType>;
  const BinMap map = a.map;
  float* const bins = a.partial_bins;
  // Shifts that move bit o of the mix to the float sign bit of lane o, for o = 8q + l.
  const __m256i shift0 = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
  const __m256i eight = _mm256_set1_epi32(8);
  const __m256i sign_bit = _mm256_set1_epi32(std::numeric_limits<int32_t>::min());
  // bfloat16: word multipliers that move bit i (d0) or 8 + i (d1) of a 16-bit half to bit 15.
  const __m256i bit_to_sign0 = _mm256_setr_epi32(0x80008000, 0x40004000, 0x20002000, 0x10001000,
                                                 0x08000800, 0x04000400, 0x02000200, 0x01000100);
  const __m256i bit_to_sign1 = _mm256_setr_epi32(0x00800080, 0x00400040, 0x00200020, 0x00100010,
                                                 0x00080008, 0x00040004, 0x00020002, 0x00010001);
  const __m256i word_signs = _mm256_set1_epi32(static_cast<int32_t>(0x80008000u));
  const __m256i high_words = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  // Float partial squares of offsets 8q .. 8q + 7, as four named variables: an array captured
  // by the lambdas below was written back to the stack on every block.
  __m256 sq0 = _mm256_loadu_ps(a.partial_squares), sq1 = _mm256_loadu_ps(a.partial_squares + 8),
         sq2 = _mm256_loadu_ps(a.partial_squares + 16),
         sq3 = _mm256_loadu_ps(a.partial_squares + 24);
  // The call's own partial squares (KernelArgs::call_lanes), closed at run ends and at the end.
  __m256 cq0 = _mm256_setzero_ps(), cq1 = _mm256_setzero_ps(), cq2 = _mm256_setzero_ps(),
         cq3 = _mm256_setzero_ps();
  auto add_block = [&](const unsigned char* p, uint64_t mix) RANKSCOPE_TARGET_AVX2 {
    const __m256i m = _mm256_set1_epi32(static_cast<int32_t>(mix));
    __m256 v[4];
    if constexpr (kType == ScalarType::kBFloat16) {
      // Signs in the 16-bit domain, 16 lanes an instruction. Dword i of d0 holds offsets i
      // (low word) and 16 + i (high word), of d1 offsets 8 + i and 24 + i; each word of m is
      // the sign bits of its half of the block (mix bits 0-15 low, 16-31 high).
      const __m256i y0 =
          _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 0xD8);
      const __m256i y1 = _mm256_permute4x64_epi64(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)), 0xD8);
      const __m256i d0 =
          _mm256_xor_si256(_mm256_unpacklo_epi16(y0, y1),
                           _mm256_and_si256(_mm256_mullo_epi16(m, bit_to_sign0), word_signs));
      const __m256i d1 =
          _mm256_xor_si256(_mm256_unpackhi_epi16(y0, y1),
                           _mm256_and_si256(_mm256_mullo_epi16(m, bit_to_sign1), word_signs));
      v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(d0, 16));
      v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(d1, 16));
      v[2] = _mm256_castsi256_ps(_mm256_and_si256(d0, high_words));
      v[3] = _mm256_castsi256_ps(_mm256_and_si256(d1, high_words));
    } else {
      __m256i shift = shift0;
      for (int q = 0; q < 4; ++q) {
        v[q] = _mm256_xor_ps(
            Load8Avx2<kType>(p + 8 * q * kSize),
            _mm256_castsi256_ps(_mm256_and_si256(_mm256_sllv_epi32(m, shift), sign_bit)));
        shift = _mm256_sub_epi32(shift, eight);
      }
    }
    sq0 = _mm256_fmadd_ps(v[0], v[0], sq0);
    sq1 = _mm256_fmadd_ps(v[1], v[1], sq1);
    sq2 = _mm256_fmadd_ps(v[2], v[2], sq2);
    sq3 = _mm256_fmadd_ps(v[3], v[3], sq3);
    cq0 = _mm256_fmadd_ps(v[0], v[0], cq0);
    cq1 = _mm256_fmadd_ps(v[1], v[1], cq1);
    cq2 = _mm256_fmadd_ps(v[2], v[2], cq2);
    cq3 = _mm256_fmadd_ps(v[3], v[3], cq3);
    float* const w = bins + BaseOf<kPow2>(mix, map);
    for (int q = 0; q < 4; ++q) {
      _mm256_storeu_ps(w + 8 * q, _mm256_add_ps(_mm256_loadu_ps(w + 8 * q), v[q]));
    }
  };
  auto close = [](__m256& sq, double* lanes) RANKSCOPE_TARGET_AVX2 {
    _mm256_storeu_pd(
        lanes, _mm256_add_pd(_mm256_loadu_pd(lanes), _mm256_cvtps_pd(_mm256_castps256_ps128(sq))));
    _mm256_storeu_pd(lanes + 4, _mm256_add_pd(_mm256_loadu_pd(lanes + 4),
                                              _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1))));
    sq = _mm256_setzero_ps();
  };
  auto end_run = [&]() RANKSCOPE_TARGET_AVX2 {
    close(sq0, a.square_lanes);
    close(sq1, a.square_lanes + 8);
    close(sq2, a.square_lanes + 16);
    close(sq3, a.square_lanes + 24);
    close(cq0, a.call_lanes);
    close(cq1, a.call_lanes + 8);
    close(cq2, a.call_lanes + 16);
    close(cq3, a.call_lanes + 24);
  };
  ForEachBlock<kType>(data, blocks, first, a.seed, add_block, end_run);
  close(cq0, a.call_lanes);
  close(cq1, a.call_lanes + 8);
  close(cq2, a.call_lanes + 16);
  close(cq3, a.call_lanes + 24);
  _mm256_storeu_ps(a.partial_squares, sq0);
  _mm256_storeu_ps(a.partial_squares + 8, sq1);
  _mm256_storeu_ps(a.partial_squares + 16, sq2);
  _mm256_storeu_ps(a.partial_squares + 24, sq3);
}

// ---- AVX-512: a block is two vectors of 16 floats.

template <ScalarType kType>
RANKSCOPE_TARGET_AVX512 inline __m512 Load16Avx512(const unsigned char* p) {
  if constexpr (kType == ScalarType::kFloat32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (kType == ScalarType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// GCC 12 takes the undefined pass-through operands inside these intrinsics (avx512fintrin.h's
// __Y) for uninitialized variables where they are inlined after the block loop below; they are
// never read (the masks are all ones).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Float partials of block offsets 0-15 (lo) and 16-31 (hi) added into double lanes 0-31.
RANKSCOPE_TARGET_AVX512 inline void AddToLanesAvx512(__m512 lo, __m512 hi, double* lanes) {
  const __m512d parts[4] = {
      _mm512_cvtps_pd(_mm512_castps512_ps256(lo)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(lo, 1)),
      _mm512_cvtps_pd(_mm512_castps512_ps256(hi)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(hi, 1))};
  for (int q = 0; q < 4; ++q) {
    _mm512_storeu_pd(lanes + 8 * q, _mm512_add_pd(_mm512_loadu_pd(lanes + 8 * q), parts[q]));
  }
}

template <ScalarType kType, bool kPow2>
RANKSCOPE_TARGET_AVX512 void BodyAvx512(const unsigned char* data, size_t blocks, uint64_t first,
                                        const KernelArgs& a) {
  constexpr size_t kSize = kElementSize<kType>;
  const BinMap map = a.map;
  float* const bins = a.partial_bins;
  const __m512i sign_bit = _mm512_set1_epi32(std::numeric_limits<int32_t>::min());
  __m512 sq_lo = _mm512_loadu_ps(a.partial_squares);  // offsets 0-15
  __m512 sq_hi = _mm512_loadu_ps(a.partial_squares + 16);
  // The call's own partial squares (KernelArgs::call_lanes), closed at run ends and at the end.
  __m512 cq_lo = _mm512_setzero_ps(), cq_hi = _mm512_setzero_ps();
  auto add_block = [&](const unsigned char* p, uint64_t mix) RANKSCOPE_TARGET_AVX512 {
    const __m512i x = _mm512_castps_si512(Load16Avx512<kType>(p));
    const __m512i y = _mm512_castps_si512(Load16Avx512<kType>(p + 16 * kSize));
    const __m512 lo =
        _mm512_castsi512_ps(_mm512_mask_xor_epi32(x, static_cast<__mmask16>(mix), x, sign_bit));
    const __m512 hi = _mm512_castsi512_ps(
        _mm512_mask_xor_epi32(y, static_cast<__mmask16>(mix >> 16), y, sign_bit));
    sq_lo = _mm512_fmadd_ps(lo, lo, sq_lo);
    sq_hi = _mm512_fmadd_ps(hi, hi, sq_hi);
    cq_lo = _mm512_fmadd_ps(lo, lo, cq_lo);
    cq_hi = _mm512_fmadd_ps(hi, hi, cq_hi);
    float* const w = bins + BaseOf<kPow2>(mix, map);
    _mm512_storeu_ps(w, _mm512_add_ps(_mm512_loadu_ps(w), lo));
    _mm512_storeu_ps(w + 16, _mm512_add_ps(_mm512_loadu_ps(w + 16), hi));
  };
  auto end_run = [&]() RANKSCOPE_TARGET_AVX512 {
    AddToLanesAvx512(sq_lo, sq_hi, a.square_lanes);
    sq_lo = _mm512_setzero_ps();
    sq_hi = _mm512_setzero_ps();
    AddToLanesAvx512(cq_lo, cq_hi, a.call_lanes);
    cq_lo = _mm512_setzero_ps();
    cq_hi = _mm512_setzero_ps();
  };
  ForEachBlock<kType>(data, blocks, first, a.seed, add_block, end_run);
  AddToLanesAvx512(cq_lo, cq_hi, a.call_lanes);
  _mm512_storeu_ps(a.partial_squares, sq_lo);
  _mm512_storeu_ps(a.partial_squares + 16, sq_hi);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // RANKSCOPE_KERNEL_X86

template <ScalarType kType, bool kPow2>
BodyFn SelectBody(KernelIsa isa) {
  switch (isa) {
#ifdef RANKSCOPE_KERNEL_X86
    case KernelIsa::kAvx512:
      return &BodyAvx512<kType, kPow2>;
    case KernelIsa::kAvx2:
      return &BodyAvx2<kType, kPow2>;
#endif
    default:
      return &BodyScalar<kType, kPow2>;
  }
}

// Head (scalar, up to a block boundary), body (vector, whole blocks), tail (scalar).
template <ScalarType kType, bool kPow2>
void AddRange(KernelIsa isa, const unsigned char* data, size_t n, uint64_t first,
              const KernelArgs& a) {
  constexpr size_t kSize = kElementSize<kType>;
  const size_t head = std::min<size_t>(n, (kBlock - first % kBlock) % kBlock);
  AddScalar<kType, kPow2>(data, head, first, a);
  data += head * kSize;
  first += head;
  n -= head;
  const size_t blocks = n / kBlock;
  if (blocks > 0) SelectBody<kType, kPow2>(isa)(data, blocks, first, a);
  const size_t done = blocks * kBlock;
  AddScalar<kType, kPow2>(data + done * kSize, n - done, first + done, a);
}

template <ScalarType kType>
void AddTyped(KernelIsa isa, const unsigned char* data, size_t n, uint64_t first,
              const KernelArgs& a) {
  if ((a.map.dim & (a.map.dim - 1)) == 0) {
    AddRange<kType, true>(isa, data, n, first, a);
  } else {
    AddRange<kType, false>(isa, data, n, first, a);
  }
}

// The kernels for this CPU (common/cpu_isa.h makes the one check): the AVX2 kernels need AVX2,
// FMA, BMI2 and F16C; the AVX-512 ones AVX-512 F, DQ, VL and BW besides.
KernelIsa DetectBestIsa() {
#ifdef RANKSCOPE_KERNEL_X86
  switch (BestCpuIsaLevel()) {
    case CpuIsaLevel::kAvx512:
      return KernelIsa::kAvx512;
    case CpuIsaLevel::kAvx2:
      return KernelIsa::kAvx2;
    case CpuIsaLevel::kBaseline:
      break;
  }
#endif
  return KernelIsa::kScalar;
}

}  // namespace

uint64_t SketchMix(uint64_t index, uint64_t seed) { return Mix64(index, seed); }

SketchSlot SketchHash(uint64_t index, uint64_t seed, uint32_t dim) {
  assert(dim >= 1);
  const uint64_t mix = Mix64(index / kBlock, seed);
  const uint64_t offset = index % kBlock;
  const uint64_t base = (mix >> 32) % dim;
  return SketchSlot{static_cast<uint32_t>((base + offset) % dim),
                    ((mix >> offset) & 1) ? -1.0f : 1.0f};
}

namespace sketch_internal {

bool KernelIsaSupported(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kScalar:
      return true;
    case KernelIsa::kAvx2:
      return BestKernelIsa() != KernelIsa::kScalar;
    case KernelIsa::kAvx512:
      return BestKernelIsa() == KernelIsa::kAvx512;
  }
  return false;
}

std::vector<KernelIsa> SupportedKernelIsas() {
  std::vector<KernelIsa> isas;
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (KernelIsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

KernelIsa BestKernelIsa() {
  static const KernelIsa best = DetectBestIsa();
  return best;
}

const char* KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kScalar:
      return "scalar";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

void AddWithIsa(CountSketch& sketch, KernelIsa isa, const void* data, ScalarType type, size_t n,
                uint64_t offset, double* squares) {
  static_assert(CountSketch::kSumSquaresLanes == kLanes, "one partial sum per block offset");
  if (n == 0) return;
  assert(data != nullptr);
  assert(KernelIsaSupported(isa));
  if (!KernelIsaSupported(isa)) isa = KernelIsa::kScalar;
  // A run other than the open one: close the open one (its partials are +0 if it was completed).
  if (offset / kRun != sketch.open_run_) sketch.CloseRun();
  // This call's squares (sketch.h "Rounding"), computed whether asked for or not: one more fused
  // multiply-add per vector of values in the loop, no branch.
  double call_lanes[kLanes] = {};
  const KernelArgs args{sketch.seed_,
                        MakeBinMap(sketch.dim()),
                        sketch.partial_bins_.data(),
                        sketch.partial_squares_,
                        sketch.square_lanes_,
                        call_lanes};
  const size_t size = type == ScalarType::kFloat32 ? 4 : 2;
  const auto* bytes = static_cast<const unsigned char*>(data);
  const uint64_t segment_length = sketch.segment_length_;
  // One piece per segment: the open segment is closed before another one is added to, and when a
  // piece reaches its end.
  while (n > 0) {
    const uint64_t segment = offset / segment_length;
    const uint64_t room = (segment + 1) * segment_length - offset;
    const size_t len = room < n ? static_cast<size_t>(room) : n;
    if (sketch.open_segment_ != segment) {
      sketch.CloseSegment();
      sketch.open_segment_ = segment;
    }
    switch (type) {
      case ScalarType::kFloat32:
        AddTyped<ScalarType::kFloat32>(isa, bytes, len, offset, args);
        break;
      case ScalarType::kBFloat16:
        AddTyped<ScalarType::kBFloat16>(isa, bytes, len, offset, args);
        break;
      case ScalarType::kFloat16:
        AddTyped<ScalarType::kFloat16>(isa, bytes, len, offset, args);
        break;
      default:
        assert(false && "unknown ScalarType");
        return;
    }
    if (len == room) sketch.CloseSegment();
    bytes += len * size;
    offset += len;
    n -= len;
  }
  // The run of the last coordinate added stays open (its partials are +0 if it was completed).
  sketch.open_run_ = (offset - 1) / kRun;
  if (squares != nullptr) *squares += internal::FoldPartialSums(call_lanes);
}

}  // namespace sketch_internal

uint64_t SketchSegment(uint32_t dim) {
  uint64_t length = uint64_t{1} << 16;
  while (length < uint64_t{kSketchBlock} * dim) length <<= 1;
  return length;
}

CountSketch::CountSketch(uint32_t dim, uint64_t seed)
    : seed_(seed),
      segment_length_(SketchSegment(std::clamp<uint32_t>(dim, 1, kMaxSketchDim))),
      bins_(std::clamp<uint32_t>(dim, 1, kMaxSketchDim), 0.0),
      partial_bins_(bins_.size() + kSketchBlock - 1, 0.0f) {
  assert(dim >= 1 && dim <= kMaxSketchDim);
}

void CountSketch::Reset() {
  std::fill(bins_.begin(), bins_.end(), 0.0);
  std::fill(partial_bins_.begin(), partial_bins_.end(), 0.0f);
  open_segment_ = kNone;
  std::fill(std::begin(partial_squares_), std::end(partial_squares_), 0.0f);
  open_run_ = kNone;
  std::fill(std::begin(square_lanes_), std::end(square_lanes_), 0.0);
  sum_squares_ = 0.0;
}

void CountSketch::CloseSegment() const {
  if (open_segment_ == kNone) return;
  // Partial p into bin p mod dim, in ascending p (sketch.h "Rounding"): the dim partials of the
  // bins themselves, then the 31 of the windows that wrapped.
  const size_t dim = bins_.size();
  for (size_t p = 0; p < partial_bins_.size(); ++p) {
    bins_[p < dim ? p : p % dim] += static_cast<double>(partial_bins_[p]);
    partial_bins_[p] = 0.0f;
  }
  open_segment_ = kNone;
}

void CountSketch::CloseRun() const { CloseRunLanes(partial_squares_, square_lanes_); }

void CountSketch::Close() const {
  CloseSegment();
  CloseRun();
  sum_squares_ = internal::FoldPartialSums(square_lanes_);
}

void CountSketch::Add(const void* data, ScalarType type, size_t n, uint64_t offset,
                      double* squares) {
  sketch_internal::AddWithIsa(*this, sketch_internal::BestKernelIsa(), data, type, n, offset,
                              squares);
}

void CountSketch::MergeFrom(const CountSketch& other) {
  assert(other.bins_.size() == bins_.size() && other.seed_ == seed_);
  Close();
  other.Close();
  const size_t n = std::min(bins_.size(), other.bins_.size());
  for (size_t i = 0; i < n; ++i) bins_[i] += other.bins_[i];
  for (int l = 0; l < kSumSquaresLanes; ++l) square_lanes_[l] += other.square_lanes_[l];
  sum_squares_ = internal::FoldPartialSums(square_lanes_);
}

void CountSketch::CopyTo(absl::Span<float> out) const {
  assert(out.size() == bins_.size());
  Close();
  const size_t n = std::min(out.size(), bins_.size());
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(bins_[i]);
}

std::vector<float> CountSketch::ToFloats() const {
  std::vector<float> out(bins_.size());
  CopyTo(absl::MakeSpan(out));
  return out;
}

double SketchDot(absl::Span<const float> a, absl::Span<const float> b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  double dot = 0.0;
  for (size_t i = 0; i < a.size(); ++i) dot += static_cast<double>(a[i]) * b[i];
  return dot;
}

double SketchCosine(absl::Span<const float> a, absl::Span<const float> b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::quiet_NaN();
  double dot = 0.0, aa = 0.0, bb = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = b[i];
    dot += x * y;
    aa += x * x;
    bb += y * y;
  }
  // A non-finite coordinate makes its squared norm inf or NaN (finite floats cannot overflow it).
  if (!std::isfinite(aa) || !std::isfinite(bb)) return std::numeric_limits<double>::quiet_NaN();
  if (aa == 0.0 || bb == 0.0) return 0.0;
  return std::clamp(dot / (std::sqrt(aa) * std::sqrt(bb)), -1.0, 1.0);
}

}  // namespace rankscope
