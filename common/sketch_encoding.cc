#include "common/sketch_encoding.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace rankscope {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// x rounded to the nearest integer, ties to even, whatever the floating-point environment's
// rounding mode (the conversion truncates toward zero by definition). Requires |x| < 2^31.
// Branch-free, so that the packing loop vectorizes.
int32_t RoundHalfEven(double x) {
  const int32_t t = static_cast<int32_t>(x);
  const double frac = x - static_cast<double>(t);  // exact; same sign as x
  const int32_t odd = t & 1;
  return t + static_cast<int32_t>(frac > 0.5) - static_cast<int32_t>(frac < -0.5) +
         (static_cast<int32_t>(frac == 0.5) & odd) - (static_cast<int32_t>(frac == -0.5) & odd);
}

}  // namespace

const char* SketchEncodingName(SketchEncoding e) {
  switch (e) {
    case SketchEncoding::kFloat32:
      return "float32";
    case SketchEncoding::kFloat16:
      return "float16";
    case SketchEncoding::kInt8:
      return "int8";
  }
  return "unknown";
}

std::optional<SketchEncoding> ParseSketchEncoding(absl::string_view name) {
  for (SketchEncoding e :
       {SketchEncoding::kFloat32, SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
    if (name == SketchEncodingName(e)) return e;
  }
  return std::nullopt;
}

std::optional<SketchEncoding> SketchEncodingFromWire(int value) {
  if (value < 0 || value > static_cast<int>(SketchEncoding::kInt8)) return std::nullopt;
  return static_cast<SketchEncoding>(value);
}

uint16_t HalfFromFloat(float f) {
  uint32_t x = FloatBits(f);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t out;
  if (x >= 0x47800000u) {  // |f| >= 2^16, Inf or NaN
    out = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (x < 0x38800000u) {  // |f| < 2^-14: a subnormal half or zero
    // Integer rounding of the mantissa shifted into the half's subnormal grid (2^-24 steps).
    const uint32_t exp = x >> 23;
    if (exp < 102) {  // |f| < 2^-25: rounds to zero
      out = 0;
    } else {
      const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
      const uint32_t shift = 126 - exp;  // 14..24: value = mant * 2^(exp - 150), grid 2^-24
      const uint32_t q = mant >> shift;
      const uint32_t rest = mant & ((1u << shift) - 1);
      const uint32_t half = 1u << (shift - 1);
      out = q + ((rest > half || (rest == half && (q & 1))) ? 1 : 0);
    }
  } else {
    const uint32_t mant_odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;  // rebias, round to nearest
    x += mant_odd;                                          // ties to even
    out = x >> 13;  // a carry into the exponent is correct, up to +Inf
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

float FloatFromHalf(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  uint32_t bits = magnitude << 13;
  if ((magnitude & 0x7c00u) == 0x7c00u) bits |= 0x7f800000u;  // Inf or NaN
  // The half's exponent bias is 15, the float's 127: scaling by 2^112 is exact, also for the
  // half's subnormals (which are float subnormals before the product).
  const float f = BitsFloat(bits) * 0x1p112f;
  return BitsFloat(FloatBits(f) | sign);
}

PackedSketch PackSketch(absl::Span<const float> values, SketchEncoding encoding) {
  PackedSketch out;
  const size_t k = values.size();
  out.bins.assign(k * SketchBytesPerBin(encoding), '\0');
  if (encoding == SketchEncoding::kFloat32) {
    if (k > 0) std::memcpy(out.bins.data(), values.data(), k * sizeof(float));
    return out;
  }
  // The largest magnitude, on the floats' bits (branch-free, so it vectorizes): a magnitude's bits
  // order like its value, and Inf/NaN are the bit patterns from 0x7f800000 up.
  uint32_t max_bits = 0;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    max_bits = std::max(max_bits, bits & 0x7fffffffu);
  }
  if (max_bits >= 0x7f800000u) {
    out.scale = std::numeric_limits<float>::quiet_NaN();
    return out;
  }
  const float max_abs = BitsFloat(max_bits);
  if (max_abs == 0.0f) return out;  // scale 1, zero bins

  if (encoding == SketchEncoding::kFloat16) {
    int e = 0;
    std::frexp(max_abs, &e);  // 2^(e-1) <= max_abs < 2^e
    // Keep the scale a normal float (a sketch below 2^-111 loses its smallest bins).
    const int scale_exp = std::max(e - 15, -126);
    out.scale = std::ldexp(1.0f, scale_exp);
    // A power of two in [2^-113, 2^126]: the product is exact unless it is below 2^-126, far
    // under the half's smallest subnormal (2^-24), where it rounds to zero either way.
    const float inv = std::ldexp(1.0f, -scale_exp);
    char* bins = out.bins.data();
    for (size_t i = 0; i < k; ++i) {
      const uint16_t h = HalfFromFloat(values[i] * inv);
      std::memcpy(bins + 2 * i, &h, sizeof h);
    }
    return out;
  }

  out.scale = static_cast<float>(static_cast<double>(max_abs) / 127.0);
  if (out.scale == 0.0f) out.scale = std::numeric_limits<float>::denorm_min();
  const double inv = 1.0 / static_cast<double>(out.scale);
  char* bins = out.bins.data();
  for (size_t i = 0; i < k; ++i) {
    // v * (1/scale) in double: rounding the quotient first moves it by < 2^-44 of itself, which
    // can only change the rounding of a quotient within 2^-44 of a half-integer tie.
    // |v / scale| <= 127 * (1 + 2^-23) + rounding: far inside int32.
    const int32_t q = std::clamp(RoundHalfEven(static_cast<double>(values[i]) * inv), -127, 127);
    bins[i] = static_cast<char>(static_cast<int8_t>(q));
  }
  return out;
}

double SketchView::Value(size_t i) const {
  switch (encoding) {
    case SketchEncoding::kFloat32: {
      float f;
      std::memcpy(&f, static_cast<const char*>(data) + i * sizeof f, sizeof f);
      return f;
    }
    case SketchEncoding::kFloat16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(data) + i * sizeof h, sizeof h);
      return static_cast<double>(FloatFromHalf(h)) * static_cast<double>(scale);
    }
    case SketchEncoding::kInt8:
      return static_cast<double>(static_cast<const int8_t*>(data)[i]) * static_cast<double>(scale);
  }
  return 0.0;
}

bool SketchView::AllFinite() const {
  if (encoding == SketchEncoding::kFloat32) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < dim; ++i) {
      uint32_t bits;
      std::memcpy(&bits, bytes + i * sizeof bits, sizeof bits);
      if ((bits & 0x7f800000u) == 0x7f800000u) return false;  // exponent all ones: Inf or NaN
    }
    return true;
  }
  if (!std::isfinite(scale)) return false;
  if (encoding == SketchEncoding::kFloat16) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < dim; ++i) {
      if ((bytes[2 * i + 1] & 0x7c) == 0x7c) return false;  // exponent all ones: Inf or NaN
    }
  }
  return true;
}

namespace {

// Bin i of a sketch of one encoding, decoded exactly (see SketchView::Value).
struct Float32At {
  const char* p;
  double operator()(size_t i) const {
    float f;
    std::memcpy(&f, p + i * sizeof f, sizeof f);
    return f;
  }
};
struct Float16At {
  const char* p;
  double scale;
  double operator()(size_t i) const {
    uint16_t h;
    std::memcpy(&h, p + i * sizeof h, sizeof h);
    return static_cast<double>(FloatFromHalf(h)) * scale;
  }
};
struct Int8At {
  const int8_t* p;
  double scale;
  double operator()(size_t i) const { return static_cast<double>(p[i]) * scale; }
};

template <typename Fn>
double WithDecoder(const SketchView& v, Fn&& fn) {
  switch (v.encoding) {
    case SketchEncoding::kFloat16:
      return fn(Float16At{static_cast<const char*>(v.data), static_cast<double>(v.scale)});
    case SketchEncoding::kInt8:
      return fn(Int8At{static_cast<const int8_t*>(v.data), static_cast<double>(v.scale)});
    case SketchEncoding::kFloat32:
      break;
  }
  return fn(Float32At{static_cast<const char*>(v.data)});
}

}  // namespace

double SketchDot(const SketchView& a, const SketchView& b) {
  const size_t k = std::min(a.size(), b.size());
  if (a.encoding == SketchEncoding::kInt8 && b.encoding == SketchEncoding::kInt8) {
    const auto* qa = static_cast<const int8_t*>(a.data);
    const auto* qb = static_cast<const int8_t*>(b.data);
    int64_t sum = 0;  // |q| <= 128: exact for k < 2^49
    for (size_t i = 0; i < k; ++i) sum += static_cast<int32_t>(qa[i]) * qb[i];
    return static_cast<double>(sum) * static_cast<double>(a.scale) * static_cast<double>(b.scale);
  }
  return WithDecoder(a, [&](const auto& at_a) {
    return WithDecoder(b, [&](const auto& at_b) {
      double sum = 0.0;
      for (size_t i = 0; i < k; ++i) sum += at_a(i) * at_b(i);
      return sum;
    });
  });
}

std::vector<double> DecodeSketch(const SketchView& view) {
  std::vector<double> out(view.dim);
  for (size_t i = 0; i < view.dim; ++i) out[i] = view.Value(i);
  return out;
}

}  // namespace rankscope
