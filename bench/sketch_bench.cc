// Count-sketch throughput beside the memory-bandwidth limit, in one run.
//
// For each dtype, a buffer much larger than the last-level cache is filled once; the bench then
// alternates, `reps` times, a plain streaming read of the whole buffer (a vectorized sum of its
// 64-bit words: the most a kernel that reads every byte once can hope for) with one
// CountSketch::Add over the same bytes, through each kernel path the CPU supports. It prints
// input GB/s (1 GB = 1e9 bytes), best and median over the reps, and the ratio sketch / stream of
// the best times. One-thread times are the CPU time of the benchmark thread, so that on a shared
// machine the time it spends descheduled is not counted against either side.
//
// Then, for each thread count of --threads, the same comparison on T threads: a streaming read
// with T threads (each its own contiguous slice) against StripedSketch (rankscope/
// striped_sketch.h) with T threads over the whole buffer, both timed by the wall clock; and the
// replica fingerprint kernel (rankscope/fingerprint.h, FoldFingerprint) against the one-thread
// streaming read. The first lines name the machine (CPU model, cores this process may use, the
// one-thread streaming read), so figures from different machines can be compared. Results and
// the command line go to docs/PERFORMANCE.md "## Sketch kernel".
//
// Usage: sketch_bench [--mib=1024] [--reps=5] [--dims=1024,1000]
// [--isa=all|auto|scalar|avx2|avx512] [--threads=1,2]
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/sketch_encoding.h"
#include "rankscope/fingerprint.h"
#include "rankscope/sketch.h"
#include "rankscope/striped_sketch.h"

namespace {

using rankscope::CountSketch;
using rankscope::ScalarType;
using rankscope::sketch_internal::KernelIsa;

struct Options {
  size_t mib = 1024;
  int reps = 5;
  std::vector<uint32_t> dims = {1024, 1000};
  std::string isa = "all";
  std::vector<int> threads = {1, 2};
};

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name, std::string* out) {
      const std::string prefix = std::string("--") + name + "=";
      if (!absl::StartsWith(arg, prefix)) return false;
      *out = arg.substr(prefix.size());
      return true;
    };
    std::string v;
    if (value("mib", &v)) {
      if (!absl::SimpleAtoi(v, &o->mib) || o->mib == 0) return false;
    } else if (value("reps", &v)) {
      if (!absl::SimpleAtoi(v, &o->reps) || o->reps <= 0) return false;
    } else if (value("dims", &v)) {
      o->dims.clear();
      for (absl::string_view d : absl::StrSplit(v, ',')) {
        uint32_t dim;
        if (!absl::SimpleAtoi(d, &dim) || dim == 0 || dim > rankscope::kMaxSketchDim) return false;
        o->dims.push_back(dim);
      }
    } else if (value("isa", &v)) {
      o->isa = v;
    } else if (value("threads", &v)) {
      o->threads.clear();
      for (absl::string_view t : absl::StrSplit(v, ',')) {
        int threads;
        if (!absl::SimpleAtoi(t, &threads) || threads < 1 || threads > 256) return false;
        o->threads.push_back(threads);
      }
    } else {
      return false;
    }
  }
  return true;
}

// The memory-bandwidth reference: reads every byte once, vectorized for the best ISA at hand.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
__attribute__((noinline)) uint64_t
StreamSum(const uint64_t* words, size_t n) {
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) sum += words[i];
  return sum;
}

volatile uint64_t g_sink;

// CPU time of this thread: on a shared machine, time spent descheduled is not the kernel's.
double ThreadSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Wall-clock seconds (for multi-threaded runs, whose threads' CPU times overlap).
double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double WallOnce(F&& f) {
  const double start = WallSeconds();
  f();
  return WallSeconds() - start;
}

// The streaming read on `threads` threads, each summing its own contiguous slice.
void StreamSumThreads(const uint64_t* words, size_t n, int threads) {
  std::vector<std::thread> pool;
  std::vector<uint64_t> sums(threads);
  const size_t per = n / threads;
  for (int t = 0; t < threads; ++t) {
    const size_t begin = t * per, end = t + 1 == threads ? n : begin + per;
    pool.emplace_back([&, t, begin, end] { sums[t] = StreamSum(words + begin, end - begin); });
  }
  for (std::thread& t : pool) t.join();
  for (uint64_t s : sums) g_sink += s;
}

int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return CPU_COUNT(&set);
}

template <class F>
double TimeOnce(F&& f) {
  const double start = ThreadSeconds();
  f();
  return ThreadSeconds() - start;
}

struct Stats {
  double best;
  double median;
};

Stats Summarize(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  return {seconds.front(), seconds[seconds.size() / 2]};
}

// Fills the buffer with values of `type` uniform in [-1, 1) (normal numbers, no NaN).
void Fill(unsigned char* buf, size_t bytes, ScalarType type) {
  uint64_t state = 12345;
  auto next = [&state]() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<float>(static_cast<int32_t>(state >> 32)) * 0x1p-31f;
  };
  if (type == ScalarType::kFloat32) {
    for (size_t i = 0; i + 4 <= bytes; i += 4) {
      const float f = next();
      std::memcpy(buf + i, &f, 4);
    }
    return;
  }
  for (size_t i = 0; i + 2 <= bytes; i += 2) {
    const float f = next();
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint16_t h;
    if (type == ScalarType::kBFloat16) {
      h = static_cast<uint16_t>(u >> 16);  // truncation: a bfloat16 of about f
    } else {
      // |f| < 1: a float16 with the same sign, a 10-bit mantissa and exponent clamped to normal.
      const int exponent = std::max(static_cast<int>((u >> 23) & 0xff) - 127 + 15, 1);
      h = static_cast<uint16_t>(((u >> 16) & 0x8000) | (exponent << 10) | ((u >> 13) & 0x3ff));
    }
    std::memcpy(buf + i, &h, 2);
  }
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one, five;
  in >> one >> five;
  return one + " " + five;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "model name")) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Alternates `reps` times `stream()` (the read) and `kernel()`, each timed by `time`, and prints
// one row: dtype, dim, `label` (the path or the thread count), both in GB/s of `bytes` (best, and
// median in parentheses), the ratio of the best times and the kernel's coordinates per second.
template <class Time, class Stream, class Kernel>
void RaceRow(const char* dtype, const std::string& dim, const std::string& label, size_t bytes,
             size_t n, int reps, Time&& time, Stream&& stream, Kernel&& kernel) {
  std::vector<double> stream_s, kernel_s;
  for (int r = 0; r < reps; ++r) {
    stream_s.push_back(time(stream));
    kernel_s.push_back(time(kernel));
  }
  const Stats st = Summarize(stream_s);
  const Stats k = Summarize(kernel_s);
  const double gb = bytes / 1e9;
  std::printf("%-9s %5s %-7s %7.2f (%6.2f) %7.2f (%6.2f) %6.0f%% %9.2f\n", dtype, dim.c_str(),
              label.c_str(), gb / st.best, gb / st.median, gb / k.best, gb / k.median,
              100.0 * st.best / k.best, n / k.best / 1e9);
  std::fflush(stdout);
}

// Fills `buf` with values of each dtype in turn and calls f(type, n), n the buffer's elements.
template <class F>
void ForEachDtype(unsigned char* buf, size_t bytes, F&& f) {
  for (ScalarType type : {ScalarType::kFloat32, ScalarType::kBFloat16, ScalarType::kFloat16}) {
    Fill(buf, bytes, type);
    f(type, bytes / (type == ScalarType::kFloat32 ? 4 : 2));
  }
}

const char* TypeName(ScalarType t) {
  switch (t) {
    case ScalarType::kFloat32:
      return "float32";
    case ScalarType::kBFloat16:
      return "bfloat16";
    case ScalarType::kFloat16:
      return "float16";
  }
  return "?";
}

}  // namespace

// Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
// runs, the table it prints; the measured pieces are functions of their own.
int main(int argc, char** argv) {
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) {
    std::fprintf(stderr,
                 "usage: %s [--mib=1024] [--reps=5] [--dims=1024,1000] "
                 "[--isa=all|auto|scalar|avx2|avx512] [--threads=1,2]\n",
                 argv[0]);
    return 2;
  }
  std::vector<KernelIsa> isas;
  for (KernelIsa isa : {KernelIsa::kAvx512, KernelIsa::kAvx2, KernelIsa::kScalar}) {
    if (!rankscope::sketch_internal::KernelIsaSupported(isa)) continue;
    const std::string name = rankscope::sketch_internal::KernelIsaName(isa);
    if (opt.isa == "all" || opt.isa == name ||
        (opt.isa == "auto" && isa == rankscope::sketch_internal::BestKernelIsa())) {
      isas.push_back(isa);
    }
  }
  if (isas.empty()) {
    std::fprintf(stderr, "no supported kernel path matches --isa=%s\n", opt.isa.c_str());
    return 2;
  }

  const size_t bytes = opt.mib << 20;
  std::unique_ptr<uint64_t[]> storage(new uint64_t[bytes / 8]);
  auto* buf = reinterpret_cast<unsigned char*>(storage.get());

  std::printf("sketch_bench: %zu MiB buffer, %d reps (best, median in parentheses)\n", opt.mib,
              opt.reps);
  std::vector<double> machine_stream;
  Fill(buf, bytes, ScalarType::kFloat32);  // pages written: a fresh buffer reads as zero pages
  for (int r = 0; r < opt.reps; ++r) {
    machine_stream.push_back(TimeOnce([&] { g_sink = StreamSum(storage.get(), bytes / 8); }));
  }
  std::printf(
      "machine: %s; %d usable cores; one-thread streaming read %.2f GB/s; Add uses the %s "
      "path; load average %s\n",
      CpuModel().c_str(), UsableCores(), bytes / 1e9 / Summarize(machine_stream).best,
      rankscope::sketch_internal::KernelIsaName(rankscope::sketch_internal::BestKernelIsa()),
      LoadAverage().c_str());
  std::printf("one thread (CPU time of the thread):\n");
  std::printf("%-9s %5s %-7s %16s %16s %7s %9s\n", "dtype", "dim", "path", "stream GB/s",
              "sketch GB/s", "ratio", "Gcoord/s");
  ForEachDtype(buf, bytes, [&](ScalarType type, size_t n) {
    for (uint32_t dim : opt.dims) {
      for (KernelIsa isa : isas) {
        CountSketch sketch(dim, rankscope::kDefaultSketchSeed);
        RaceRow(
            TypeName(type), std::to_string(dim), rankscope::sketch_internal::KernelIsaName(isa),
            bytes, n, opt.reps, [](auto& f) { return TimeOnce(f); },
            [&] { g_sink = StreamSum(storage.get(), bytes / 8); },
            [&] {
              sketch.Reset();
              rankscope::sketch_internal::AddWithIsa(sketch, isa, buf, type, n, 0);
              g_sink = static_cast<uint64_t>(sketch.bins()[0] != 0.0);
            });
      }
    }
  });
  // On several threads: StripedSketch (what the shim uses) against a streaming read with as
  // many threads, both by the wall clock.
  std::printf("threads (wall clock; StripedSketch, Add's best path):\n");
  std::printf("%-9s %5s %-7s %16s %16s %7s %9s\n", "dtype", "dim", "threads", "stream GB/s",
              "sketch GB/s", "ratio", "Gcoord/s");
  ForEachDtype(buf, bytes, [&](ScalarType type, size_t n) {
    for (uint32_t dim : opt.dims) {
      for (int threads : opt.threads) {
        rankscope::StripedSketch sketch(dim, rankscope::kDefaultSketchSeed, threads);
        RaceRow(
            TypeName(type), std::to_string(dim), std::to_string(threads), bytes, n, opt.reps,
            [](auto& f) { return WallOnce(f); },
            [&] { StreamSumThreads(storage.get(), bytes / 8, threads); },
            [&] {
              sketch.Reset();
              sketch.Add(buf, type, n, 0);
              g_sink = static_cast<uint64_t>(sketch.sketch().bins()[0] != 0.0);
            });
      }
    }
  });
  // The replica fingerprint kernel (reduced gradient and parameters) on one thread.
  std::printf("fingerprint (one thread, CPU time; Gcoord/s: elements per second):\n");
  std::printf("%-9s %5s %-7s %16s %16s %7s %9s\n", "dtype", "dim", "path", "stream GB/s",
              "fingerprnt GB/s", "ratio", "Gcoord/s");
  ForEachDtype(buf, bytes, [&](ScalarType type, size_t n) {
    for (KernelIsa isa : isas) {  // the path of the sums of squares, as --isa says
      RaceRow(
          TypeName(type), "-", KernelIsaName(isa), bytes, n, opt.reps,
          [](auto& f) { return TimeOnce(f); },
          [&] { g_sink = StreamSum(storage.get(), bytes / 8); },
          [&] {
            rankscope::ReplicaFingerprint fp;
            rankscope::fingerprint_internal::FoldFingerprintWithIsa(
                isa, buf, static_cast<int>(type), n, 0, &fp);
            g_sink += fp.fingerprint;
          });
    }
  });
  // The agent packs each report's bins once when it sends it (common/sketch_encoding.h): O(k),
  // beside the O(n) Add above. At a 4 KiB budget: float32 k = 1024, float16 2048, int8 4096.
  std::printf("%-9s %5s %12s\n", "packing", "dim", "us/report");
  for (auto [encoding, dim] : {std::pair{rankscope::SketchEncoding::kFloat32, 1024u},
                               std::pair{rankscope::SketchEncoding::kFloat16, 2048u},
                               std::pair{rankscope::SketchEncoding::kInt8, 4096u}}) {
    std::vector<float> values(dim);
    for (uint32_t i = 0; i < dim; ++i) {
      values[i] = static_cast<float>((i * 2654435761u) % 2001) - 1000;
    }
    constexpr int kPacks = 2000;
    std::vector<double> times;
    for (int r = 0; r < opt.reps; ++r) {
      times.push_back(TimeOnce([&] {
        for (int i = 0; i < kPacks; ++i) {
          rankscope::PackedSketch p = rankscope::PackSketch(values, encoding);
          g_sink += static_cast<uint64_t>(p.bins.size());
        }
      }));
    }
    std::printf("%-9s %5u %12.2f\n", rankscope::SketchEncodingName(encoding), dim,
                Summarize(times).best / kPacks * 1e6);
  }
  std::printf("load average at the end: %s (times are CPU time of this thread)\n",
              LoadAverage().c_str());
  return 0;
}
