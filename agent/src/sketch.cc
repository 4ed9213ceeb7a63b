// Count sketch kernel (see sketch.h for the hash and the contracts).
//
// Add runs in three phases: a scalar head up to the next coordinate index that is a multiple of
// 8, a vector body over whole pipeline steps of 16 coordinates, and a scalar tail. The body is a
// software pipeline (RunPipeline): a vector pass hashes the indices of a step (SplitMix64 on 8
// lanes of 64 bits), widens the values to double, applies the signs and accumulates the squares
// into a small ring buffer, while a scalar pass adds the signed values of the step hashed two
// steps earlier into their bins, in index order. All paths (scalar, AVX2, AVX-512) compute the
// same integer hash, the same exact widening and the same additions in the same order, so their
// results are bit-identical:
//   - bins: every bin receives its values in ascending index order;
//   - squares: coordinate i goes to partial sum i % 8 (x * x is exact in double for any float,
//     so fused and unfused multiply-adds agree), and Add folds the 8 partial sums in a fixed
//     order.
// Where the time goes (AVX-512, docs/PERFORMANCE.md "## Sketch kernel"): in 512-bit mode only
// ports 0 and 5 execute vector and floating-point uops, and per 8 coordinates they must run the
// mix (two 3-uop vpmullq, three shifts, three xors), the widening, the signs, the bins and the 8
// scalar additions of the scatter: about 28 uops, 14 cycles at best.
#include "rankscope/sketch.h"

#include <algorithm>
#include <cassert>
#include <cmath>
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
#define RANKSCOPE_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define RANKSCOPE_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,f16c")))
#endif

namespace rankscope {
namespace {

using sketch_internal::KernelIsa;

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;

// Coordinates per group (one vector of 8 doubles) and partial sums of squares.
constexpr size_t kGroup = 8;

template <ScalarType kType>
constexpr size_t kElementSize = kType == ScalarType::kFloat32 ? 4 : 2;

// How a mix becomes a bin: (mix >> 32) % dim, by a mask when dim is a power of two.
struct BinMap {
  uint32_t dim;
  uint32_t mask;   // dim - 1; used when dim is a power of two
  double inv_dim;  // 1.0 / dim, for the vector remainder (exact after a correction step)
};

inline uint32_t BinOf(uint64_t mix, const BinMap& map, bool pow2) {
  const uint32_t high = static_cast<uint32_t>(mix >> 32);
  return pow2 ? (high & map.mask) : high % map.dim;
}

// What one Add call writes to.
struct KernelArgs {
  uint64_t seed;
  BinMap map;
  double* bins;
  double* lanes;  // kGroup partial sums of squares
};

// The conversions of sketch.h, inlinable here.
inline float WidenBFloat16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float WidenFloat16(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    // Infinity, or a NaN made quiet (bit 22) with its payload kept.
    u = sign | 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x00400000u : 0u);
  } else if (exponent != 0) {
    u = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  } else {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    std::memcpy(&u, &magnitude, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
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
    return kType == ScalarType::kBFloat16 ? WidenBFloat16(h) : WidenFloat16(h);
  }
}

// SplitMix64 (sketch.h); inlined here, where the exported SketchMix may not be.
inline uint64_t Mix64(uint64_t index, uint64_t seed) {
  uint64_t z = seed + (index + 1) * kGolden;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  return z ^ (z >> 31);
}

// v with its sign flipped iff the lowest bit of mix is set (branch-free, exactly -v then).
inline double ApplySign(double v, uint64_t mix) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits ^= mix << 63;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Adds coordinates [first, first + n) one at a time: the reference for the vector paths.
template <ScalarType kType, bool kPow2>
void AddScalar(const unsigned char* data, size_t n, uint64_t first, const KernelArgs& a) {
  double lanes[kGroup];  // a local copy: cannot alias the bins
  std::copy(a.lanes, a.lanes + kGroup, lanes);
  for (size_t j = 0; j < n; ++j) {
    const uint64_t index = first + j;
    const double v = LoadScalar<kType>(data + j * kElementSize<kType>);
    lanes[index % kGroup] += v * v;
    const uint64_t mix = Mix64(index, a.seed);
    a.bins[BinOf(mix, a.map, kPow2)] += ApplySign(v, mix);
  }
  std::copy(lanes, lanes + kGroup, a.lanes);
}

// The vector body: `steps` pipeline steps of kStepCoords coordinates, starting at coordinate
// `first`, a multiple of kGroup.
using BodyFn = void (*)(const unsigned char* data, size_t steps, uint64_t first,
                        const KernelArgs& a);

// Groups and coordinates per pipeline step.
constexpr int kStepGroups = 2;
constexpr size_t kStepCoords = kStepGroups * kGroup;
// The vector bodies run a software pipeline: step s is hashed into ring slot s % kRingSlots while
// the slot hashed kLag steps earlier is scattered, so the vector hashing and the scalar
// scatter overlap, and no scatter load waits on a vector store that has only just been issued.
constexpr size_t kRingSlots = 4;
constexpr size_t kLag = 2;

// bins[bin[j]] += val[j] for the kStepCoords coordinates of one step, in order of j.
inline void ScatterStep(const uint32_t* bin, const double* val, double* bins) {
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 16
#endif
  for (size_t j = 0; j < kStepCoords; ++j) bins[bin[j]] += val[j];
}

// Runs `steps` steps of `hasher`, which writes the bins and signed values of its next step into
// the arrays it is given. Inlined into each instruction set's body, where Hasher::Step inlines.
template <class Hasher>
__attribute__((always_inline)) inline void RunPipeline(Hasher& hasher, size_t steps, double* bins) {
  alignas(64) uint32_t bin[kRingSlots * kStepCoords];
  alignas(64) double val[kRingSlots * kStepCoords];
  auto slot = [](size_t step) { return (step % kRingSlots) * kStepCoords; };
  size_t s = 0;
  for (; s < std::min(steps, kLag); ++s) hasher.Step(bin + slot(s), val + slot(s));
  for (; s < steps; ++s) {
    hasher.Step(bin + slot(s), val + slot(s));
    ScatterStep(bin + slot(s - kLag), val + slot(s - kLag), bins);
  }
  for (size_t t = std::max(steps, kLag) - kLag; t < steps; ++t) {
    ScatterStep(bin + slot(t), val + slot(t), bins);
  }
}

template <ScalarType kType, bool kPow2>
void BodyScalar(const unsigned char* data, size_t steps, uint64_t first, const KernelArgs& a) {
  AddScalar<kType, kPow2>(data, steps * kStepCoords, first, a);
}

#ifdef RANKSCOPE_SKETCH_X86

constexpr double kTwo52 = 4503599627370496.0;

// Software prefetch kPrefetchBytes ahead of the step being hashed: the kernel consumes its input
// too slowly, with too few loads in flight, for the hardware prefetchers alone to hide DRAM
// latency. A prefetch never faults, so running past the end of the input is harmless.
constexpr uintptr_t kPrefetchBytes = 4096;
template <size_t kBytes>
inline void Prefetch(const unsigned char* p) {
  for (size_t line = 0; line < kBytes; line += 64) {
    _mm_prefetch(
        reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes + line),
        _MM_HINT_T0);
  }
}

// ---- AVX2: a group is two vectors of 4 lanes; 64-bit products from three 32x32 products.

RANKSCOPE_TARGET_AVX2 inline __m256i MulLo64Avx2(__m256i a, __m256i c_lo, __m256i c_hi) {
  const __m256i lo = _mm256_mul_epu32(a, c_lo);
  const __m256i cross =
      _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), c_lo), _mm256_mul_epu32(a, c_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

template <ScalarType kType>
RANKSCOPE_TARGET_AVX2 inline __m256d Load4Avx2(const unsigned char* p) {
  __m128 f;
  if constexpr (kType == ScalarType::kFloat32) {
    f = _mm_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    if constexpr (kType == ScalarType::kBFloat16) {
      f = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    } else {
      f = _mm_cvtph_ps(h);
    }
  }
  return _mm256_cvtps_pd(f);
}

// Bins of the 4 mixes in `mix` as 4 uint32.
template <bool kPow2>
RANKSCOPE_TARGET_AVX2 inline __m128i BinsAvx2(__m256i mix, const BinMap& map) {
  if constexpr (kPow2) {
    const __m256i high =
        _mm256_permutevar8x32_epi32(mix, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
    return _mm_and_si128(_mm256_castsi256_si128(high), _mm_set1_epi32(static_cast<int>(map.mask)));
  } else {
    // n = mix >> 32 as a double (exact: 2^52 + n - 2^52). q = n * inv_dim rounded to the nearest
    // integer (by adding 2^52) is floor(n / dim) or one more, as the rounding error of n * inv_dim
    // is below 2^32 * 2^-52 <= 1 / dim; so r = n - q * dim lies in (-dim, dim), and adding dim
    // when it is negative makes it the exact remainder. All values are integers below 2^53.
    const __m256d two52 = _mm256_set1_pd(kTwo52);
    const __m256d n = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(
                                        _mm256_srli_epi64(mix, 32), _mm256_castpd_si256(two52))),
                                    two52);
    const __m256d d = _mm256_set1_pd(map.dim);
    const __m256d q =
        _mm256_sub_pd(_mm256_add_pd(_mm256_mul_pd(n, _mm256_set1_pd(map.inv_dim)), two52), two52);
    __m256d r = _mm256_sub_pd(n, _mm256_mul_pd(q, d));
    r = _mm256_add_pd(r, _mm256_and_pd(_mm256_cmp_pd(r, _mm256_setzero_pd(), _CMP_LT_OQ), d));
    return _mm256_cvttpd_epi32(r);
  }
}

template <ScalarType kType, bool kPow2>
class HasherAvx2 {
 public:
  RANKSCOPE_TARGET_AVX2 HasherAvx2(const unsigned char* data, uint64_t first, const KernelArgs& a)
      : data_(data), map_(a.map) {
    // Vector v of a step holds coordinates first + 4v .. first + 4v + 3.
    const uint64_t z0 = a.seed + (first + 1) * kGolden;
    for (int v = 0; v < 2 * kStepGroups; ++v) {
      const uint64_t base = z0 + 4 * v * kGolden;
      z_[v] = _mm256_setr_epi64x(static_cast<int64_t>(base), static_cast<int64_t>(base + kGolden),
                                 static_cast<int64_t>(base + 2 * kGolden),
                                 static_cast<int64_t>(base + 3 * kGolden));
    }
    acc_[0] = _mm256_loadu_pd(a.lanes);
    acc_[1] = _mm256_loadu_pd(a.lanes + 4);
  }

  RANKSCOPE_TARGET_AVX2 void Finish(double* lanes) const {
    _mm256_storeu_pd(lanes, acc_[0]);
    _mm256_storeu_pd(lanes + 4, acc_[1]);
  }

  RANKSCOPE_TARGET_AVX2 void Step(uint32_t* bin, double* val) {
    constexpr size_t kSize = kElementSize<kType>;
    const __m256i step = _mm256_set1_epi64x(static_cast<int64_t>(kStepCoords * kGolden));
    Prefetch<kStepCoords * kSize>(data_);
    for (int v = 0; v < 2 * kStepGroups; ++v) {
      const __m256i mix = Mix(z_[v]);
      z_[v] = _mm256_add_epi64(z_[v], step);
      const __m256d x = Load4Avx2<kType>(data_ + 4 * v * kSize);
      acc_[v % 2] = _mm256_add_pd(acc_[v % 2], _mm256_mul_pd(x, x));
      _mm256_store_pd(val + 4 * v,
                      _mm256_xor_pd(x, _mm256_castsi256_pd(_mm256_slli_epi64(mix, 63))));
      _mm_store_si128(reinterpret_cast<__m128i*>(bin + 4 * v), BinsAvx2<kPow2>(mix, map_));
    }
    data_ += kStepCoords * kSize;
  }

 private:
  RANKSCOPE_TARGET_AVX2 static __m256i Mix(__m256i z) {
    const __m256i m1_lo = _mm256_set1_epi64x(static_cast<int64_t>(kMix1 & 0xffffffffu));
    const __m256i m1_hi = _mm256_set1_epi64x(static_cast<int64_t>(kMix1 >> 32));
    const __m256i m2_lo = _mm256_set1_epi64x(static_cast<int64_t>(kMix2 & 0xffffffffu));
    const __m256i m2_hi = _mm256_set1_epi64x(static_cast<int64_t>(kMix2 >> 32));
    z = MulLo64Avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), m1_lo, m1_hi);
    z = MulLo64Avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), m2_lo, m2_hi);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
  }

  const unsigned char* data_;
  BinMap map_;
  __m256i z_[2 * kStepGroups];
  __m256d acc_[2];  // partial sums of squares of lanes 0-3 and 4-7
};

template <ScalarType kType, bool kPow2>
RANKSCOPE_TARGET_AVX2 void BodyAvx2(const unsigned char* data, size_t steps, uint64_t first,
                                    const KernelArgs& a) {
  HasherAvx2<kType, kPow2> hasher(data, first, a);
  RunPipeline(hasher, steps, a.bins);
  hasher.Finish(a.lanes);
}

// ---- AVX-512: a group is one vector of 8 lanes.

template <ScalarType kType>
RANKSCOPE_TARGET_AVX512 inline __m512d Load8Avx512(const unsigned char* p) {
  __m256 f;
  if constexpr (kType == ScalarType::kFloat32) {
    f = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kType == ScalarType::kBFloat16) {
      f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      f = _mm256_cvtph_ps(h);
    }
  }
  return _mm512_cvtps_pd(f);
}

// Bins of the 8 mixes in `mix` as 8 uint32.
template <bool kPow2>
RANKSCOPE_TARGET_AVX512 inline __m256i BinsAvx512(__m512i mix, const BinMap& map) {
  // The high 32 bits of each lane, gathered into the low 256 bits.
  const __m256i high = _mm512_castsi512_si256(_mm512_permutexvar_epi32(
      _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15), mix));
  if constexpr (kPow2) {
    return _mm256_and_si256(high, _mm256_set1_epi32(static_cast<int>(map.mask)));
  } else {
    // As in BinsAvx2 (the fused multiply-add rounds n * inv_dim + 2^52 once, to an integer).
    const __m512d two52 = _mm512_set1_pd(kTwo52);
    const __m512d n = _mm512_cvtepu32_pd(high);
    const __m512d d = _mm512_set1_pd(map.dim);
    const __m512d q = _mm512_sub_pd(_mm512_fmadd_pd(n, _mm512_set1_pd(map.inv_dim), two52), two52);
    __m512d r = _mm512_fnmadd_pd(q, d, n);
    r = _mm512_mask_add_pd(r, _mm512_cmp_pd_mask(r, _mm512_setzero_pd(), _CMP_LT_OQ), r, d);
    return _mm512_cvttpd_epi32(r);
  }
}

template <ScalarType kType, bool kPow2>
class HasherAvx512 {
 public:
  RANKSCOPE_TARGET_AVX512 HasherAvx512(const unsigned char* data, uint64_t first,
                                       const KernelArgs& a)
      : data_(data), map_(a.map) {
    // Vector v of a step holds coordinates first + 8v .. first + 8v + 7.
    const uint64_t z0 = a.seed + (first + 1) * kGolden;
    for (int v = 0; v < kStepGroups; ++v) {
      const uint64_t base = z0 + 8 * v * kGolden;
      z_[v] = _mm512_add_epi64(
          _mm512_set1_epi64(static_cast<int64_t>(base)),
          _mm512_setr_epi64(0, static_cast<int64_t>(kGolden), static_cast<int64_t>(2 * kGolden),
                            static_cast<int64_t>(3 * kGolden), static_cast<int64_t>(4 * kGolden),
                            static_cast<int64_t>(5 * kGolden), static_cast<int64_t>(6 * kGolden),
                            static_cast<int64_t>(7 * kGolden)));
    }
    acc_ = _mm512_loadu_pd(a.lanes);
  }

  RANKSCOPE_TARGET_AVX512 void Finish(double* lanes) const { _mm512_storeu_pd(lanes, acc_); }

  RANKSCOPE_TARGET_AVX512 void Step(uint32_t* bin, double* val) {
    constexpr size_t kSize = kElementSize<kType>;
    const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(kStepCoords * kGolden));
    const __m512i one = _mm512_set1_epi64(1);
    const __m512i sign_bit = _mm512_set1_epi64(std::numeric_limits<int64_t>::min());
    Prefetch<kStepCoords * kSize>(data_);
    for (int v = 0; v < kStepGroups; ++v) {
      const __m512i mix = Mix(z_[v]);
      z_[v] = _mm512_add_epi64(z_[v], step);
      const __m512d x = Load8Avx512<kType>(data_ + 8 * v * kSize);
      acc_ = _mm512_fmadd_pd(x, x, acc_);  // x * x is exact, so this equals acc + x * x
      const __m512i xi = _mm512_castpd_si512(x);
      _mm512_store_si512(val + 8 * v,
                         _mm512_mask_xor_epi64(xi, _mm512_test_epi64_mask(mix, one), xi, sign_bit));
      _mm256_store_si256(reinterpret_cast<__m256i*>(bin + 8 * v), BinsAvx512<kPow2>(mix, map_));
    }
    data_ += kStepCoords * kSize;
  }

 private:
  RANKSCOPE_TARGET_AVX512 static __m512i Mix(__m512i z) {
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
    z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(kMix1)));
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
    z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(kMix2)));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  }

  const unsigned char* data_;
  BinMap map_;
  __m512i z_[kStepGroups];
  __m512d acc_;  // partial sums of squares, lane l for coordinates l mod 8
};

template <ScalarType kType, bool kPow2>
RANKSCOPE_TARGET_AVX512 void BodyAvx512(const unsigned char* data, size_t steps, uint64_t first,
                                        const KernelArgs& a) {
  HasherAvx512<kType, kPow2> hasher(data, first, a);
  RunPipeline(hasher, steps, a.bins);
  hasher.Finish(a.lanes);
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

// Head (scalar, up to a multiple of kGroup), body (vector), tail (scalar).
template <ScalarType kType, bool kPow2>
void AddRange(KernelIsa isa, const unsigned char* data, size_t n, uint64_t first,
              const KernelArgs& a) {
  constexpr size_t kSize = kElementSize<kType>;
  const size_t head = std::min<size_t>(n, (kGroup - first % kGroup) % kGroup);
  AddScalar<kType, kPow2>(data, head, first, a);
  data += head * kSize;
  first += head;
  n -= head;
  const size_t steps = n / kStepCoords;
  if (steps > 0) SelectBody<kType, kPow2>(isa)(data, steps, first, a);
  const size_t done = steps * kStepCoords;
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

KernelIsa DetectBestIsa() {
#ifdef RANKSCOPE_SKETCH_X86
  __builtin_cpu_init();
  if (!CpuHasF16c() || !__builtin_cpu_supports("avx2")) return KernelIsa::kScalar;
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
  const uint64_t mix = Mix64(index, seed);
  return SketchSlot{static_cast<uint32_t>((mix >> 32) % dim), (mix & 1) ? -1.0f : 1.0f};
}

float BFloat16ToFloat(uint16_t bits) { return WidenBFloat16(bits); }

float Float16ToFloat(uint16_t bits) { return WidenFloat16(bits); }

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
  static_assert(CountSketch::kSumSquaresLanes == kGroup, "one partial sum per vector lane");
  if (n == 0) return;
  assert(data != nullptr);
  assert(KernelIsaSupported(isa));
  if (!KernelIsaSupported(isa)) isa = KernelIsa::kScalar;
  const uint32_t dim = sketch.dim();
  const KernelArgs args{sketch.seed_, BinMap{dim, dim - 1, 1.0 / dim}, sketch.bins_.data(),
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
  const double* l = sketch.sum_squares_lanes_;
  sketch.sum_squares_ = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
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
