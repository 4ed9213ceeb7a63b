// Jittered exponential backoff for reconnecting (as Envoy's grpc_stream.h does).
//
// The n-th consecutive delay is uniform in [base/2, base] with base = min(max, initial * 2^n).
// Reset() after the first message of a stream is received.
//
// Thread safety: thread-compatible.
#ifndef RANKSCOPE_AGENT_SRC_BACKOFF_H_
#define RANKSCOPE_AGENT_SRC_BACKOFF_H_

#include <cstdint>

#include "absl/random/random.h"
#include "absl/time/time.h"

namespace rankscope::internal {

class Backoff {
 public:
  Backoff(absl::Duration initial, absl::Duration max, uint64_t seed);

  // The delay before the next attempt; advances the exponent.
  absl::Duration Next();
  void Reset() { attempts_ = 0; }
  int attempts() const { return attempts_; }

 private:
  absl::Duration initial_;
  absl::Duration max_;
  int attempts_ = 0;
  absl::InsecureBitGen gen_;
};

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_BACKOFF_H_
