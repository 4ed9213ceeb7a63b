// Acknowledgement plumbing between the pure core and the gRPC edge.
//
// The joiner and the store writer carry AckHandles without knowing what is behind them; the
// ingest service implements AckSink on top of its stream reactor. An AckSink whose stream has
// gone away must accept and ignore acks.
#ifndef RANKSCOPE_COLLECTOR_ACK_H_
#define RANKSCOPE_COLLECTOR_ACK_H_

#include <cstdint>
#include <memory>

#include "absl/types/span.h"

namespace rankscope::collector {

class AckSink {
 public:
  virtual ~AckSink() = default;
  // Called after the reports with these agent sequence numbers are durably stored. Thread-safe;
  // may be called from any thread, must not block.
  virtual void Ack(absl::Span<const uint64_t> seqs) = 0;
};

struct AckHandle {
  std::shared_ptr<AckSink> sink;  // may be null (nothing to ack, e.g. in tests)
  uint64_t seq = 0;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ACK_H_
