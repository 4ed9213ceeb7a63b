// rankscope::Mutex: absl::Mutex as ThreadSanitizer can see it.
//
// Why a wrapper: TSan cannot see absl::Mutex's synchronization in Debian's uninstrumented libabsl
// (common/tsan.h), so every ABSL_GUARDED_BY field would be reported as racy. Annotating each
// Lock/Unlock/Await call site would be error-prone (about 80 of them, and a forgotten one is a
// false report or, worse, a hidden real one); a wrapper annotates all of them in one place. It is
// the same lock (an absl::Mutex, same cost: the annotations compile to nothing outside TSan
// builds), carries the same thread-safety attributes, so ABSL_GUARDED_BY(mu_) and clang's
// -Wthread-safety keep working unchanged, and offers only what rankscope uses: exclusive locking
// and the Await family (absl::Condition), which release the lock while waiting.
//
// Thread safety: as absl::Mutex.
#ifndef RANKSCOPE_COMMON_MUTEX_H_
#define RANKSCOPE_COMMON_MUTEX_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tsan.h"

namespace rankscope {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    mu_.Lock();
    RANKSCOPE_TSAN_ACQUIRE(this);
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    RANKSCOPE_TSAN_RELEASE(this);
    mu_.Unlock();
  }
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() { mu_.AssertHeld(); }

  // As absl::Mutex's: the lock is released while waiting, so what this thread did is released
  // before and what the others did acquired after. absl evaluates `cond` with the lock held but
  // inside the call, on this thread or on one unlocking the mutex: each evaluation acquires and
  // releases too (WithLockHeld).
  void Await(const absl::Condition& cond) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    const Annotated annotated{this, &cond};
    RANKSCOPE_TSAN_RELEASE(this);
    mu_.Await(annotated.condition());
    RANKSCOPE_TSAN_ACQUIRE(this);
  }
  bool AwaitWithTimeout(const absl::Condition& cond, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    const Annotated annotated{this, &cond};
    RANKSCOPE_TSAN_RELEASE(this);
    const bool met = mu_.AwaitWithTimeout(annotated.condition(), timeout);
    RANKSCOPE_TSAN_ACQUIRE(this);
    return met;
  }
  bool AwaitWithDeadline(const absl::Condition& cond, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    const Annotated annotated{this, &cond};
    RANKSCOPE_TSAN_RELEASE(this);
    const bool met = mu_.AwaitWithDeadline(annotated.condition(), deadline);
    RANKSCOPE_TSAN_ACQUIRE(this);
    return met;
  }

 private:
  // A condition evaluated between an acquire and a release of the mutex, under TSan; the
  // condition itself otherwise.
  struct Annotated {
    const Mutex* mu;
    const absl::Condition* cond;
#ifdef RANKSCOPE_TSAN
    absl::Condition condition() const { return absl::Condition(&WithLockHeld, this); }
    static bool WithLockHeld(const Annotated* a) {
      RANKSCOPE_TSAN_ACQUIRE(a->mu);
      const bool holds = a->cond->Eval();
      RANKSCOPE_TSAN_RELEASE(a->mu);
      return holds;
    }
#else
    const absl::Condition& condition() const { return *cond; }
#endif
  };

  absl::Mutex mu_;
};

// Holds a Mutex for its scope, as absl::MutexLock.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }

 private:
  Mutex* const mu_;
};

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_MUTEX_H_
