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
}

void SendPoller::Wake() {
  MutexLock lock(&wake_mu_);
  wake_ = true;
}

void SendPoller::Run() {
  absl::Duration poll = kMinSendPoll;
  while (true) {
    {
      MutexLock lock(&wake_mu_);
      wake_mu_.AwaitWithTimeout(absl::Condition(&wake_), poll);
      wake_ = false;
    }
    bool started = false;
    {
      MutexLock lock(&mu_);
      for (Client* client : clients_) started |= client->PollSend();
    }
    poll = started ? kMinSendPoll : std::min(2 * poll, kMaxSendPoll);
  }
}

}  // namespace rankscope::internal
