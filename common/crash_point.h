// Crash points: TESTING ONLY. A named point in the code where the process SIGKILLs itself when
// the environment variable RANKSCOPE_TEST_CRASH_AT names that point, so that a test can stop the
// collector deterministically in the middle of a piece of work (a pruning transaction, a
// downsampling fold, an incremental vacuum, a schema migration) instead of killing it after a
// guessed sleep. Never set it in production: the process dies without flushing anything, exactly
// as a SIGKILL from outside would leave it.
//
// The points (grep CrashPointForTesting): store_downsample_fold, store_drop_steps,
// store_incremental_vacuum, store_schema_migration. docs/reliability.md says which test stops
// at each and what it checks.
//
// Cost when unset: one relaxed load of a cached pointer per call (the variable is read once).
//
// Thread safety: callable from any thread.
#ifndef RANKSCOPE_COMMON_CRASH_POINT_H_
#define RANKSCOPE_COMMON_CRASH_POINT_H_

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace rankscope {

inline const char* CrashPointRequested() {
  static const char* const requested = [] {
    const char* v = std::getenv("RANKSCOPE_TEST_CRASH_AT");
    return v != nullptr && v[0] != '\0' ? v : nullptr;
  }();
  return requested;
}

// SIGKILLs this process iff RANKSCOPE_TEST_CRASH_AT equals `point`, after one line on stderr
// saying so (the test's evidence that it stopped where it meant to).
inline void CrashPointForTesting(const char* point) {
  const char* requested = CrashPointRequested();
  if (requested == nullptr || std::strcmp(requested, point) != 0) return;
  std::fprintf(stderr, "rankscope: RANKSCOPE_TEST_CRASH_AT=%s: SIGKILL at this point (testing)\n",
               point);
  std::fflush(stderr);
  kill(getpid(), SIGKILL);
  pause();  // SIGKILL cannot be caught; never returns
}

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_CRASH_POINT_H_
