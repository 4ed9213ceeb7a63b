// Acknowledgement plumbing between the pure core and the gRPC edge.
//
// The joiner and the store writer carry AckHandles without knowing what is behind them; the
// ingest service implements AckSink on top of its stream reactor. An AckSink whose stream has
// gone away must accept and ignore acks and abandons.
//
// An agent resends what is unacked only after it reconnects. So whenever the collector gives up
// on a report it has not stored (the store writer dropped it: queue overflow or a permanent store
// error), it must Abandon the report's sink: the stream is ended with the given (UNAVAILABLE)
// status, the agent reconnects and resends everything it still holds, and the report comes back.
#ifndef RANKSCOPE_COLLECTOR_MODEL_ACK_H_
#define RANKSCOPE_COLLECTOR_MODEL_ACK_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace rankscope::collector {

class AckSink {
 public:
  virtual ~AckSink() = default;
  // Called after the reports with these agent sequence numbers are durably stored. Thread-safe;
  // may be called from any thread, must not block.
  virtual void Ack(absl::Span<const uint64_t> seqs) = 0;
  // Called when reports of this sink were dropped unacked: ends the stream with `why` (an
  // UNAVAILABLE status, so that the agent reconnects and resends). Thread-safe, must not block;
  // a no-op once the stream ended.
  virtual void Abandon(const absl::Status& why) = 0;
};

struct AckHandle {
  std::shared_ptr<AckSink> sink;  // may be null (nothing to ack, e.g. in tests)
  uint64_t seq = 0;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_MODEL_ACK_H_
