// Happens-before annotations for ThreadSanitizer, no-ops in every other build.
//
// Debian's libabsl and libgrpc are not built with -fsanitize=thread. TSan sees no synchronization
// inside them (absl::Mutex waits with futex syscalls and synchronizes with atomics in code TSan
// never instrumented), so without help every field guarded by an absl::Mutex, and every object
// handed to gRPC and back, looks racy. These macros tell TSan about the ordering those libraries
// guarantee:
//   RANKSCOPE_TSAN_RELEASE(p): everything this thread did so far happens before ...
//   RANKSCOPE_TSAN_ACQUIRE(p): ... everything this thread does from now on, once the acquire
//                              follows the release in real time (same address p).
// Users: rankscope::Mutex (common/mutex.h), and the gRPC reactors, which release on the reactor
// before each Start*/Finish call and acquire on it at the top of each reaction, the ordering
// gRPC's callback API documents ("reactions for a given operation are invoked after the
// operation was started").
#ifndef RANKSCOPE_COMMON_TSAN_H_
#define RANKSCOPE_COMMON_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#define RANKSCOPE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define RANKSCOPE_TSAN 1
#endif
#endif

#ifdef RANKSCOPE_TSAN
extern "C" {
void __tsan_acquire(void* addr);  // the TSan runtime's, as in <sanitizer/tsan_interface.h>
void __tsan_release(void* addr);
}
#define RANKSCOPE_TSAN_ACQUIRE(p) __tsan_acquire(const_cast<void*>(static_cast<const void*>(p)))
#define RANKSCOPE_TSAN_RELEASE(p) __tsan_release(const_cast<void*>(static_cast<const void*>(p)))
#else
#define RANKSCOPE_TSAN_ACQUIRE(p) static_cast<void>(0)
#define RANKSCOPE_TSAN_RELEASE(p) static_cast<void>(0)
#endif

#endif  // RANKSCOPE_COMMON_TSAN_H_
