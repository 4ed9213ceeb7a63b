#include "collector/store/store_reader_pool.h"

#include <pthread.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rankscope::collector {

StoreReaderPool::StoreReaderPool(std::vector<std::unique_ptr<SqliteStore>> readers,
                                 StoreReaderPoolOptions options)
    : options_(options), readers_(std::move(readers)) {
  threads_.reserve(readers_.size());
  for (const std::unique_ptr<SqliteStore>& reader : readers_) {
    threads_.emplace_back([this, store = reader.get()] {
      pthread_setname_np(pthread_self(), "rs-store-reader");  // for top -H and perf
      Run(store);
    });
  }
}

StoreReaderPool::~StoreReaderPool() { Stop(); }

absl::Status StoreReaderPool::Submit(Task task) {
  const size_t max_queued = std::max<size_t>(options_.max_queued, 1);
  MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError(
        "the collector is shutting down and no longer serves queries; retry once it is back");
  }
  if (queue_.size() >= max_queued) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the collector's query queue is full (", max_queued, " queries waiting for ",
        threads_.size(), " SQLite reader threads); retry with backoff, or query less often"));
  }
  queue_.push_back(std::move(task));
  return absl::OkStatus();
}

void StoreReaderPool::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  MutexLock lock(&join_mu_);
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void StoreReaderPool::Run(SqliteStore* reader) {
  while (true) {
    Task task;
    {
      MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || stopping_; };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and every queued task has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task(*reader);
  }
}

}  // namespace rankscope::collector
