// ComputeStepStatistics and the per-step rank diagnostics at the collector's scale (W ranks,
// k-float sketches), with Google Benchmark. Each rank's sketch is its own heap buffer, as the
// pipeline's pooled report buffers are.
//
//   BM_StepStatistics/W/k/steps/scattered: ComputeStepStatistics. `steps` distinct steps are cycled
//   through, so with steps = 8 (32 MiB at W = k = 1024) every call reads sketches that are not in
//   L1/L2, as on the step thread, where they were written by the gRPC threads milliseconds
//   before; steps = 1 keeps one 4 MiB step as warm as this core's L2 allows.
//   BM_StepStatisticsIsa/W/k/steps/0/isa: the same with the kernels of one instruction set
//   (0 baseline, 1 AVX2, 2 AVX-512; skipped where the CPU lacks it).
//   BM_StepStatisticsEncoding/W/bytes/8/0/encoding: the same at a budget of `bytes` per rank-step
//   in each sketch encoding (0 float32, 1 float16, 2 int8; common/sketch_encoding.h), so
//   k = bytes / 4, / 2 or / 1: the kernel reads the packed bins in place.
//   BM_JoinerMemory/W/open_steps/bytes/encoding: heap bytes per rank-step the joiner holds for open
//   steps whose sketches take `bytes` in each encoding (so k = bytes / bytes-per-bin).
//   BM_OutlierScores/W: ComputeOutlierScores (three medians and MADs) over W ranks.
//   BM_AggregationCheck/W/k/encoding/fault: CheckAggregation (aggregation_integrity.h) of one
//   step whose reduced sketch is the mean of the W local sketches (fault 0: the clean step's
//   O(W k) comparison) or misses rank 0's contribution (fault 1: flagged, plus the regression).
#include <malloc.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "collector/analysis/aggregation_integrity.h"
#include "collector/analysis/rank_diagnostics.h"
#include "collector/analysis/step_stats.h"
#include "collector/pipeline/step_joiner.h"
#include "common/sketch_encoding.h"

namespace rankscope::collector {
namespace {

struct Step {
  std::vector<std::vector<float>> sketches;
  std::vector<PackedSketch> packed;  // float16 / int8 steps only
  std::vector<RankSample> samples;
};

Step MakeStep(size_t w, size_t k, uint64_t seed,
              SketchEncoding encoding = SketchEncoding::kFloat32) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> common(k);
  for (float& c : common) c = normal(rng);
  Step step;
  step.sketches.resize(w);
  for (size_t r = 0; r < w; ++r) {
    step.sketches[r].resize(k);
    for (size_t i = 0; i < k; ++i) step.sketches[r][i] = 0.5f * common[i] + normal(rng);
    RankSample s;
    s.rank = static_cast<uint32_t>(r);
    s.loss = 2.3 + 0.1 * normal(rng);
    s.grad_norm = 1.0 + 0.1 * normal(rng);
    step.samples.push_back(s);
  }
  for (size_t r = 0; r < w; ++r) step.samples[r].sketch = step.sketches[r];
  if (encoding != SketchEncoding::kFloat32) {
    for (size_t r = 0; r < w; ++r) {
      step.packed.push_back(PackSketch(step.sketches[r], encoding));
      step.sketches[r] = std::vector<float>();
    }
    for (size_t r = 0; r < w; ++r) {
      step.samples[r].sketch =
          SketchView(encoding, step.packed[r].bins.data(), k, step.packed[r].scale);
    }
  }
  return step;
}

using step_stats_internal::KernelIsa;

void RunStepStatistics(benchmark::State& state, std::optional<KernelIsa> isa,
                       SketchEncoding encoding = SketchEncoding::kFloat32,
                       size_t bytes_per_bin = 1) {
  if (isa && !step_stats_internal::KernelIsaSupported(*isa)) {
    state.SkipWithError("instruction set not supported by this CPU");
    return;
  }
  const size_t w = static_cast<size_t>(state.range(0));
  // range(1) is k, or the bytes per rank-step for a BM_StepStatisticsEncoding run.
  const size_t k = static_cast<size_t>(state.range(1)) / bytes_per_bin;
  const size_t n_steps = static_cast<size_t>(state.range(2));
  std::vector<Step> steps;
  for (size_t i = 0; i < n_steps; ++i) steps.push_back(MakeStep(w, k, 1000 + i, encoding));
  if (state.range(3) != 0) {
    // Scattered: each step's sketches are drawn at random from all steps' buffers, as the
    // pipeline's pooled buffers are spread over its heap.
    std::vector<SketchView> all;
    for (const Step& step : steps) {
      for (const RankSample& sample : step.samples) all.push_back(sample.sketch);
    }
    std::shuffle(all.begin(), all.end(), std::mt19937_64(99));
    size_t at = 0;
    for (Step& step : steps) {
      for (RankSample& sample : step.samples) sample.sketch = all[at++];
    }
  }
  const bool rewritten = state.range(3) == 2;
  std::vector<char> source(k * sizeof(float), 1);
  size_t next = 0;
  for (auto _ : state) {
    if (rewritten) {
      // The step's sketches written by a thread on another CPU just before, as the gRPC threads
      // write reports' sketches in the collector.
      state.PauseTiming();
      const int here = sched_getcpu();
      std::thread writer([&] {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(here == 0 ? 1 : 0, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
        for (const RankSample& sample : steps[next].samples) {
          std::memcpy(const_cast<void*>(sample.sketch.data), source.data(),
                      sample.sketch.byte_size());
        }
      });
      writer.join();
      state.ResumeTiming();
    }
    StepStatistics stats =
        isa ? step_stats_internal::ComputeStepStatisticsWithIsa(steps[next].samples, *isa)
            : ComputeStepStatistics(steps[next].samples);
    benchmark::DoNotOptimize(stats.grad_cosine_mean);
    benchmark::DoNotOptimize(stats.per_rank.data());
    next = (next + 1) % n_steps;
  }
  state.counters["floats/s"] = benchmark::Counter(static_cast<double>(w * k) * state.iterations(),
                                                  benchmark::Counter::kIsRate);
}

void BM_StepStatistics(benchmark::State& state) { RunStepStatistics(state, std::nullopt); }
BENCHMARK(BM_StepStatistics)
    ->Args({1024, 1024, 1, 0})
    ->Args({1024, 1024, 8, 0})
    ->Args({1024, 1024, 8, 1})
    ->Args({1024, 1024, 8, 2})
    ->Args({64, 1024, 8, 0})
    ->Args({1024, 1000, 8, 0})
    ->Unit(benchmark::kMicrosecond);

void BM_StepStatisticsEncoding(benchmark::State& state) {
  const auto encoding = static_cast<SketchEncoding>(state.range(4));
  RunStepStatistics(state, std::nullopt, encoding, SketchBytesPerBin(encoding));
  state.counters["bins/s"] = benchmark::Counter(
      static_cast<double>(state.range(0) * state.range(1) / SketchBytesPerBin(encoding)) *
          state.iterations(),
      benchmark::Counter::kIsRate);
  state.counters["bytes/s"] =
      benchmark::Counter(static_cast<double>(state.range(0) * state.range(1)) * state.iterations(),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_StepStatisticsEncoding)
    ->ArgsProduct({{1024}, {4096}, {8}, {0}, {0, 1, 2}})
    ->Unit(benchmark::kMicrosecond);

// Collector memory per open rank-step in the joiner, per encoding: W = range(0) ranks' reports
// of range(1) open steps with sketches of range(2) bytes in encoding range(3), added to a
// StepJoiner as the pipeline adds them (RankReport with its sketch kept as received); the heap
// growth (mallinfo2: bytes in use) divided by the rank-steps held.
void BM_JoinerMemory(benchmark::State& state) {
  const size_t w = static_cast<size_t>(state.range(0));
  const size_t open = static_cast<size_t>(state.range(1));
  const auto encoding = static_cast<SketchEncoding>(state.range(3));
  const size_t k = static_cast<size_t>(state.range(2)) / SketchBytesPerBin(encoding);
  const std::vector<float> values = MakeStep(1, k, 3).sketches[0];
  const PackedSketch packed = PackSketch(values, encoding);
  double per_rank_step = 0.0;
  for (auto _ : state) {
    JoinerOptions options;
    options.max_open_steps_per_job = open;
    options.step_timeout = absl::Hours(1);
    StepJoiner joiner(options);
    const size_t before = mallinfo2().uordblks;
    if (!joiner.RegisterJob("bench", static_cast<uint32_t>(w + 1)).ok()) std::abort();
    std::vector<JoinedStep> closed;
    for (size_t step = 0; step < open; ++step) {
      for (size_t r = 0; r < w; ++r) {  // rank w never reports: every step stays open
        RankReport report;
        report.rank = static_cast<uint32_t>(r);
        report.step = step;
        report.sketch_encoding = encoding;
        if (encoding == SketchEncoding::kFloat32) {
          report.sketch = values;
        } else {
          report.sketch_packed = packed.bins;
          report.sketch_scale = packed.scale;
        }
        joiner.Add("bench", report, absl::UnixEpoch(), &closed);
      }
    }
    per_rank_step = static_cast<double>(mallinfo2().uordblks - before) / (w * open);
    benchmark::DoNotOptimize(joiner.open_steps_total());
  }
  state.counters["bytes/rank-step"] = per_rank_step;
  state.counters["k"] = static_cast<double>(k);
}
BENCHMARK(BM_JoinerMemory)
    ->Args({256, 64, 4096, 0})
    ->Args({256, 64, 4096, 1})
    ->Args({256, 64, 4096, 2})
    ->Args({256, 64, 16384, 0})  // float32 at int8's k = 4096
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

void BM_OutlierScores(benchmark::State& state) {
  const size_t w = static_cast<size_t>(state.range(0));
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<RankSignals> signals(w);
  for (size_t r = 0; r < w; ++r) {
    signals[r] = {static_cast<uint32_t>(r), 2.3 + 0.1 * normal(rng), 1.0 + 0.1 * normal(rng),
                  0.2 + 0.01 * normal(rng)};
  }
  for (auto _ : state) {
    std::vector<OutlierScore> scores = ComputeOutlierScores(signals);
    benchmark::DoNotOptimize(scores.data());
  }
}
void BM_StepStatisticsIsa(benchmark::State& state) {
  RunStepStatistics(state, static_cast<KernelIsa>(state.range(4)));
}
BENCHMARK(BM_StepStatisticsIsa)
    ->ArgsProduct({{1024}, {1024}, {8}, {0}, {0, 1, 2}})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_OutlierScores)->Arg(1024)->Unit(benchmark::kMicrosecond);

void BM_AggregationCheck(benchmark::State& state) {
  const size_t w = static_cast<size_t>(state.range(0));
  const size_t k = static_cast<size_t>(state.range(1));
  const auto encoding = static_cast<SketchEncoding>(state.range(2));
  const Step step = MakeStep(w, k, 7, encoding);
  std::vector<IntegrityInput> locals;
  for (const RankSample& s : step.samples) locals.push_back({s.rank, s.sketch, s.grad_norm});
  std::vector<double> mean(k, 0.0);
  for (size_t r = state.range(3) != 0 ? 1 : 0; r < w; ++r) {
    for (size_t b = 0; b < k; ++b) mean[b] += step.samples[r].sketch.Value(b);
  }
  std::vector<float> reduced(k);
  for (size_t b = 0; b < k; ++b) reduced[b] = static_cast<float>(mean[b] / static_cast<double>(w));
  for (auto _ : state) {
    AggregationVerdict v =
        CheckAggregation(locals, reduced, 0, static_cast<uint32_t>(w), /*mantissa_bits=*/24);
    benchmark::DoNotOptimize(v.error);
  }
}
// 1,024 ranks: the clean step (every encoding) and a flagged one (the regression, W <= 256).
BENCHMARK(BM_AggregationCheck)
    ->ArgsProduct({{1024}, {1024}, {0, 1, 2}, {0}})
    ->Args({256, 1024, 0, 1})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace rankscope::collector

BENCHMARK_MAIN();
