#include "collector/analysis/step_stats.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <vector>

#include "common/cpu_isa.h"
#include "common/sketch_encoding.h"

namespace rankscope::collector {
namespace {

using step_stats_internal::KernelIsa;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Moments {
  double mean = 0.0;
  double std = 0.0;
  double range = 0.0;
  // The exact mean minus `mean` (its rounding error) as the second pass estimates it; 0 when that
  // estimate is not finite. ZScore subtracts it from x - mean separately: when the values lie
  // within a few ulps of each other the exact mean is not representable, its rounding error is
  // as large as their spread, and (x - mean) / std alone exceeds Samuelson's bound sqrt(W - 1)
  // (z = 2 for two values one ulp apart; found by tests/fuzz/step_stats_fuzzer.cc).
  double mean_error = 0.0;
};

// Population mean, std and range of get(sample) over the samples, by the corrected two-pass
// algorithm (Chan, Golub & LeVeque 1983): the second pass subtracts the rounding error of the
// mean, so the variance does not lose digits when the values are large and close together.
template <typename Getter>
Moments Describe(absl::Span<const RankSample> samples, Getter get) {
  const size_t n = samples.size();
  if (n == 0) return {};
  double sum = 0.0;
  double lo = kInf;
  double hi = -kInf;
  bool has_nan = false;
  for (const RankSample& s : samples) {
    const double x = get(s);
    has_nan |= std::isnan(x);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    sum += x;
  }
  if (has_nan) return {kNaN, kNaN, kNaN};
  if (lo == hi && std::isfinite(lo)) return {lo, 0.0, 0.0};  // exact, no rounding noise

  const double mean = sum / static_cast<double>(n);
  double squares = 0.0;
  double residual = 0.0;
  for (const RankSample& s : samples) {
    const double d = get(s) - mean;
    squares += d * d;
    residual += d;
  }
  double variance =
      (squares - residual * residual / static_cast<double>(n)) / static_cast<double>(n);
  if (variance < 0.0) variance = 0.0;  // NaN stays NaN
  const double mean_error = std::isfinite(residual) ? residual / static_cast<double>(n) : 0.0;
  return {mean, std::sqrt(variance), hi - lo, mean_error};
}

double ZScore(double x, const Moments& m) {
  if (m.std == 0.0) return 0.0;
  return ((x - m.mean) - m.mean_error) / m.std;
}

double ClampCosine(double c) { return c < -1.0 ? -1.0 : (c > 1.0 ? 1.0 : c); }

// The two passes over the sketches (ComputeCosines) are the cost of a step: W k floats, 1 M at
// W = k = 1024. Their kernels keep kPartials partial sums per accumulated quantity (coordinate i
// of a sketch goes to partial sum i % kPartials, each summed in index order) and fold them in a
// fixed order. They are written once with GCC/Clang vector extensions over kLanes doubles per
// vector and instantiated per ISA at its native width: 8 lanes with AVX-512, 4 with AVX2, 2 with
// the x86-64 baseline (SSE2) and elsewhere; the best the CPU supports is chosen once. This file
// is built with -ffp-contract=off (collector/CMakeLists.txt), so every path performs the same
// roundings in the same order and the results are bit-identical on every CPU (fused
// multiply-adds would be ~20% faster with AVX-512). They differ from a sequential sum only in
// summation order. In the collector the passes wait mostly on memory: the sketches were just
// written by other cores. A variant that read each sketch from memory once (norms computed as
// reports arrive, then cache-sized blocks of coordinates) was no faster there and slower here.
constexpr size_t kPartials = 16;  // one cache line of floats per iteration

template <size_t kLanes>
struct Lanes {
  typedef double Doubles __attribute__((vector_size(kLanes * sizeof(double))));
  typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
  typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
  static constexpr size_t kVectors = kPartials / kLanes;
  static_assert(kPartials % kLanes == 0);
};

// The helpers below pass vectors by value, which GCC warns changes the ABI of functions compiled
// without the ISA; they are internal and always inlined, so no call ever uses that ABI.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#define RANKSCOPE_STATS_INLINE inline __attribute__((always_inline))

// Loads kLanes floats (any alignment) widened to double.
template <size_t kLanes>
RANKSCOPE_STATS_INLINE typename Lanes<kLanes>::Doubles LoadFloats(const float* p) {
  typename Lanes<kLanes>::Floats f;
  std::memcpy(&f, p, sizeof f);
  return __builtin_convertvector(f, typename Lanes<kLanes>::Doubles);
}
template <size_t kLanes>
RANKSCOPE_STATS_INLINE typename Lanes<kLanes>::Doubles LoadDoubles(const double* p) {
  typename Lanes<kLanes>::Doubles d;
  std::memcpy(&d, p, sizeof d);
  return d;
}
template <size_t kLanes>
RANKSCOPE_STATS_INLINE void StoreDoubles(double* p, typename Lanes<kLanes>::Doubles d) {
  std::memcpy(p, &d, sizeof d);
}
// The kPartials partial sums held in `acc`, folded in the fixed order, plus `tail`.
template <size_t kLanes>
RANKSCOPE_STATS_INLINE double Fold(const typename Lanes<kLanes>::Doubles* acc, double tail) {
  double p[kPartials];
  std::memcpy(p, acc, sizeof p);
  for (size_t c = 0; c < 8; ++c) p[c] += p[c + 8];
  return (((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))) + tail;
}

// The bins of one sketch, decoded kLanes at a time (Load) or one at a time (At), in its encoding
// (common/sketch_encoding.h). Every decoded value is exact in double (a float; a half or an int8
// times a float scale has at most 35 significant bits), so every ISA path reads the same doubles
// and the results stay bit-identical across instruction sets.
template <size_t kLanes>
struct Float32Bins {
  const float* p;
  RANKSCOPE_STATS_INLINE typename Lanes<kLanes>::Doubles Load(size_t at) const {
    return LoadFloats<kLanes>(p + at);
  }
  RANKSCOPE_STATS_INLINE double At(size_t i) const { return p[i]; }
};
template <size_t kLanes>
struct Float16Bins {
  const unsigned char* p;
  double scale;
  using Halves = typename Lanes<kLanes>::Halves;
  using Words = typename Lanes<kLanes>::Words;
  // FloatFromHalf (common/sketch_encoding.cc) on kLanes halves at once: the half's magnitude
  // bits moved into a float's, the exponent made all ones for Inf/NaN, then times 2^112 (exact).
  RANKSCOPE_STATS_INLINE typename Lanes<kLanes>::Doubles Load(size_t at) const {
    using Floats = typename Lanes<kLanes>::Floats;
    Halves h;
    std::memcpy(&h, p + at * sizeof(uint16_t), sizeof h);
    const Words w = __builtin_convertvector(h, Words);
    const Words magnitude = w & 0x7fffu;
    const Words special = (Words)((magnitude & 0x7c00u) == 0x7c00u) & 0x7f800000u;
    const Words bits = (magnitude << 13) | special;
    Floats f;
    std::memcpy(&f, &bits, sizeof f);
    f = f * 0x1p112f;
    Words out;
    std::memcpy(&out, &f, sizeof out);
    out |= (w & 0x8000u) << 16;
    std::memcpy(&f, &out, sizeof f);
    return __builtin_convertvector(f, typename Lanes<kLanes>::Doubles) * scale;
  }
  RANKSCOPE_STATS_INLINE double At(size_t i) const {
    uint16_t h;
    std::memcpy(&h, p + i * sizeof h, sizeof h);
    return static_cast<double>(FloatFromHalf(h)) * scale;
  }
};
template <size_t kLanes>
struct Int8Bins {
  const int8_t* p;
  double scale;
  using Ints = typename Lanes<kLanes>::Ints;
  RANKSCOPE_STATS_INLINE typename Lanes<kLanes>::Doubles Load(size_t at) const {
    Ints q;
    for (size_t j = 0; j < kLanes; ++j) q[j] = p[at + j];  // sign-extending loads
    return __builtin_convertvector(q, typename Lanes<kLanes>::Doubles) * scale;
  }
  RANKSCOPE_STATS_INLINE double At(size_t i) const { return static_cast<double>(p[i]) * scale; }
};

// Calls fn(bins) with the bins of `sketch` in its encoding.
template <size_t kLanes, typename Fn>
RANKSCOPE_STATS_INLINE void WithBins(const SketchView& sketch, Fn&& fn) {
  switch (sketch.encoding) {
    case SketchEncoding::kFloat16:
      return fn(Float16Bins<kLanes>{static_cast<const unsigned char*>(sketch.data),
                                    static_cast<double>(sketch.scale)});
    case SketchEncoding::kInt8:
      return fn(Int8Bins<kLanes>{static_cast<const int8_t*>(sketch.data),
                                 static_cast<double>(sketch.scale)});
    case SketchEncoding::kFloat32:
      break;
  }
  return fn(Float32Bins<kLanes>{static_cast<const float*>(sketch.data)});
}

// Each sketch is its own heap buffer and the hardware prefetchers stop at page boundaries, so
// while the kernels work on one rank's sketch they prefetch the next rank's into L1 and the one
// kPrefetchFar ranks ahead into L2.
constexpr ptrdiff_t kPrefetchFar = 4;
// Where the kernels prefetch: the bytes of a sketch and the bytes one bin takes.
struct PrefetchTarget {
  const char* bytes;
  size_t per_bin;
  RANKSCOPE_STATS_INLINE void Near(size_t bin) const { __builtin_prefetch(bytes + bin * per_bin); }
  RANKSCOPE_STATS_INLINE void Far(size_t bin) const {
    __builtin_prefetch(bytes + bin * per_bin, 0, 2);
  }
};
// The sketch of the rank at `index` clamped to [0, W).
RANKSCOPE_STATS_INLINE PrefetchTarget SketchNear(absl::Span<const RankSample> samples,
                                                 ptrdiff_t index) {
  const ptrdiff_t last = static_cast<ptrdiff_t>(samples.size()) - 1;
  const SketchView& s = samples[std::clamp<ptrdiff_t>(index, 0, last)].sketch;
  return {static_cast<const char*>(s.data), SketchBytesPerBin(s.encoding)};
}

// Pass 1 for one rank: returns |v|^2 and adds v to total + total_lo (see NormsAndTotal).
template <size_t kLanes, typename Bins>
RANKSCOPE_STATS_INLINE double NormAndAdd(const Bins& v, size_t k, PrefetchTarget next,
                                         PrefetchTarget far, double* total, double* total_lo) {
  using Doubles = typename Lanes<kLanes>::Doubles;
  constexpr size_t kVectors = Lanes<kLanes>::kVectors;
  const size_t body = k - k % kPartials;
  Doubles squares[kVectors] = {};
  size_t i = 0;
  for (; i < body; i += kPartials) {
    next.Near(i);
    far.Far(i);
    for (size_t j = 0; j < kVectors; ++j) {
      const size_t at = i + j * kLanes;
      const Doubles x = v.Load(at);
      squares[j] += x * x;
      const Doubles a = LoadDoubles<kLanes>(total + at);
      const Doubles sum = a + x;
      const Doubles b = sum - a;
      StoreDoubles<kLanes>(total + at, sum);
      StoreDoubles<kLanes>(total_lo + at,
                           LoadDoubles<kLanes>(total_lo + at) + ((a - (sum - b)) + (x - b)));
    }
  }
  double tail = 0.0;
  for (; i < k; ++i) {
    const double x = v.At(i);
    tail += x * x;
    const double a = total[i];
    const double sum = a + x;
    const double b = sum - a;
    total[i] = sum;
    total_lo[i] += (a - (sum - b)) + (x - b);
  }
  return Fold<kLanes>(squares, tail);
}

// Pass 1. For each rank: norm2[r] = |v_r|^2, and total + total_lo += v_r (in rank order), a
// double-double sum: each addition's rounding error (Knuth's TwoSum, exact in binary floating
// point without contraction) goes to total_lo, so total + total_lo holds sum_r v_r to about
// 2^-100 of its magnitude, and total - v_r + total_lo recovers a tiny rest exactly where v_r
// dominates (a rank of scale 1 beside one of scale 1e-38: in plain double total - v_r is 0 and
// the big rank's consensus cosine came out 0). Every sketch has length k; each is read in its
// own encoding.
template <size_t kLanes>
RANKSCOPE_STATS_INLINE void NormsAndTotal(absl::Span<const RankSample> samples, size_t k,
                                          double* norm2, double* total, double* total_lo) {
  for (size_t r = 0; r < samples.size(); ++r) {
    const PrefetchTarget next = SketchNear(samples, r + 1);
    const PrefetchTarget far = SketchNear(samples, r + kPrefetchFar);
    WithBins<kLanes>(samples[r].sketch, [&](const auto& bins) {
      norm2[r] = NormAndAdd<kLanes>(bins, k, next, far, total, total_lo);
    });
  }
}

// Pass 2 for one rank with |v|^2 = norm2 != 0: *dot = <v, w>, *rest2 = |w|^2 with
// w = (total - v) + total_lo, and units += v / |v| (see DotsWithRest).
template <size_t kLanes, typename Bins>
RANKSCOPE_STATS_INLINE void DotWithRest(const Bins& v, size_t k, PrefetchTarget next,
                                        PrefetchTarget far, double norm2, const double* total,
                                        const double* total_lo, double* dot, double* rest2,
                                        double* units) {
  using Doubles = typename Lanes<kLanes>::Doubles;
  constexpr size_t kVectors = Lanes<kLanes>::kVectors;
  const size_t body = k - k % kPartials;
  const double inv_norm = 1.0 / std::sqrt(norm2);
  const Doubles inv = Doubles{} + inv_norm;
  Doubles dots[kVectors] = {};
  Doubles rests[kVectors] = {};
  size_t i = 0;
  for (; i < body; i += kPartials) {
    next.Near(i);
    far.Far(i);
    for (size_t j = 0; j < kVectors; ++j) {
      const size_t at = i + j * kLanes;
      const Doubles x = v.Load(at);
      const Doubles w = (LoadDoubles<kLanes>(total + at) - x) + LoadDoubles<kLanes>(total_lo + at);
      dots[j] += x * w;
      rests[j] += w * w;
      StoreDoubles<kLanes>(units + at, LoadDoubles<kLanes>(units + at) + x * inv);
    }
  }
  double dot_tail = 0.0, rest_tail = 0.0;
  for (; i < k; ++i) {
    const double x = v.At(i);
    const double w = (total[i] - x) + total_lo[i];
    dot_tail += x * w;
    rest_tail += w * w;
    units[i] += x * inv_norm;
  }
  *dot = Fold<kLanes>(dots, dot_tail);
  *rest2 = Fold<kLanes>(rests, rest_tail);
}

// Pass 2. For each rank with norm2[r] != 0, with w = (total - v_r) + total_lo: dot[r] = <v_r, w>,
// rest2[r] = |w|^2, and units += v_r / |v_r| (in reverse rank order). Forms w explicitly rather
// than expanding |total - v|^2 = |total|^2 - 2<total, v> + |v|^2, which cancels catastrophically
// when v dominates the total (e.g. every other rank's sketch is near zero or they cancel). Ranks
// with norm2[r] == 0 get dot = rest2 = 0 and add nothing to units.
template <size_t kLanes>
RANKSCOPE_STATS_INLINE void DotsWithRest(absl::Span<const RankSample> samples, size_t k,
                                         const double* norm2, const double* total,
                                         const double* total_lo, double* dot, double* rest2,
                                         double* units) {
  // Last rank first: pass 1 left the last ranks' sketches in cache.
  for (size_t r = samples.size(); r-- > 0;) {
    if (norm2[r] == 0.0) {
      dot[r] = 0.0;
      rest2[r] = 0.0;
      continue;
    }
    const PrefetchTarget next = SketchNear(samples, static_cast<ptrdiff_t>(r) - 1);
    const PrefetchTarget far = SketchNear(samples, static_cast<ptrdiff_t>(r) - kPrefetchFar);
    WithBins<kLanes>(samples[r].sketch, [&](const auto& bins) {
      DotWithRest<kLanes>(bins, k, next, far, norm2[r], total, total_lo, &dot[r], &rest2[r], units);
    });
  }
}

// The two passes compiled for one ISA.
struct Kernels {
  void (*norms_and_total)(absl::Span<const RankSample> samples, size_t k, double* norm2,
                          double* total, double* total_lo);
  void (*dots_with_rest)(absl::Span<const RankSample> samples, size_t k, const double* norm2,
                         const double* total, const double* total_lo, double* dot, double* rest2,
                         double* units);
};

void NormsAndTotalBaseline(absl::Span<const RankSample> samples, size_t k, double* norm2,
                           double* total, double* total_lo) {
  NormsAndTotal<2>(samples, k, norm2, total, total_lo);
}
void DotsWithRestBaseline(absl::Span<const RankSample> samples, size_t k, const double* norm2,
                          const double* total, const double* total_lo, double* dot, double* rest2,
                          double* units) {
  DotsWithRest<2>(samples, k, norm2, total, total_lo, dot, rest2, units);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RANKSCOPE_STATS_X86 1
__attribute__((target("avx2"))) void NormsAndTotalAvx2(absl::Span<const RankSample> samples,
                                                       size_t k, double* norm2, double* total,
                                                       double* total_lo) {
  NormsAndTotal<4>(samples, k, norm2, total, total_lo);
}
__attribute__((target("avx2"))) void DotsWithRestAvx2(absl::Span<const RankSample> samples,
                                                      size_t k, const double* norm2,
                                                      const double* total, const double* total_lo,
                                                      double* dot, double* rest2, double* units) {
  DotsWithRest<4>(samples, k, norm2, total, total_lo, dot, rest2, units);
}
__attribute__((target("avx512f"))) void NormsAndTotalAvx512(absl::Span<const RankSample> samples,
                                                            size_t k, double* norm2, double* total,
                                                            double* total_lo) {
  NormsAndTotal<8>(samples, k, norm2, total, total_lo);
}
__attribute__((target("avx512f"))) void DotsWithRestAvx512(absl::Span<const RankSample> samples,
                                                           size_t k, const double* norm2,
                                                           const double* total,
                                                           const double* total_lo, double* dot,
                                                           double* rest2, double* units) {
  DotsWithRest<8>(samples, k, norm2, total, total_lo, dot, rest2, units);
}
#endif

Kernels KernelsFor(KernelIsa isa) {
  switch (isa) {
#ifdef RANKSCOPE_STATS_X86
    case KernelIsa::kAvx512:
      return {NormsAndTotalAvx512, DotsWithRestAvx512};
    case KernelIsa::kAvx2:
      return {NormsAndTotalAvx2, DotsWithRestAvx2};
#endif
    default:
      return {NormsAndTotalBaseline, DotsWithRestBaseline};
  }
}

// The kernels for this CPU (common/cpu_isa.h makes the one check, the same as the agent's).
KernelIsa BestKernelIsa() {
#ifdef RANKSCOPE_STATS_X86
  switch (BestCpuIsaLevel()) {
    case CpuIsaLevel::kAvx512:
      return KernelIsa::kAvx512;
    case CpuIsaLevel::kAvx2:
      return KernelIsa::kAvx2;
    case CpuIsaLevel::kBaseline:
      break;
  }
#endif
  return KernelIsa::kBaseline;
}

// sum_i x[i]^2 over n doubles.
double SquaredNorm(const double* x, size_t n) {
  double a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (size_t j = 0; j < 8; ++j) a[j] += x[i + j] * x[i + j];
  }
  for (; i < n; ++i) a[0] += x[i] * x[i];
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// Fills grad_cosine_mean and every per_rank[r].consensus_cosine. O(W k) time, O(W + k) memory,
// two passes over the sketches: the first computes |v_r|^2 and S = sum_r v_r (double-double),
// the second cos(v_r, S - v_r) and U = sum_r u_r (U in double).
void ComputeCosines(absl::Span<const RankSample> samples, const Kernels& kernels,
                    StepStatistics* out) {
  const size_t w = samples.size();
  const size_t k = samples[0].sketch.size();
  auto set_all_nan = [&] {
    out->grad_cosine_mean = kNaN;
    for (RankStatistics& r : out->per_rank) r.consensus_cosine = kNaN;
  };
  for (const RankSample& s : samples) {
    if (s.sketch.size() != k) return set_all_nan();
  }

  std::vector<double> total(k, 0.0);     // S, rounded
  std::vector<double> total_lo(k, 0.0);  // S - total (its rounding error)
  std::vector<double> norm2(w);
  kernels.norms_and_total(samples, k, norm2.data(), total.data(), total_lo.data());
  // Floats squared and summed in double cannot overflow (k <= 2^20), so a non-finite norm means
  // the sketch itself holds NaN or Inf.
  size_t nonzero = 0;
  for (const double n2 : norm2) {
    if (!std::isfinite(n2)) return set_all_nan();
    if (n2 != 0.0) ++nonzero;
  }
  if (w < 2) return set_all_nan();

  std::vector<double> units(k, 0.0);  // U
  std::vector<double> dot(w);
  std::vector<double> rest2(w);
  kernels.dots_with_rest(samples, k, norm2.data(), total.data(), total_lo.data(), dot.data(),
                         rest2.data(), units.data());

  const double wd = static_cast<double>(w);
  out->grad_cosine_mean = ClampCosine(
      (SquaredNorm(units.data(), k) - static_cast<double>(nonzero)) / (wd * (wd - 1.0)));
  for (size_t r = 0; r < w; ++r) {
    double cosine = 0.0;
    if (norm2[r] != 0.0 && rest2[r] != 0.0) {
      cosine = ClampCosine(dot[r] / (std::sqrt(norm2[r]) * std::sqrt(rest2[r])));
    }
    out->per_rank[r].consensus_cosine = cosine;
  }
}

StepStatistics Compute(absl::Span<const RankSample> samples, const Kernels& kernels) {
  StepStatistics out;
  out.ranks = static_cast<uint32_t>(samples.size());
  if (samples.empty()) {
    out.grad_cosine_mean = kNaN;
    return out;
  }

  const Moments loss = Describe(samples, [](const RankSample& s) { return s.loss; });
  const Moments norm = Describe(samples, [](const RankSample& s) { return s.grad_norm; });
  out.loss_mean = loss.mean;
  out.loss_std = loss.std;
  out.loss_range = loss.range;
  out.grad_norm_mean = norm.mean;
  out.grad_norm_std = norm.std;
  out.grad_norm_cv = norm.std == 0.0 ? 0.0 : norm.std / norm.mean;

  out.per_rank.resize(samples.size());
  for (size_t r = 0; r < samples.size(); ++r) {
    RankStatistics& rs = out.per_rank[r];
    rs.rank = samples[r].rank;
    rs.loss_z = ZScore(samples[r].loss, loss);
    rs.grad_norm_z = ZScore(samples[r].grad_norm, norm);
  }
  ComputeCosines(samples, kernels, &out);
  return out;
}

}  // namespace

StepStatistics ComputeStepStatistics(absl::Span<const RankSample> samples) {
  static const Kernels kernels = KernelsFor(BestKernelIsa());
  return Compute(samples, kernels);
}

namespace step_stats_internal {

bool KernelIsaSupported(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kBaseline:
      return true;
    case KernelIsa::kAvx2:
      return BestKernelIsa() != KernelIsa::kBaseline;
    case KernelIsa::kAvx512:
      return BestKernelIsa() == KernelIsa::kAvx512;
  }
  return false;
}

StepStatistics ComputeStepStatisticsWithIsa(absl::Span<const RankSample> samples, KernelIsa isa) {
  return Compute(samples, KernelsFor(isa));
}

}  // namespace step_stats_internal

}  // namespace rankscope::collector
