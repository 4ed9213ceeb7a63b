// SendPoller: the process's one poller thread, which starts a write on every agent stream that
// is idle while a report waits in its ring (AgentImpl::PollSend, agent_impl.h).
//
// Record() therefore wakes no thread, and a process with many agents (loadgen, tests) pays one
// wake-up per poll, not one per agent or per report. The poller polls every kMinSendPoll while
// writes are being started and backs off to kMaxSendPoll when none is; Wake() polls at once (a
// ring got half full). Its thread ("rs-agent-poll") starts with the first Register() and lives
// as long as the process.
//
// Thread safety: thread-safe. Unregister() returns once the poller no longer touches the client.
// Lock order: mu_ (held through a sweep, so across each client's PollSend) before any agent's
// mutex; wake_mu_ is a leaf.
#ifndef RANKSCOPE_AGENT_SRC_SEND_POLLER_H_
#define RANKSCOPE_AGENT_SRC_SEND_POLLER_H_

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
    // Poller thread, with the poller's mu_ held: starts a write if the stream is live and idle
    // and a report waits. Returns whether it did.
    virtual bool PollSend() = 0;

   protected:
    ~Client() = default;
  };

  // The process's poller (never destroyed: its thread may outlive static destruction).
  static SendPoller& Get();

  void Register(Client* client) ABSL_LOCKS_EXCLUDED(mu_);
  void Unregister(Client* client) ABSL_LOCKS_EXCLUDED(mu_);
  // Polls at once instead of at the next period. Any thread; takes only wake_mu_.
  void Wake() ABSL_LOCKS_EXCLUDED(wake_mu_);

 private:
  SendPoller() = default;
  void Run();

  Mutex mu_;
  std::vector<Client*> clients_ ABSL_GUARDED_BY(mu_);
  std::thread thread_ ABSL_GUARDED_BY(mu_);
  Mutex wake_mu_;
  bool wake_ ABSL_GUARDED_BY(wake_mu_) = false;
};

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_SEND_POLLER_H_
