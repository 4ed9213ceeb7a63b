// UnackedBuffer on its own: acks, rejections, the bound and the resend order.
#include "unacked_buffer.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace rankscope::internal {
namespace {

MessagePtr Report(uint64_t seq) {
  auto msg = std::make_shared<v1::AgentMessage>();
  msg->mutable_report()->set_seq(seq);
  msg->mutable_report()->set_step(1000 + seq);
  return msg;
}

// Adds seqs [first, last] in order; expects no drop.
void AddRange(UnackedBuffer& buffer, uint64_t first, uint64_t last) {
  for (uint64_t seq = first; seq <= last; ++seq) {
    ASSERT_FALSE(buffer.Add(seq, Report(seq))) << seq;
  }
}

// Every seq NextResend() hands out, in order, until it returns null.
std::vector<uint64_t> DrainResend(UnackedBuffer& buffer) {
  std::vector<uint64_t> seqs;
  while (MessagePtr msg = buffer.NextResend()) seqs.push_back(msg->report().seq());
  return seqs;
}

TEST(UnackedBufferTest, AckRemovesExactlyTheAckedSequences) {
  UnackedBuffer buffer(100);
  AddRange(buffer, 1, 10);
  EXPECT_EQ(buffer.size(), 10u);
  for (uint64_t seq : {2, 5, 9}) {
    MessagePtr acked = buffer.Ack(seq);
    ASSERT_NE(acked, nullptr);
    EXPECT_EQ(acked->report().seq(), seq);
    EXPECT_EQ(acked->report().step(), 1000 + seq);
  }
  EXPECT_EQ(buffer.size(), 7u);
  buffer.StartResend(11);
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{1, 3, 4, 6, 7, 8, 10}));
}

TEST(UnackedBufferTest, UnknownAndDuplicateAcksAreHarmless) {
  UnackedBuffer buffer(100);
  AddRange(buffer, 1, 3);
  ASSERT_NE(buffer.Ack(2), nullptr);
  EXPECT_EQ(buffer.Ack(2), nullptr);   // acked twice
  EXPECT_EQ(buffer.Ack(0), nullptr);   // never sent
  EXPECT_EQ(buffer.Ack(99), nullptr);  // beyond every seq
  EXPECT_EQ(buffer.size(), 2u);
  EXPECT_FALSE(buffer.Reject(2));  // acked, then rejected: nothing to forget
  EXPECT_EQ(buffer.size(), 2u);
  buffer.StartResend(4);
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{1, 3}));
}

TEST(UnackedBufferTest, RejectionsAreForgottenNotResent) {
  UnackedBuffer buffer(100);
  AddRange(buffer, 1, 5);
  EXPECT_TRUE(buffer.Reject(3));
  EXPECT_FALSE(buffer.Reject(3));
  EXPECT_EQ(buffer.Ack(3), nullptr);
  EXPECT_EQ(buffer.size(), 4u);
  buffer.StartResend(6);
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{1, 2, 4, 5}));
}

TEST(UnackedBufferTest, ResendIsAscendingAndStopsAtTheEndOfTheRange) {
  UnackedBuffer buffer(100);
  AddRange(buffer, 1, 6);
  EXPECT_FALSE(buffer.HasResend());  // nothing marked before a reconnect
  EXPECT_EQ(buffer.NextResend(), nullptr);
  buffer.StartResend(5);  // seqs 1..4 were sent on the old stream; 5 and 6 are new
  EXPECT_TRUE(buffer.HasResend());
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_FALSE(buffer.HasResend());
  EXPECT_EQ(buffer.size(), 6u);  // resending hands out, it does not forget
  // The next stream starts over, from the lowest seq still held.
  ASSERT_NE(buffer.Ack(1), nullptr);
  buffer.StartResend(7);
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{2, 3, 4, 5, 6}));
}

TEST(UnackedBufferTest, ResendSkipsWhatIsAckedOrRejectedMidway) {
  UnackedBuffer buffer(100);
  AddRange(buffer, 1, 8);
  buffer.StartResend(9);
  EXPECT_EQ(buffer.NextResend()->report().seq(), 1u);
  EXPECT_EQ(buffer.NextResend()->report().seq(), 2u);
  ASSERT_NE(buffer.Ack(3), nullptr);
  ASSERT_TRUE(buffer.Reject(4));
  ASSERT_NE(buffer.Ack(1), nullptr);  // already resent: no effect on the order
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{5, 6, 7, 8}));
  // Every held seq acked while the range is still open: HasResend() turns false.
  buffer.StartResend(9);
  for (uint64_t seq : {2, 5, 6, 7, 8}) ASSERT_NE(buffer.Ack(seq), nullptr);
  EXPECT_TRUE(buffer.empty());
  EXPECT_FALSE(buffer.HasResend());
  EXPECT_EQ(buffer.NextResend(), nullptr);
}

TEST(UnackedBufferTest, BoundForgetsTheOldestAndSaysSo) {
  UnackedBuffer buffer(3);
  EXPECT_EQ(buffer.capacity(), 3u);
  AddRange(buffer, 1, 3);
  EXPECT_TRUE(buffer.Add(4, Report(4)));  // 1 forgotten
  EXPECT_EQ(buffer.size(), 3u);
  EXPECT_EQ(buffer.Ack(1), nullptr);
  ASSERT_NE(buffer.Ack(3), nullptr);
  EXPECT_FALSE(buffer.Add(5, Report(5)));  // room again after the ack
  EXPECT_TRUE(buffer.Add(6, Report(6)));   // 2 forgotten
  buffer.StartResend(7);
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{4, 5, 6}));
}

TEST(UnackedBufferTest, BoundDuringResendSkipsTheForgotten) {
  UnackedBuffer buffer(4);
  AddRange(buffer, 1, 4);
  buffer.StartResend(5);
  EXPECT_EQ(buffer.NextResend()->report().seq(), 1u);
  // New reports arrive while resending: each forgets the oldest (1, then 2).
  EXPECT_TRUE(buffer.Add(5, Report(5)));
  EXPECT_TRUE(buffer.Add(6, Report(6)));
  // The resend goes on from what is left below the range's end; new seqs are not resent.
  EXPECT_EQ(DrainResend(buffer), (std::vector<uint64_t>{3, 4}));
}

TEST(UnackedBufferTest, ZeroBoundKeepsOne) {
  UnackedBuffer buffer(0);
  EXPECT_EQ(buffer.capacity(), 1u);
  EXPECT_FALSE(buffer.Add(1, Report(1)));
  EXPECT_TRUE(buffer.Add(2, Report(2)));
  EXPECT_EQ(buffer.size(), 1u);
  EXPECT_EQ(buffer.Ack(1), nullptr);
  EXPECT_NE(buffer.Ack(2), nullptr);
  EXPECT_TRUE(buffer.empty());
}

}  // namespace
}  // namespace rankscope::internal
