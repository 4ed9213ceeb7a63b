// SendPoller: the process's one poller thread, which starts a write on every agent stream that
// is idle while a report waits in its ring (AgentImpl::PollSend, agent_impl.h).
//
// Record() therefore wakes no thread, and a process with many agents (loadgen, tests) pays one
// wake-up per poll, not one per agent or per report. The poller polls every kMinSendPoll while
// writes are being started and backs off to kMaxSendPoll when none is; Wake() polls at once (a
// ring got half full). Its thread ("rs-agent-poll") starts with the first Register() and lives
// as long as the process.
//
// A sweep polls a copy of the client list taken under mu_, and calls PollSend with no lock of
// the poller's held: a client whose PollSend waits (for its agent's mutex, held by a thread
// blocked in a write to a full stderr pipe, say) delays only the sweep, never Register() nor
// Unregister() of another client. (It was once held across the sweep: with thousands of agents
// in one process, loadgen's main thread then blocked in Register() behind one stuck agent.)
//
// Thread safety: thread-safe. Unregister() returns once the poller no longer touches the client:
// it waits for the sweep in progress, if any, to end. Locks: mu_ and wake_mu_ are leaves (no
// other lock is taken with either held; PollSend runs with neither).
#ifndef RANKSCOPE_AGENT_SRC_SEND_POLLER_H_
#define RANKSCOPE_AGENT_SRC_SEND_POLLER_H_

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace rankscope::internal {

// A report recorded while its stream is idle is sent within kMinSendPoll while reports flow and
// within kMaxSendPoll after a pause.
inline constexpr absl::Duration kMinSendPoll = absl::Milliseconds(5);
inline constexpr absl::Duration kMaxSendPoll = absl::Milliseconds(50);

class SendPoller {
 public:
  // What the poller polls: one agent's stream.
  class Client {
   public:
    // Poller thread, with no lock of the poller's held: starts a write if the stream is live
    // and idle and a report waits. Returns whether it did. Not called after Unregister()
    // returns.
    virtual bool PollSend() = 0;

   protected:
    ~Client() = default;
  };

  // The process's poller (never destroyed: its thread may outlive static destruction).
  static SendPoller& Get();

  // Never waits for a sweep: the client is polled from the next sweep on.
  void Register(Client* client) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the sweep in progress (which may poll `client`) to end. Not from PollSend.
  void Unregister(Client* client) ABSL_LOCKS_EXCLUDED(mu_);
  // Polls at once instead of at the next period. Any thread; takes only wake_mu_.
  void Wake() ABSL_LOCKS_EXCLUDED(wake_mu_);

 private:
  SendPoller() = default;
  void Run();

  Mutex mu_;
  std::vector<Client*> clients_ ABSL_GUARDED_BY(mu_);
  std::thread thread_ ABSL_GUARDED_BY(mu_);
  // Sweeps begun, and whether one is in progress (the poller thread polls outside mu_).
  uint64_t sweeps_ ABSL_GUARDED_BY(mu_) = 0;
  bool sweeping_ ABSL_GUARDED_BY(mu_) = false;
  Mutex wake_mu_;
  bool wake_ ABSL_GUARDED_BY(wake_mu_) = false;
};

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_SEND_POLLER_H_
