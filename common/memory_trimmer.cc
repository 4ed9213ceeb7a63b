#include "common/memory_trimmer.h"

#include <malloc.h>
#include <pthread.h>
#include <unistd.h>

#include <cstdio>

namespace rankscope {

MemoryTrimmer::MemoryTrimmer(Options options) : options_(options) {
  if (options_.interval > absl::ZeroDuration()) thread_ = std::thread([this] { Loop(); });
}

MemoryTrimmer::~MemoryTrimmer() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

int64_t MemoryTrimmer::ResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long long size = 0, resident = 0;
  const bool read = std::fscanf(f, "%lld %lld", &size, &resident) == 2;
  std::fclose(f);
  return read ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : -1;
}

MemoryTrimmer::Trim MemoryTrimmer::TrimIfAbove(size_t min_free_bytes) {
  Trim trim;
  trim.free_bytes = mallinfo2().fordblks;
  if (trim.free_bytes <= min_free_bytes) return trim;
  trim.trimmed = true;
  trim.rss_before = ResidentBytes();
  malloc_trim(0);
  trim.rss_after = ResidentBytes();
  return trim;
}

void MemoryTrimmer::Loop() {
  pthread_setname_np(pthread_self(), "rs-mem-trim");
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
  while (true) {
    {
      MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.interval)) return;
    }
    const Trim trim = TrimIfAbove(options_.min_free_bytes);
    // Said when it matters (a burst's memory came back), not every interval.
    // (Both readings known: /proc/self/statm cannot be opened when descriptors run out.)
    if (trim.trimmed && trim.rss_before >= 0 && trim.rss_after >= 0 &&
        trim.rss_before - trim.rss_after >= int64_t{16} << 20) {
      std::fprintf(stderr,
                   "rankscope: gave %.1f MiB of freed memory back to the system (malloc held "
                   "%.1f MiB free; RSS %.1f -> %.1f MiB)\n",
                   (trim.rss_before - trim.rss_after) / 1048576.0, trim.free_bytes / 1048576.0,
                   trim.rss_before / 1048576.0, trim.rss_after / 1048576.0);
    }
  }
}

}  // namespace rankscope
