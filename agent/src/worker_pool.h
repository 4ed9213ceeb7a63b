// A fixed set of threads that run the tasks of one batch at a time, the calling thread among
// them (used by StripedSketch to sketch one gradient bucket on several cores).
//
// Run(tasks, fn) calls fn(i) exactly once for each i in [0, tasks), each call on one of the
// pool's threads or on the caller's, and returns when every call has returned: what the calls
// wrote is visible to the caller after Run. Which thread runs which task is not fixed, so fn's
// result must not depend on it. A pool of 1 thread runs every task on the caller's thread and
// starts no thread.
//
// Thread safety: Run is called by one thread at a time (it is not reentrant: fn must not call
// Run on the same pool). The destructor joins the workers; no Run may be in progress.
#ifndef RANKSCOPE_AGENT_WORKER_POOL_H_
#define RANKSCOPE_AGENT_WORKER_POOL_H_

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "common/mutex.h"

namespace rankscope {

class WorkerPool {
 public:
  // threads >= 1 (smaller values count as 1): threads - 1 workers plus the caller.
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void Run(int tasks, absl::FunctionRef<void(int)> fn);

 private:
  // Runs tasks of the current batch until none is left to claim.
  void Drain();
  void WorkerLoop();

  Mutex mu_;
  absl::FunctionRef<void(int)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;  // the batch's, or null
  int tasks_ ABSL_GUARDED_BY(mu_) = 0;                               // tasks in the batch
  int next_ ABSL_GUARDED_BY(mu_) = 0;                                // the next task to claim
  int done_ ABSL_GUARDED_BY(mu_) = 0;                                // tasks returned
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;  // written only by the constructor
};

}  // namespace rankscope

#endif  // RANKSCOPE_AGENT_WORKER_POOL_H_
