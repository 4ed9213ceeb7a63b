#include "send_poller.h"

#include <pthread.h>

#include <algorithm>

namespace rankscope::internal {

SendPoller& SendPoller::Get() {
  static SendPoller* const poller = new SendPoller();  // and its thread: never destroyed
  return *poller;
}

void SendPoller::Register(Client* client) {
  MutexLock lock(&mu_);
  clients_.push_back(client);
  if (!thread_.joinable()) {
    thread_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "rs-agent-poll");
      Run();
    });
  }
}

void SendPoller::Unregister(Client* client) {
  MutexLock lock(&mu_);
  clients_.erase(std::remove(clients_.begin(), clients_.end(), client), clients_.end());
  if (!sweeping_) return;
  // The sweep in progress polls a copy that may hold `client`: wait for its end (the next sweep's
  // copy no longer holds it).
  const uint64_t sweep = sweeps_;
  auto ended = [this, sweep]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !sweeping_ || sweeps_ != sweep; };
  mu_.Await(absl::Condition(&ended));
}

void SendPoller::Wake() {
  MutexLock lock(&wake_mu_);
  wake_ = true;
}

void SendPoller::Run() {
  absl::Duration poll = kMinSendPoll;
  std::vector<Client*> snapshot;  // this sweep's clients
  while (true) {
    {
      MutexLock lock(&wake_mu_);
      wake_mu_.AwaitWithTimeout(absl::Condition(&wake_), poll);
      wake_ = false;
    }
    {
      MutexLock lock(&mu_);
      snapshot.assign(clients_.begin(), clients_.end());  // reuses its capacity: no allocation
      ++sweeps_;
      sweeping_ = true;
    }
    bool started = false;
    for (Client* client : snapshot) started |= client->PollSend();
    {
      MutexLock lock(&mu_);
      sweeping_ = false;
    }
    poll = started ? kMinSendPoll : std::min(2 * poll, kMaxSendPoll);
  }
}

}  // namespace rankscope::internal
