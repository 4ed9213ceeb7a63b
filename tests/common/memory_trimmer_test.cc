// MemoryTrimmer against glibc's real malloc: memory freed in the middle of the heap is resident
// until a trim gives it back.
#include "common/memory_trimmer.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace rankscope {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kGlibcMalloc = false;  // the sanitizer's allocator replaces malloc
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kGlibcMalloc = false;
#else
constexpr bool kGlibcMalloc = true;
#endif
#else
constexpr bool kGlibcMalloc = true;
#endif

// A burst as the collector's connections make one: 64 MiB in 16 KiB blocks (below malloc's mmap
// threshold, so on the heap), touched, then freed while a block allocated after them stays, so
// that the freed memory is not at the heap's top and free() alone gives none of it back.
TEST(MemoryTrimmerTest, GivesABurstFreedInTheMiddleOfTheHeapBack) {
  if (!kGlibcMalloc) GTEST_SKIP() << "a sanitizer's allocator, not glibc's malloc";
  constexpr size_t kBlock = 16 << 10;
  constexpr size_t kBlocks = 4096;  // 64 MiB
  std::vector<void*> blocks(kBlocks);
  for (void*& block : blocks) {
    block = std::malloc(kBlock);
    std::memset(block, 1, kBlock);
  }
  void* pin = std::malloc(kBlock);
  std::memset(pin, 1, kBlock);
  for (void* block : blocks) std::free(block);

  const int64_t resident = MemoryTrimmer::ResidentBytes();
  ASSERT_GT(resident, int64_t{kBlock * kBlocks});  // the burst is still resident
  const MemoryTrimmer::Trim trim = MemoryTrimmer::TrimIfAbove(size_t{32} << 20);
  EXPECT_GE(trim.free_bytes, kBlock * kBlocks);
  ASSERT_TRUE(trim.trimmed);
  ASSERT_GT(trim.rss_after, 0);  // both readings made
  // At least 3/4 of the burst went back (a page at each freed run's edges may stay).
  EXPECT_LE(trim.rss_after, trim.rss_before - int64_t{kBlock * kBlocks * 3 / 4})
      << "RSS " << trim.rss_before << " -> " << trim.rss_after;
  std::free(pin);
}

TEST(MemoryTrimmerTest, LeavesMallocAloneBelowTheThreshold) {
  const MemoryTrimmer::Trim trim = MemoryTrimmer::TrimIfAbove(std::numeric_limits<size_t>::max());
  EXPECT_FALSE(trim.trimmed);
  EXPECT_EQ(trim.rss_before, 0);
}

}  // namespace
}  // namespace rankscope
