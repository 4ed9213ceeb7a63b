// ByteReader: the fuzz targets' view of their input, consumed front to back.
//
// Unlike libFuzzer's FuzzedDataProvider (which takes integers from the end), every value is read
// from the front, so the seeds written by tests/fuzz/make_corpus.py are plain byte strings that
// read in the order they are written. An exhausted reader returns zeros, so every input is valid.
#ifndef RANKSCOPE_TESTS_FUZZ_BYTE_READER_H_
#define RANKSCOPE_TESTS_FUZZ_BYTE_READER_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace rankscope::fuzz {

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }
  size_t remaining() const { return size_ - pos_; }

  uint8_t U8() {
    if (pos_ >= size_) return 0;
    return data_[pos_++];
  }
  // Little-endian.
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  uint32_t U32() { return U16() | (static_cast<uint32_t>(U16()) << 16); }
  uint64_t U64() { return U32() | (static_cast<uint64_t>(U32()) << 32); }

  // The raw bits of an IEEE double / float (any NaN payload, infinities, subnormals).
  double RawDouble() {
    const uint64_t bits = U64();
    double d;
    std::memcpy(&d, &bits, sizeof(d));
    return d;
  }
  float RawFloat() {
    const uint32_t bits = U32();
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }

  // The next `n` bytes (fewer if the input ends first).
  absl::string_view Bytes(size_t n) {
    if (n > remaining()) n = remaining();
    absl::string_view out(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return out;
  }
  absl::string_view Rest() { return Bytes(remaining()); }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace rankscope::fuzz

#endif  // RANKSCOPE_TESTS_FUZZ_BYTE_READER_H_
