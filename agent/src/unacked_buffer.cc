#include "unacked_buffer.h"

#include <algorithm>
#include <utility>

namespace rankscope::internal {

UnackedBuffer::UnackedBuffer(size_t max_unacked) : capacity_(std::max<size_t>(max_unacked, 1)) {}

bool UnackedBuffer::Add(uint64_t seq, MessagePtr message) {
  bool dropped = false;
  if (messages_.size() >= capacity_) {
    messages_.erase(messages_.begin());  // oldest
    dropped = true;
  }
  messages_.emplace(seq, std::move(message));
  return dropped;
}

MessagePtr UnackedBuffer::Ack(uint64_t seq) {
  auto it = messages_.find(seq);
  if (it == messages_.end()) return nullptr;
  MessagePtr message = std::move(it->second);
  messages_.erase(it);
  return message;
}

bool UnackedBuffer::Reject(uint64_t seq) { return messages_.erase(seq) > 0; }

void UnackedBuffer::StartResend(uint64_t end) {
  resend_next_ = 0;
  resend_end_ = end;
}

MessagePtr UnackedBuffer::NextResend() {
  if (resend_next_ < resend_end_) {
    auto it = messages_.lower_bound(resend_next_);
    if (it != messages_.end() && it->first < resend_end_) {
      resend_next_ = it->first + 1;
      return it->second;
    }
    resend_next_ = resend_end_;
  }
  return nullptr;
}

}  // namespace rankscope::internal
