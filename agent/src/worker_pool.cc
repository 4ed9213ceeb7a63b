#include "worker_pool.h"

#include <algorithm>

namespace rankscope {

WorkerPool::WorkerPool(int threads) {
  const int workers = std::max(threads, 1) - 1;
  workers_.reserve(workers);
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

WorkerPool::~WorkerPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void WorkerPool::Run(int tasks, absl::FunctionRef<void(int)> fn) {
  if (tasks <= 0) return;
  if (workers_.empty()) {
    for (int i = 0; i < tasks; ++i) fn(i);
    return;
  }
  {
    MutexLock lock(&mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_ = 0;
    done_ = 0;
  }
  Drain();
  MutexLock lock(&mu_);
  auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ == tasks_; };
  mu_.Await(absl::Condition(&all_done));
  fn_ = nullptr;  // `fn` dies with this call; no worker can claim from this batch any more
  tasks_ = 0;
  next_ = 0;
}

void WorkerPool::Drain() {
  for (;;) {
    absl::FunctionRef<void(int)>* fn;
    int task;
    {
      MutexLock lock(&mu_);
      if (fn_ == nullptr || next_ >= tasks_) return;
      fn = fn_;
      task = next_++;
    }
    (*fn)(task);
    MutexLock lock(&mu_);
    ++done_;
  }
}

void WorkerPool::WorkerLoop() {
  for (;;) {
    {
      MutexLock lock(&mu_);
      auto work_or_stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (fn_ != nullptr && next_ < tasks_);
      };
      mu_.Await(absl::Condition(&work_or_stop));
      if (stop_) return;
    }
    Drain();
  }
}

}  // namespace rankscope
