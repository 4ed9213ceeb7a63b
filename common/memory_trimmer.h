// MemoryTrimmer: gives the memory that glibc's malloc keeps after a burst back to the kernel.
//
// glibc returns freed memory to the kernel only from the top of each heap (and whole mmap'd
// chunks); pages freed in the middle of a heap stay in the process. After a burst that is then
// freed (thousands of connections that gRPC buffered for, half-open ones closed by keepalive, the
// streams of a job that ended), the collector's RSS would stay at the burst's peak for good,
// although the memory is free inside malloc: docs/reliability.md "Network faults". The trimmer
// looks every `interval` at how much malloc holds free (mallinfo2) and, above `min_free_bytes`,
// calls malloc_trim(0), which gives every whole free page of every arena back (madvise), so RSS
// follows what is in use. One check costs a walk of malloc's free lists (microseconds to a few
// milliseconds, each arena locked in turn): nothing on the ingest path waits for it longer.
//
// Thread safety: thread-safe. The destructor stops the thread.
#ifndef RANKSCOPE_COMMON_MEMORY_TRIMMER_H_
#define RANKSCOPE_COMMON_MEMORY_TRIMMER_H_

#include <cstddef>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace rankscope {

class MemoryTrimmer {
 public:
  struct Options {
    absl::Duration interval = absl::Seconds(10);  // <= 0: no thread (TrimIfAbove still works)
    size_t min_free_bytes = size_t{16} << 20;     // below this much free in malloc, no trim
  };

  // What one check found and did.
  struct Trim {
    size_t free_bytes = 0;   // held free by malloc at the check (mallinfo2().fordblks)
    bool trimmed = false;    // malloc_trim(0) was called
    int64_t rss_before = 0;  // this process's resident bytes before, and after the trim
    int64_t rss_after = 0;   // (both 0 when not trimmed; -1 when they could not be read)
  };

  explicit MemoryTrimmer(Options options);
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  // One check, on the calling thread: malloc_trim(0) if malloc holds more than min_free_bytes
  // free. The thread calls it every interval.
  static Trim TrimIfAbove(size_t min_free_bytes);

  // This process's resident set in bytes (/proc/self/statm), or -1 if it cannot be read.
  static int64_t ResidentBytes();

 private:
  void Loop();

  const Options options_;
  Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // written only by the constructor
};

}  // namespace rankscope

#endif  // RANKSCOPE_COMMON_MEMORY_TRIMMER_H_
