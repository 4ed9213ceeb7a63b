// UnackedBuffer: the reports an agent has handed to a stream and the collector has not yet
// acknowledged, by sequence number, kept for resending after a reconnect.
//
// Bounded by max_unacked: Add() past the bound forgets the oldest report (the lowest seq) and
// says so; the caller counts the drop. An ack forgets its seq, and so does a rejection (a refused
// report is never resent). Seqs the buffer does not hold (acked already, acked twice, rejected,
// dropped, never sent) are ignored. After a reconnect StartResend(end) marks every held seq below
// `end` for resending; NextResend() hands them out in ascending order, skipping those acked,
// rejected or dropped meanwhile.
//
// Thread safety: thread-compatible; the agent guards its buffer with its own mutex.
#ifndef RANKSCOPE_AGENT_SRC_UNACKED_BUFFER_H_
#define RANKSCOPE_AGENT_SRC_UNACKED_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::internal {

// A wire message shared between the buffer and the stream writing it.
using MessagePtr = std::shared_ptr<const v1::AgentMessage>;

class UnackedBuffer {
 public:
  // Keeps at most max(max_unacked, 1) reports.
  explicit UnackedBuffer(size_t max_unacked);

  // Keeps `message` under `seq`, which must be higher than every seq added before. Returns true
  // iff the oldest report was forgotten to make room.
  bool Add(uint64_t seq, MessagePtr message);

  // Forgets an acknowledged report. Returns its message (for the caller to free, e.g. outside
  // its lock), or null if `seq` is not held.
  MessagePtr Ack(uint64_t seq);

  // Forgets a rejected report: it will not be resent. Returns whether `seq` was held.
  bool Reject(uint64_t seq);

  // Marks every held seq below `end` for resending, from the lowest (a new stream).
  void StartResend(uint64_t end);

  // True iff a report marked for resending may remain (NextResend() may still return null when
  // every one left was forgotten meanwhile).
  bool HasResend() const { return resend_next_ < resend_end_ && !messages_.empty(); }

  // The lowest held seq marked for resending and not handed out yet, unmarked; null when none.
  MessagePtr NextResend();

  // Forgets every held report (the collector refused the rank for good).
  void Clear() {
    messages_.clear();
    resend_next_ = resend_end_;
  }

  size_t size() const { return messages_.size(); }
  bool empty() const { return messages_.empty(); }
  size_t capacity() const { return capacity_; }

 private:
  const size_t capacity_;
  std::map<uint64_t, MessagePtr> messages_;
  // Held seqs in [resend_next_, resend_end_) are still to be resent on the current stream.
  uint64_t resend_next_ = 0;
  uint64_t resend_end_ = 0;
};

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_UNACKED_BUFFER_H_
