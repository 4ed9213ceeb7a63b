// StoreReaderPool: the threads that read SQLite for the Query service, so that no read runs on
// gRPC's callback threads.
//
// Each thread owns one read-only WAL connection (a SqliteStore opened with
// StoreOptions::read_only): reads run beside the StoreWriter's commits and beside each other, with
// no lock around SQLite. A caller hands over a task, which later runs on one of the threads with
// that thread's connection. Tasks wait in one FIFO queue of at most `max_queued` tasks (tasks
// running are not counted): Submit beyond it is refused at once with ResourceExhausted, so a
// burst of queries cannot pile up unbounded memory or latency, and Submit never blocks on SQLite.
//
// Shutdown: Stop refuses new tasks (Unavailable), runs every task already queued (a queued Query
// call is always finished), and joins the threads.
//
// Thread safety: Submit and Stop are thread-safe; Submit is cheap enough for a gRPC reaction
// (one short critical section on mu_, no I/O). A task runs on a pool thread with exclusive use
// of that thread's SqliteStore; it must not wait for another task of the pool, nor call Stop.
// Lock order: join_mu_ before mu_; mu_ is never held while a task runs.
#ifndef RANKSCOPE_COLLECTOR_STORE_STORE_READER_POOL_H_
#define RANKSCOPE_COLLECTOR_STORE_STORE_READER_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "collector/store/sqlite_store.h"
#include "common/mutex.h"

namespace rankscope::collector {

struct StoreReaderPoolOptions {
  // Tasks that may wait for a free thread; Submit beyond it fails with ResourceExhausted. At
  // least 1.
  size_t max_queued = 256;
};

class StoreReaderPool {
 public:
  using Task = std::function<void(SqliteStore& reader)>;

  // Starts one thread per connection in `readers` (each should be opened read-only; at least one).
  StoreReaderPool(std::vector<std::unique_ptr<SqliteStore>> readers,
                  StoreReaderPoolOptions options = {});
  ~StoreReaderPool();  // Stop()
  StoreReaderPool(const StoreReaderPool&) = delete;
  StoreReaderPool& operator=(const StoreReaderPool&) = delete;

  // Queues `task`; on error it is not run. Errors (both with a message a person can act on):
  //   ResourceExhausted: max_queued tasks already wait; transient, retry with backoff.
  //   Unavailable: the pool is stopped (the collector is shutting down); retry elsewhere/later.
  absl::Status Submit(Task task);

  // Refuses new tasks, runs every task already queued, then joins the threads. Idempotent.
  void Stop();

  size_t threads() const { return threads_.size(); }

 private:
  void Run(SqliteStore* reader);

  const StoreReaderPoolOptions options_;
  const std::vector<std::unique_ptr<SqliteStore>> readers_;  // readers_[i]: threads_[i] only

  Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  Mutex join_mu_;                     // serializes Stop's joins
  std::vector<std::thread> threads_;  // written only by the constructor
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_STORE_STORE_READER_POOL_H_
