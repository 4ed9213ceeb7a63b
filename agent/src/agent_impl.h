// AgentImpl: the agent behind rankscope/agent.h. A ReportRing fed by Record(); one gRPC stream
// on the callback API (StreamCall) whose reactions, on gRPC's threads, chain writes while reports
// wait and apply acks and controls; one sender thread that opens the stream, waits for its end
// and reconnects with backoff; and the process's SendPoller thread (send_poller.h) that starts
// writing on an idle stream whose ring holds reports. Sent reports wait for their ack in an
// UnackedBuffer (unacked_buffer.h); messages are built by wire.h.
//
// Thread safety. Four kinds of caller:
//  - the training thread(s): Record, Flush, Close, stats, control, options (the public API,
//    thread-safe);
//  - the sender thread (SenderLoop, RunStream, WaitForWake): creates, cancels and destroys each
//    StreamCall, and writes the hello;
//  - the poller thread (PollSend): starts a write on live_call_ only, and the sender waits for
//    poller_starting_ == 0 before it lets the call end;
//  - gRPC's threads (the reactions OnWriteDone, OnReadDone, OnStreamDone).
// Every field shared between them is guarded by mu_ (ABSL_GUARDED_BY below); the sender's sleep
// has its own wake_mu_, never held with mu_. Whoever holds the write token (writing_ set under
// mu_) owns scratch_ and the StreamCall's write-side fields. No gRPC call (Start*, TryCancel,
// RemoveHold) is made with mu_ held: gRPC may run reactions inline in them, and reactions take
// mu_. Nor is any write to stderr (it blocks while a pipe nobody reads is full): lines for the
// job's stderr are built under mu_ and printed after it is released. Lock order: mu_ is taken
// with no other lock held (the SendPoller calls PollSend with none of its own); wake_mu_ and the
// poller's locks are leaves.
//
// Cost (docs/PERFORMANCE.md "Agent Record"): Record() locks mu_, copies the report into a
// preallocated ring slot and returns. It makes no syscall and wakes no thread (except the poller
// once, when the ring reaches half full), so the training thread never pays a futex wake-up, nor
// the preemption by the woken thread that can follow it. Once a write is started, each
// OnWriteDone starts the next one on the gRPC thread that completed the previous, so a backlog is
// written with no thread hand-off. (The first design, blocking Write/Read on a sender and a
// reader thread, woken by every Record(), cost about two wake-ups per report and 30 us in
// Record() at the median.)
#ifndef RANKSCOPE_AGENT_SRC_AGENT_IMPL_H_
#define RANKSCOPE_AGENT_SRC_AGENT_IMPL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "backoff.h"
#include "common/mutex.h"
#include "common/sketch_dim.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/agent.h"
#include "rankscope/v1/rankscope.grpc.pb.h"
#include "report_queue.h"
#include "send_poller.h"
#include "unacked_buffer.h"
#include "wire.h"

namespace rankscope::internal {

class AgentImpl final : public Agent, private SendPoller::Client {
 public:
  // Starts the sender thread and registers with the SendPoller. `options` are validated
  // (Agent::Create); `collector` is the one address of options.collector_address this agent
  // streams to (the job's shard).
  AgentImpl(AgentOptions options, std::string collector,
            std::shared_ptr<grpc::ChannelCredentials> credentials);
  ~AgentImpl() override;

  // Training thread(s); see rankscope/agent.h.
  absl::Status Record(const StepReport& report) ABSL_LOCKS_EXCLUDED(mu_) override;
  absl::Status Flush(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_) override;
  absl::Status Close(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_, wake_mu_) override;
  AgentStats stats() const ABSL_LOCKS_EXCLUDED(mu_) override;
  std::optional<AgentControl> control() const ABSL_LOCKS_EXCLUDED(mu_) override;
  const AgentOptions& options() const override { return options_; }
  const std::string& collector() const override { return collector_; }

 private:
  // One stream (one Ingest.Stream call) on gRPC's callback API. Created, cancelled and destroyed
  // by the sender thread; its reactions run on gRPC's threads (or inline in a Start* call made
  // by the sender thread, so no Start* or TryCancel is ever called with mu_ held).
  //
  // Writes: at most one in flight. Whoever holds the write token (AgentImpl::writing_) starts the
  // next write: the sender thread when the stream was idle and work arrived, or OnWriteDone when
  // more work is waiting, so a backlog is written back to back with no thread hand-off. Reads
  // (acks, rejections, controls) are applied in OnReadDone; there is no reader thread.
  class StreamCall final : public grpc::ClientBidiReactor<v1::AgentMessage, v1::CollectorMessage> {
   public:
    explicit StreamCall(AgentImpl* agent) : agent_(agent) {}

    // Each reaction acquires what the thread that started its operation released
    // (RANKSCOPE_TSAN_RELEASE(call) before every Start*, TryCancel and RemoveHold): the ordering
    // gRPC guarantees, made visible to ThreadSanitizer (common/tsan.h).
    void OnWriteDone(bool ok) override;
    void OnReadDone(bool ok) override;
    // The last reaction: after it returns gRPC no longer touches this object.
    void OnDone(const grpc::Status& status) override;

    grpc::ClientContext context;
    v1::AgentMessage hello;      // the first write
    v1::CollectorMessage in;     // reactions only
    bool hello_written = false;  // write-token holder only
    bool received_any = false;   // reactions only
    MessagePtr current;          // the write in flight; write-token holder only

   private:
    AgentImpl* const agent_;
  };

  // Sender thread: runs streams and reconnects with backoff until Close() or a refusal.
  void SenderLoop() ABSL_LOCKS_EXCLUDED(mu_, wake_mu_);
  // One stream's life: hello, resend what is unacked, then stream new reports until the stream
  // breaks or the agent stops. Sender thread.
  void RunStream() ABSL_LOCKS_EXCLUDED(mu_, wake_mu_);
  // Wakes the sender thread: work is waiting or the stream changed state. Any thread, without
  // mu_ held.
  void Wake() ABSL_LOCKS_EXCLUDED(wake_mu_);
  // Sender thread: sleeps until Wake(), Close() or `timeout`.
  void WaitForWake(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(wake_mu_);

  // True when a write could be started: an unacked report to resend or a report in the ring.
  bool HasWorkLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Poller thread: starts a write if the stream is live and idle and a report waits. Returns
  // whether it did.
  bool PollSend() ABSL_LOCKS_EXCLUDED(mu_) override;
  // The next message to write, or null when there is none (or the stream is ending). Called by
  // the write-token holder only, without mu_: a resend of the oldest unacked report not yet
  // resent on this stream, else the oldest report in the ring (moved out, given the next seq and
  // kept in the unacked buffer).
  MessagePtr NextMessage() ABSL_LOCKS_EXCLUDED(mu_);

  // Reactions (gRPC's threads).
  // The hello or a report was written (ok) or the stream broke (!ok). Passes the write token on:
  // writes the next message at once if there is one.
  void OnWriteDone(StreamCall* call, bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // An ack, rejection or control arrived (ok), or the stream ended (!ok).
  void OnReadDone(StreamCall* call, bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets acked reports. One Ack may carry thousands of seqs (every report of a rank committed
  // in one transaction): mu_ is taken per chunk of seqs, and the messages are freed outside it,
  // so Record() never waits for more than a chunk.
  void ApplyAcks(const google::protobuf::RepeatedField<uint64_t>& seqs) ABSL_LOCKS_EXCLUDED(mu_);
  // The stream is over. Touches only the agent, so the sender may then destroy the StreamCall.
  void OnStreamDone(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  // The collector refused this rank for good: stop reconnecting and let go of every held report
  // (counted as rejected), so Flush and Close return at once. Returns the line that says so,
  // once, plainly (the caller prints it after releasing mu_).
  std::string RefuseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A stream ended with `status` (sender thread): records its error, and returns the line for
  // stderr if this end is news (a refusal, a holder elsewhere, the first failure of an outage),
  // else "". Printed by the caller after releasing mu_: no stderr write is made with mu_ held.
  std::string StreamEndNoteLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a person can do about a connection failure, given how this agent connects.
  std::string TransportHint(const grpc::Status& status) const;

  // Set in the constructor, then read-only.
  AgentOptions options_;
  const std::string collector_;  // the job's shard of options_.collector_address
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Ingest::Stub> stub_;
  const size_t wake_threshold_ = std::max<size_t>(options_.queue_capacity / 2, 1);

  QueuedReport scratch_;  // write-token holder only

  mutable Mutex mu_;
  ReportRing ring_ ABSL_GUARDED_BY(mu_);
  UnackedBuffer unacked_ ABSL_GUARDED_BY(mu_);
  Backoff backoff_ ABSL_GUARDED_BY(mu_);
  AgentStats stats_ ABSL_GUARDED_BY(mu_);
  std::optional<AgentControl> control_ ABSL_GUARDED_BY(mu_);
  // The sketch lengths Record accepts: the hello's, and a control's re-tuned one.
  SketchDimSchedule sketch_dims_ ABSL_GUARDED_BY(mu_);
  // Reports recorded and neither acked, rejected nor dropped yet.
  uint64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;             // the write token: a write is in flight
  StreamCall* live_call_ ABSL_GUARDED_BY(mu_) = nullptr;  // the poller may start writes on it
  int poller_starting_ ABSL_GUARDED_BY(mu_) = 0;          // PollSend calls past live_call_
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;
  bool stream_done_ ABSL_GUARDED_BY(mu_) = false;  // the current stream's OnDone ran
  grpc::Status stream_status_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool sender_done_ ABSL_GUARDED_BY(mu_) = false;
  bool warned_down_ ABSL_GUARDED_BY(mu_) = false;
  bool refused_ ABSL_GUARDED_BY(mu_) = false;  // a permanent refusal: see AgentStats::refused
  bool held_elsewhere_ ABSL_GUARDED_BY(mu_) = false;  // see AgentStats::held_elsewhere
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  absl::Status close_status_ ABSL_GUARDED_BY(mu_);

  // The sender thread's sleep. Separate from mu_ so that Record(), which takes mu_, normally
  // unlocks it with no waiter to examine or wake.
  Mutex wake_mu_;  // never held together with mu_
  bool wake_ ABSL_GUARDED_BY(wake_mu_) = false;
  bool stop_requested_ ABSL_GUARDED_BY(wake_mu_) = false;

  std::thread sender_;  // started in the constructor, joined by Close()
};

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_AGENT_IMPL_H_
