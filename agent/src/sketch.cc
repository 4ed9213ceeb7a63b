// Count sketch kernel (see sketch.h for the hash and the contracts).
//
// The hash is per block of kBlock = 16 consecutive coordinates: one SplitMix64 mix gives the
// block a base bin and 16 sign bits, and the block's coordinates go to the window of 16
// consecutive bins base, base + 1, ... (mod dim). So the kernel hashes once per 16 coordinates,
// and a block whose window does not wrap (base <= dim - 16, all but 15 bases in dim) is one
// contiguous vector update: load 16 values, flip their signs under the 16-bit mask, widen to
// double, add into the window.
//
// Add runs in three phases: a scalar head up to the next block boundary, a vector body over whole
// blocks, and a scalar tail. All paths (scalar, AVX2, AVX-512) compute the same integer hash, the
// same exact widening and the same additions in the same order, so their results are
// bit-identical:
//   - bins: a block's 16 coordinates go to 16 distinct bins when dim >= 16, so each bin receives
//     at most one value per block, and blocks are added in ascending order: every bin receives
//     its values in ascending index order. (For dim < 16 only the scalar code runs.) A window
//     that wraps (15 bases in dim) is two masked vector updates, at the end of the bins and at
//     their start, so the bins stay a plain array of dim doubles (no overflow bins to fold when
//     the sketch is read), and bins() is the sketch by its definition, bit for bit.
//   - squares: coordinate i goes to partial sum i % 8 (a block is two groups of 8, added in
//     order; the square of a float is exact in double, so fused and unfused multiply-adds agree,
//     and the signed value has the same square), and Add folds the 8 partial sums in a fixed
//     order.
// Where the time goes: docs/PERFORMANCE.md "## Sketch kernel".
#include "rankscope/sketch.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RANKSCOPE_SKETCH_X86 1
#include <cpuid.h>
// GCC 12's AVX-512 intrinsics trip -Wmaybe-uninitialized on their own _mm512_undefined_*()
// (GCC bug 105593, fixed in GCC 13); the warning is located in the header, so silence it there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#define RANKSCOPE_TARGET_AVX2 __attribute__((target("avx2,f16c,bmi2")))
#define RANKSCOPE_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,f16c,bmi2")))
#endif

namespace rankscope {
namespace {

using sketch_internal::KernelIsa;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

// Coordinates per hash block (sketch.h), and partial sums of squares (one vector of 8 doubles).
constexpr uint64_t kBlock = 16;
constexpr size_t kLanes = 8;

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

// What one Add call writes to.
struct KernelArgs {
  uint64_t seed;
  BinMap map;
  double* bins;
  double* lanes;  // kLanes partial sums of squares
};

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
inline double ApplySign(double v, uint64_t bits) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  u ^= bits << 63;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// Adds coordinates [first, first + n) one at a time, block by block: the reference for the
// vector paths, and the only path for dim < 16.
template <ScalarType kType, bool kPow2>
void AddScalar(const unsigned char* data, size_t n, uint64_t first, const KernelArgs& a) {
  double lanes[kLanes];  // a local copy: cannot alias the bins
  std::copy(a.lanes, a.lanes + kLanes, lanes);
  const uint32_t dim = a.map.dim;
  size_t j = 0;
  while (j < n) {
    const uint64_t index = first + j;
    const uint64_t mix = Mix64(index / kBlock, a.seed);
    const uint32_t base = BaseOf<kPow2>(mix, a.map);
    const uint32_t first_offset = static_cast<uint32_t>(index % kBlock);
    const size_t count = std::min<size_t>(n - j, kBlock - first_offset);
    for (uint32_t o = first_offset; o < first_offset + count; ++o, ++j) {
      const double v = ApplySign(LoadScalar<kType>(data + j * kElementSize<kType>), mix >> o);
      lanes[(first + j) % kLanes] += v * v;
      uint32_t bin = base + o;  // < dim + 16
      if (bin >= dim) bin = dim >= kBlock ? bin - dim : bin % dim;
      a.bins[bin] += v;
    }
  }
  std::copy(lanes, lanes + kLanes, a.lanes);
}

// The vector body: `blocks` whole blocks of kBlock coordinates, the first one starting at
// coordinate `first` (a multiple of kBlock). Requires dim >= kBlock.
using BodyFn = void (*)(const unsigned char* data, size_t blocks, uint64_t first,
                        const KernelArgs& a);

template <ScalarType kType, bool kPow2>
void BodyScalar(const unsigned char* data, size_t blocks, uint64_t first, const KernelArgs& a) {
  AddScalar<kType, kPow2>(data, blocks * kBlock, first, a);
}

#ifdef RANKSCOPE_SKETCH_X86

// Software prefetch kPrefetchBytes ahead of the block being added: without it the kernel keeps
// too few misses in flight and reads DRAM at about half the speed (the hardware prefetchers alone
// do not keep up). Measured on the bench machine (docs/PERFORMANCE.md), 2 to 16 KiB ahead: into
// L2 (prefetcht1) is best for float32, into L1 (prefetcht0) a few percent better for the 16-bit
// types, which consume their input at half the byte rate. A prefetch never faults, so running
// past the end of the input is harmless. Written as inline assembly because GCC 12 silently
// deleted _mm_prefetch here (it treats the builtin as free of side effects once it sits in a
// small inline function).
constexpr uintptr_t kPrefetchBytes = 8192;
template <ScalarType kType>
__attribute__((always_inline)) inline void PrefetchAhead(const unsigned char* p) {
  const char* ahead = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  if constexpr (kType == ScalarType::kFloat32) {
    asm volatile("prefetcht1 %0" : : "m"(*ahead));
  } else {
    asm volatile("prefetcht0 %0" : : "m"(*ahead));
  }
}

// Runs body(data, mix) for `blocks` consecutive blocks starting at block number first / kBlock,
// prefetching ahead of each. `body` adds one block and is inlined.
template <ScalarType kType, class Body>
__attribute__((always_inline)) inline void ForEachBlock(const unsigned char* data, size_t blocks,
                                                        uint64_t first, uint64_t seed,
                                                        Body&& body) {
  constexpr size_t kBytes = kBlock * kElementSize<kType>;  // 64 or 32
  uint64_t z = seed + (first / kBlock + 1) * kGolden;
  for (const unsigned char* const end = data + blocks * kBytes; data != end; data += kBytes) {
    PrefetchAhead<kType>(data);
    body(data, Finalize64(z));
    z += kGolden;
  }
}

// ---- AVX2: a block is two vectors of 8 floats, widened to four vectors of 4 doubles.

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

template <ScalarType kType, bool kPow2>
RANKSCOPE_TARGET_AVX2 void BodyAvx2(const unsigned char* data, size_t blocks, uint64_t first,
                                    const KernelArgs& a) {
  constexpr size_t kSize = kElementSize<kType>;
  const BinMap map = a.map;
  const uint32_t last_unwrapped = map.dim - kBlock;
  double* const bins = a.bins;
  // Shifts that move bit o of the mix to the float sign bit of lane o (o = 0-7, then 8-15).
  const __m256i shift_lo = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
  const __m256i shift_hi = _mm256_setr_epi32(23, 22, 21, 20, 19, 18, 17, 16);
  const __m256i sign_bit = _mm256_set1_epi32(std::numeric_limits<int32_t>::min());
  __m256d acc0 = _mm256_loadu_pd(a.lanes);  // partial sums of squares of lanes 0-3
  __m256d acc1 = _mm256_loadu_pd(a.lanes + 4);
  auto add_block = [&](const unsigned char* p, uint64_t mix) RANKSCOPE_TARGET_AVX2 {
    const __m256i m = _mm256_set1_epi32(static_cast<int32_t>(mix));
    const __m256 lo = _mm256_xor_ps(
        Load8Avx2<kType>(p),
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_sllv_epi32(m, shift_lo), sign_bit)));
    const __m256 hi = _mm256_xor_ps(
        Load8Avx2<kType>(p + 8 * kSize),
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_sllv_epi32(m, shift_hi), sign_bit)));
    const __m256d v0 = _mm256_cvtps_pd(_mm256_castps256_ps128(lo));
    const __m256d v1 = _mm256_cvtps_pd(_mm256_extractf128_ps(lo, 1));
    const __m256d v2 = _mm256_cvtps_pd(_mm256_castps256_ps128(hi));
    const __m256d v3 = _mm256_cvtps_pd(_mm256_extractf128_ps(hi, 1));
    // x * x is exact in double, so acc + x * x rounds once, as the scalar path does.
    acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(v0, v0));
    acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(v1, v1));
    acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(v2, v2));
    acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(v3, v3));
    const uint32_t base = BaseOf<kPow2>(mix, map);
    double* w = bins + base;
    if (__builtin_expect(base > last_unwrapped, 0)) {
      // The window wraps: offsets o < r = dim - base go to bins base + o, the others to bins
      // o - r (as in the AVX-512 body); masked lanes are neither read nor written.
      const auto r = static_cast<int64_t>(map.dim - base);  // 1..15
      double* const v = reinterpret_cast<double*>(reinterpret_cast<uintptr_t>(bins) -
                                                  static_cast<uintptr_t>(r) * sizeof(double));
      const __m256i rr = _mm256_set1_epi64x(r);
      const __m256d values[4] = {v0, v1, v2, v3};
      for (int q = 0; q < 4; ++q) {
        const __m256i head =
            _mm256_cmpgt_epi64(rr, _mm256_setr_epi64x(4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3));
        const __m256i tail = _mm256_xor_si256(head, _mm256_set1_epi64x(-1));
        _mm256_maskstore_pd(w + 4 * q, head,
                            _mm256_add_pd(_mm256_maskload_pd(w + 4 * q, head), values[q]));
        _mm256_maskstore_pd(v + 4 * q, tail,
                            _mm256_add_pd(_mm256_maskload_pd(v + 4 * q, tail), values[q]));
      }
      return;
    }
    _mm256_storeu_pd(w, _mm256_add_pd(_mm256_loadu_pd(w), v0));
    _mm256_storeu_pd(w + 4, _mm256_add_pd(_mm256_loadu_pd(w + 4), v1));
    _mm256_storeu_pd(w + 8, _mm256_add_pd(_mm256_loadu_pd(w + 8), v2));
    _mm256_storeu_pd(w + 12, _mm256_add_pd(_mm256_loadu_pd(w + 12), v3));
  };
  ForEachBlock<kType>(data, blocks, first, a.seed, add_block);
  _mm256_storeu_pd(a.lanes, acc0);
  _mm256_storeu_pd(a.lanes + 4, acc1);
}

// ---- AVX-512: a block is one vector of 16 floats, widened to two vectors of 8 doubles.

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

template <ScalarType kType, bool kPow2>
RANKSCOPE_TARGET_AVX512 void BodyAvx512(const unsigned char* data, size_t blocks, uint64_t first,
                                        const KernelArgs& a) {
  const BinMap map = a.map;
  const uint32_t last_unwrapped = map.dim - kBlock;
  double* const bins = a.bins;
  const __m512i sign_bit = _mm512_set1_epi32(std::numeric_limits<int32_t>::min());
  __m512d acc = _mm512_loadu_pd(a.lanes);  // lane l: coordinates l mod 8
  auto add_block = [&](const unsigned char* p, uint64_t mix) RANKSCOPE_TARGET_AVX512 {
    const __m512i x = _mm512_castps_si512(Load16Avx512<kType>(p));
    const __m512 f =
        _mm512_castsi512_ps(_mm512_mask_xor_epi32(x, static_cast<__mmask16>(mix), x, sign_bit));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
    // x * x is exact in double, so acc + x * x rounds once, as the scalar path does.
    acc = _mm512_add_pd(acc, _mm512_mul_pd(lo, lo));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(hi, hi));
    const uint32_t base = BaseOf<kPow2>(mix, map);
    double* w = bins + base;
    if (__builtin_expect(base > last_unwrapped, 0)) {
      // The window wraps: offsets o < r = dim - base go to bins base + o, the others to bins
      // o - r. Masked lanes are neither read nor written (nor fault), so each bin still gets
      // its one value of the block, as in the scalar path.
      const uint32_t r = map.dim - base;  // 1..15
      const auto head = static_cast<uint32_t>((1u << r) - 1);
      const auto head_lo = static_cast<__mmask8>(head), head_hi = static_cast<__mmask8>(head >> 8);
      // bins - r, by integer arithmetic: only its lanes o >= r are touched.
      double* const v =
          reinterpret_cast<double*>(reinterpret_cast<uintptr_t>(bins) - r * sizeof(double));
      _mm512_mask_storeu_pd(w, head_lo, _mm512_add_pd(_mm512_maskz_loadu_pd(head_lo, w), lo));
      _mm512_mask_storeu_pd(w + 8, head_hi,
                            _mm512_add_pd(_mm512_maskz_loadu_pd(head_hi, w + 8), hi));
      const auto tail_lo = static_cast<__mmask8>(~head_lo),
                 tail_hi = static_cast<__mmask8>(~head_hi);
      _mm512_mask_storeu_pd(v, tail_lo, _mm512_add_pd(_mm512_maskz_loadu_pd(tail_lo, v), lo));
      _mm512_mask_storeu_pd(v + 8, tail_hi,
                            _mm512_add_pd(_mm512_maskz_loadu_pd(tail_hi, v + 8), hi));
      return;
    }
    _mm512_storeu_pd(w, _mm512_add_pd(_mm512_loadu_pd(w), lo));
    _mm512_storeu_pd(w + 8, _mm512_add_pd(_mm512_loadu_pd(w + 8), hi));
  };
  ForEachBlock<kType>(data, blocks, first, a.seed, add_block);
  _mm512_storeu_pd(a.lanes, acc);
}

bool CpuHasF16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

#endif  // RANKSCOPE_SKETCH_X86

template <ScalarType kType, bool kPow2>
BodyFn SelectBody(KernelIsa isa) {
  switch (isa) {
#ifdef RANKSCOPE_SKETCH_X86
    case KernelIsa::kAvx512:
      return &BodyAvx512<kType, kPow2>;
    case KernelIsa::kAvx2:
      return &BodyAvx2<kType, kPow2>;
#endif
    default:
      return &BodyScalar<kType, kPow2>;
  }
}

// Head (scalar, up to a block boundary), body (vector, whole blocks), tail (scalar). A window
// of 16 bins needs dim >= 16: smaller sketches take the scalar path throughout.
template <ScalarType kType, bool kPow2>
void AddRange(KernelIsa isa, const unsigned char* data, size_t n, uint64_t first,
              const KernelArgs& a) {
  if (a.map.dim < kBlock) isa = KernelIsa::kScalar;
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

// The kLanes partial sums of squares folded in the fixed order of sketch.cc's contract.
double FoldLanes(const double* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

KernelIsa DetectBestIsa() {
#ifdef RANKSCOPE_SKETCH_X86
  __builtin_cpu_init();
  if (!CpuHasF16c() || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("bmi2")) {
    return KernelIsa::kScalar;
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
    return KernelIsa::kAvx512;
  }
  return KernelIsa::kAvx2;
#else
  return KernelIsa::kScalar;
#endif
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
                uint64_t offset) {
  static_assert(CountSketch::kSumSquaresLanes == kLanes, "one partial sum per vector lane");
  if (n == 0) return;
  assert(data != nullptr);
  assert(KernelIsaSupported(isa));
  if (!KernelIsaSupported(isa)) isa = KernelIsa::kScalar;
  const uint32_t dim = sketch.dim();
  const KernelArgs args{sketch.seed_, MakeBinMap(dim), sketch.bins_.data(),
                        sketch.sum_squares_lanes_};
  const auto* bytes = static_cast<const unsigned char*>(data);
  switch (type) {
    case ScalarType::kFloat32:
      AddTyped<ScalarType::kFloat32>(isa, bytes, n, offset, args);
      break;
    case ScalarType::kBFloat16:
      AddTyped<ScalarType::kBFloat16>(isa, bytes, n, offset, args);
      break;
    case ScalarType::kFloat16:
      AddTyped<ScalarType::kFloat16>(isa, bytes, n, offset, args);
      break;
    default:
      assert(false && "unknown ScalarType");
      return;
  }
  sketch.sum_squares_ = FoldLanes(sketch.sum_squares_lanes_);
}

}  // namespace sketch_internal

CountSketch::CountSketch(uint32_t dim, uint64_t seed)
    : seed_(seed), bins_(std::clamp<uint32_t>(dim, 1, kMaxSketchDim), 0.0) {
  assert(dim >= 1 && dim <= kMaxSketchDim);
}

void CountSketch::Reset() {
  std::fill(bins_.begin(), bins_.end(), 0.0);
  std::fill(std::begin(sum_squares_lanes_), std::end(sum_squares_lanes_), 0.0);
  sum_squares_ = 0.0;
}

void CountSketch::Add(const void* data, ScalarType type, size_t n, uint64_t offset) {
  sketch_internal::AddWithIsa(*this, sketch_internal::BestKernelIsa(), data, type, n, offset);
}

void CountSketch::MergeFrom(const CountSketch& other) {
  assert(other.bins_.size() == bins_.size() && other.seed_ == seed_);
  const size_t n = std::min(bins_.size(), other.bins_.size());
  for (size_t i = 0; i < n; ++i) bins_[i] += other.bins_[i];
  for (int l = 0; l < kSumSquaresLanes; ++l) sum_squares_lanes_[l] += other.sum_squares_lanes_[l];
  sum_squares_ = FoldLanes(sum_squares_lanes_);
}

void CountSketch::CopyTo(absl::Span<float> out) const {
  assert(out.size() == bins_.size());
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
