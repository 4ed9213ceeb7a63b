#include "rankscope/fingerprint.h"

#include <cstring>

#include "absl/status/status.h"
#include "rankscope/sketch.h"

namespace rankscope {
namespace {

// One pass over n elements of bit type Bits; no temporaries.
template <typename Bits, typename Decode>
void FoldRange(const Bits* p, size_t n, uint64_t offset, Decode decode, ReplicaFingerprint* acc) {
  uint64_t fp = 0;
  uint64_t w = 2 * offset + 1;
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i, w += 2) {
    const uint64_t term = static_cast<uint64_t>(static_cast<int64_t>(p[i])) + 1;
    fp += term * w;
    const double v = decode(p[i]);
    sum += v * v;
  }
  acc->fingerprint += fp;
  acc->sum_squares += sum;
}

}  // namespace

size_t FingerprintElementSize(int dtype) {
  if (dtype == kFingerprintFloat64) return 8;
  return dtype == static_cast<int>(ScalarType::kFloat32) ? 4 : 2;
}

void FoldFingerprint(const void* data, int dtype, size_t n, uint64_t offset,
                     ReplicaFingerprint* acc) {
  switch (dtype) {
    case static_cast<int>(ScalarType::kFloat32):
      FoldRange(
          static_cast<const int32_t*>(data), n, offset,
          [](int32_t b) {
            float f;
            std::memcpy(&f, &b, sizeof(f));
            return static_cast<double>(f);
          },
          acc);
      return;
    case static_cast<int>(ScalarType::kBFloat16):
      FoldRange(
          static_cast<const int16_t*>(data), n, offset,
          [](int16_t b) { return static_cast<double>(BFloat16ToFloat(static_cast<uint16_t>(b))); },
          acc);
      return;
    case static_cast<int>(ScalarType::kFloat16):
      FoldRange(
          static_cast<const int16_t*>(data), n, offset,
          [](int16_t b) { return static_cast<double>(Float16ToFloat(static_cast<uint16_t>(b))); },
          acc);
      return;
    default:  // kFingerprintFloat64
      FoldRange(
          static_cast<const int64_t*>(data), n, offset,
          [](int64_t b) {
            double d;
            std::memcpy(&d, &b, sizeof(d));
            return d;
          },
          acc);
  }
}

absl::StatusOr<ReplicaFingerprint> FingerprintSegments(const void* base, int dtype,
                                                       absl::Span<const size_t> starts,
                                                       absl::Span<const size_t> counts,
                                                       absl::Span<const uint64_t> global_offsets) {
  if (dtype < 0 || dtype > kFingerprintFloat64) {
    return absl::InvalidArgumentError(
        "dtype must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (float64)");
  }
  if (starts.size() != counts.size() || counts.size() != global_offsets.size()) {
    return absl::InvalidArgumentError("starts, counts and global_offsets differ in length");
  }
  if (base == nullptr && !counts.empty()) return absl::InvalidArgumentError("null address");
  ReplicaFingerprint result;
  const size_t size = FingerprintElementSize(dtype);
  const char* bytes = static_cast<const char*>(base);
  for (size_t k = 0; k < counts.size(); ++k) {
    FoldFingerprint(bytes + starts[k] * size, dtype, counts[k], global_offsets[k], &result);
  }
  return result;
}

}  // namespace rankscope
