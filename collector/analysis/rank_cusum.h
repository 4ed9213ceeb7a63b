// Sequential change detection per rank (issue 18): a one-sided CUSUM over rank scores of the
// per-rank signals the collector already has. Pure: no threads, no clock.
//
// Why sequential. The per-step outlier rule (rank_diagnostics.h: score above 6 on 3 consecutive
// steps) names large faults in a few steps but cannot see a shift that is small on every step
// and never goes away (10 % label noise on one rank, a 40 ms straggler): such a rank is only
// *more often* the worst. A CUSUM accumulates that evidence.
//
// Input: rank scores, not z-scores. For one signal of one step with n finite values (ranks that
// reported it), a rank at 0-based ascending position p (ties share their mean position) gets the
// centred uniform score
//     u = sqrt(3) * ((2p + 1) / n - 1),          in (-sqrt(3), sqrt(3)),
// mean 0 and variance (n^2 - 1) / n^2 ~ 1 when the ranks are exchangeable (a healthy job),
// whatever the signal's distribution. The median/MAD z of rank_diagnostics.h ranks the ranks the
// same way (it is monotone in the value) but its tails at small W are heavy (4 % of healthy
// rank-steps above 6 at W = 4): a CUSUM fed with it raises a false alarm every ~660 rank-steps at
// W = 4 (k = 0.5, h = 8, clipped at 3). Rank scores make the false-alarm rate distribution-free
// and nearly independent of W, and bound every increment, so a rank that is *always* the worst
// is named after a fixed number of steps: ceil(h / (u_max - k)), u_max = sqrt(3) (n - 1) / n
// (slow, W = 4: 11 steps; W = 8: 9; W = 10,000: 13).
//
// Two statistics per rank:
//   data drift  three CUSUMs, one per signal j in (loss, grad_norm, -consensus_cosine): a higher
//               loss, a larger local gradient, a gradient that agrees less with the others'.
//               x_j = u_j / sd_m, sd_m = sqrt(m^2 - 1) / m the *exact* standard deviation of a
//               centred uniform score among the m ranks with a finite value of that signal (a
//               signal known for fewer than 2 ranks, or NaN for the rank, contributes 0, so a
//               missing signal only slows detection). Nothing is estimated, so there is no
//               estimator variance and no warm-up. The rank is named while any of its three is
//               above h. Why three and not their sum (issue 36, item 4): the sum's variance
//               depends on how the signals correlate in each job and had to be estimated (a pooled
//               sigma with a prior); and a data fault rarely moves all three alike. 10 % label
//               noise, measured on the benchmark's recorded runs (bench/detection.py, W = 4, per
//               step after the onset): mean u 0.93 on loss, 0.39 on the norm, 0.13 on the cosine,
//               so the sum's shift in units of its own deviation is 0.77 and the loss's alone 0.96:
//               the two weaker signals add noise and dilute it. A CUSUM per signal keeps each
//               signal's full shift, at the price of three tests per rank, paid in h (+ ln 3,
//               below). A step on which the caller says the ranks are not exchangeable (ranks
//               with duplicate data: their pair agrees with itself, which pushes the others'
//               consensus cosines down) leaves every data-drift statistic as it was;
//   slow        counts steps on which the rank is *late by a margin*, not its position: on a
//               shared machine the positions of healthy ranks are not exchangeable (issue 36).
//               What the ranks report there (bench/detection.py, 4 and 8 gloo ranks on 2 shared
//               cores, load average 20-55; tests/collector/testdata/slow_noise_step_times.txt):
//               ~1 ms of compute, and on most steps one rank descheduled for 2 to 10 ms (now and
//               then 20 to 200 ms), often the *same* rank for 10 to 15 steps in a row (the
//               scheduler's placement is sticky). The old rank-score statistic added up to
//               u_max - k = 0.8 for each step such a rank was the latest past a 1 ms floor, and
//               named it (CI: a clean run's rank 2 at step 36); a healthy rank was late past
//               1 ms on 29 % of its steps in the worst clean run of 100 at W = 4. And a floor of
//               5 % of the median step hid a 40 ms straggler on steps of 800 ms or more.
//               So: lateness d_i = t_i - median(t) (the step's median over the ranks with a
//               time). Runner-up lateness r_i = the largest d_j of the *other* ranks on the step
//               (the step's largest unless i is the latest), whose median over the last
//               kSlowWindowSteps = 16 steps is R_i: how late the latest healthy rank usually is,
//               which adapts to the machine's noise and which a straggler cannot inflate for
//               itself. The rank is late when d_i > max(kSlowFloorSeconds = 5 ms,
//               kSlowMargin * R_i = 1.5 R_i): later than the others' usual worst by half again,
//               and by more than a few scheduler time slices (Linux's base slice on 2 CPUs is
//               1.5 ms; 5 ms costs a 100 ms GPU step 5 %). Nothing is late before the window
//               holds kSlowMinWindowSteps = 4 steps. Then S = min(2h, max(0, S + (late ? 1 : -1)))
//               with h = kSlowThreshold + ln(max(W, 4) / 4) = 7 at W <= 4 (S is an integer: named
//               at S = floor(h) + 1, so 8 consecutive late steps, 7 steps after the first at
//               W < 11, 12 steps at W = 1,024). A rank without a time that step keeps S.
//               False alarms: a healthy rank late with probability p per step, independently,
//               crosses h (a walk of +1 w.p. p, -1 otherwise, reflected at 0) once per
//               1.8e6 rank-steps at p = 0.15, 1.5e5 at p = 0.2, 2e4 at p = 0.25 (exact, from the
//               chain's expected hitting time). Measured p on 100 clean runs at W = 4 under load:
//               0.029 (the worst rank of a run 0.05 median, 0.25 max, over 59 steps); at W = 8:
//               0.051 (0.10, 0.28). Sticky descheduling makes the worst rank's p locally higher
//               than independent steps would, which is why h is 7 and not 5. A 40 ms straggler is
//               late on every step unless the others' noise is as large as 40 ms for a while: in
//               the recorded runs it is named 5 to 12 steps after its onset (30 of 30 runs of
//               bench/detection.py replayed, 28 within 10). On Gaussian step times (a scale-free
//               check, the floor never binding) W = 4 sees one alarm per ~270,000 rank-steps.
// The data-drift one is S_t = min(2h, max(0, S_{t-1} + x_t - k)), started at 0, updated on the
// steps the rank reported; the rank is named (drifting / slow) while S_t > h (slow: its own h). The
// cap 2h bounds how long a rank stays named after the fault stops: S falls by k = 0.5 a step on
// average once the rank is healthy again (by at least k when it is then the best rank), so ~2h
// steps to fall below h.
//
// Parameters: k = 0.5 (half of a shift of one unit of x_j: a rank one standard deviation worse on
// one signal's score), h = 8 + ln(max(W, 4) / 4) + ln 3 (W: the job's world size; 9.10 at
// W <= 4). Why: a rank's false-alarm hazard is 3 tests' (one per signal, at most, when they are
// independent; correlated signals cross together, so fewer), and the job's is W ranks'; a
// one-sided CUSUM's hazard falls about as e^(-2kh) = e^(-h), so + ln 3 pays for the three tests
// and + ln(W / 4) for the ranks: the expected steps between false alarms of the *whole job* stay
// about the same at every W (a fixed h would give a 10,000-rank job one every few steps). What a
// run sees (the arithmetic "over the run's length and world size"): a CUSUM starts at 0 and its
// increments are bounded (u_max / sd_m - k = 0.84 at W = 4), so no healthy rank can be named in
// its first ceil(h / 0.84) = 11 steps, and the chance that a healthy L-step job raises any
// false alarm is well below L x W / (rank-steps per alarm). Measured with this code on i.i.d.
// N(0,1) signals (tests/collector/rank_cusum_test.cc; a false alarm is a new crossing of h by any
// rank, which is what an alert sees; the 60-step runs with a numpy replica of the same arithmetic,
// loss and norm correlated 0.55 as in the benchmark's clean runs):
//     W (h)                                              4 (9.10)   8 (9.79)   64 (11.87)
//     healthy rank-steps per false alarm, data drift      42,100     69,600     267,000
//       same, W = 4, loss and norm correlated 0.55: 48,500
//     job steps per false alarm                           10,500      8,700       4,200
//     60-step jobs with a false alarm                      0.27 %     0.34 %
//     the sum of issue 18 (pooled sigma, h = 8 + ln(W/4)): 19,800 / 30,800 rank-steps, 1.1 % /
//     1.1 % of 60-step jobs (1.1 false flags expected in 100 clean runs at each W; 0.27 / 0.34
//     now)
// (The slow statistic's rates are above, under "slow".)
// The per-step rule (rank_diagnostics.h, now with its scale floor) raises fewer still. Detection
// delay: a rank whose score is the highest on one signal on every step gains 0.84 a step at
// W = 4 (named on the 11th step); 10 % label noise, replayed on the benchmark's 470 recorded runs
// (docs/PERFORMANCE.md): 30 of 30 runs named (28 with the sum), median 17.5 steps after the onset
// (17.5 with the sum), 25 within 20 steps (19 with the sum), test_sequential.py's 3 runs at 20,
// 18 and 12 (22, 18, 14 with the sum). Nothing is tuned to a benchmark: k, the 8 and the ln terms
// are the sum's, the ln 3 is the count of tests.
//
// The flags this replaced (issue 36, item 4): 2 of 200 clean runs (W = 4 #33 rank 3, steps
// 28-39; W = 8 #61 rank 6, step 47) and 4 faulty runs raised `drifting` on a healthy rank. Their
// recorded paths: the flagged rank was above the median on all three signals on most steps of a
// 10- to 20-step stretch (W = 4 #33, steps 10-28: loss on 16 of 19, norm 14, cosine deficit 16),
// and the sum, in which each of them counts, crossed 8 (W = 4 #33 reached 11.3). Per signal the
// largest sums of those ranks are 7.8 (loss) and 7.5 (norm, W = 8 #61), below h = 9.10 / 9.79
// (tests/collector/testdata/drift_noise_signals.txt replays them: nothing named). One faulty run
// (W = 4 ulp_drift #2: rank 0's gradient norm above the others' median on 32 of 40 healthy
// steps, its sum 12.0) still crosses: that is the designed rate, about one per 42,000 rank-steps.
//
// State: per rank of one job, five doubles (three data-drift sums, their max, slow); ranks at zero
// are not stored, so a detector holds at most world-size entries; per job, the last
// kSlowWindowSteps steps' largest and second-largest lateness (kSlowWindowSteps x 24 bytes). The
// owner (StepAnalyzer) keeps one per job and epoch and frees it with the job. A collector restart
// starts every statistic from zero (a persistent fault is named again after the same delay).
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_RANK_CUSUM_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_RANK_CUSUM_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace rankscope::collector {

inline constexpr double kCusumDrift = 0.5;      // k
inline constexpr double kCusumThreshold = 8.0;  // h at W <= 4, before the + ln 3 of the signals
// The data-drift signals, one CUSUM each: loss, gradient norm, consensus cosine deficit.
inline constexpr size_t kCusumDataSignals = 3;
// The slow statistic (see above): a rank is late on a step when it trails the step's median time
// by more than max(kSlowFloorSeconds, kSlowMargin * r), r the median over the last
// kSlowWindowSteps steps (at least kSlowMinWindowSteps of them) of the lateness of the latest
// *other* rank; its count moves +1 on a late step and -1 on any other, and it is named above
// kSlowThreshold + ln(max(W, 4) / 4).
inline constexpr double kSlowFloorSeconds = 5e-3;
inline constexpr double kSlowMargin = 1.5;
inline constexpr size_t kSlowWindowSteps = 16;
inline constexpr size_t kSlowMinWindowSteps = 4;
inline constexpr double kSlowThreshold = 7.0;

// h for a job of `world_size` ranks: kCusumThreshold + ln(max(W, 4) / 4) + ln(kCusumDataSignals),
// so that the expected steps between false alarms of the whole job (any rank, any signal) stay
// about the same whatever W.
double CusumThreshold(uint32_t world_size);

// h of the slow statistic: kSlowThreshold + ln(max(W, 4) / 4).
double SlowThreshold(uint32_t world_size);

// Centred uniform rank scores of `values` (see above), same order. NaN/Inf values get 0 and are
// not ranked; with fewer than two finite values every score is 0.
std::vector<double> UniformRankScores(absl::Span<const double> values);

// The signals of one rank on one step.
struct RankDriftSignals {
  uint32_t rank = 0;
  double loss = std::numeric_limits<double>::quiet_NaN();
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  double consensus_cosine = std::numeric_limits<double>::quiet_NaN();
  double step_time_seconds = std::numeric_limits<double>::quiet_NaN();
};

// The two CUSUM statistics of a rank after a step.
struct RankDrift {
  double data = 0.0;  // the largest of by_signal, in [0, 2h]
  // S of each data signal's score (loss, gradient norm, consensus cosine deficit), in [0, 2h].
  std::array<double, kCusumDataSignals> by_signal{};
  double slow = 0.0;      // S of the step-time score, in [0, 2h]
  bool drifting = false;  // data > h
  bool is_slow = false;   // slow > h
};

// One-sided CUSUM statistics per rank of one job.
class RankCusum {
 public:
  // For a job of `world_size` ranks (sets h = CusumThreshold(world_size)).
  explicit RankCusum(uint32_t world_size);

  double threshold() const { return h_; }
  double slow_threshold() const { return h_slow_; }

  // Feeds one step: `ranks` are the ranks that reported it (distinct). Returns each one's
  // statistics after the step, same order. Ranks absent from the step keep theirs. With
  // `exchangeable` false (the step has ranks with duplicate data) the data-drift statistics are
  // left as they were; the slow statistics are updated.
  std::vector<RankDrift> Update(absl::Span<const RankDriftSignals> ranks, bool exchangeable = true);

  // The rank's current statistics (zero when not stored).
  RankDrift Get(uint32_t rank) const;

  // Ranks with a non-zero statistic (what is stored): at most the ranks ever fed.
  size_t size() const { return state_.size(); }

 private:
  RankDrift Flagged(RankDrift d) const;

  // One step of the slowdown window: the largest and second-largest lateness (time minus the
  // step's median) and the rank with the largest.
  struct Lateness {
    double first = 0.0;
    double second = 0.0;
    uint32_t latest = 0;
  };
  // The late flags of `times` (same order as `ranks`; NaN: not late), after pushing this step's
  // lateness into the window.
  std::vector<bool> LateRanks(absl::Span<const RankDriftSignals> ranks,
                              absl::Span<const double> times);

  double h_;
  double h_slow_;
  std::vector<Lateness> window_;  // ring of the last kSlowWindowSteps steps' lateness
  size_t window_next_ = 0;
  absl::flat_hash_map<uint32_t, RankDrift> state_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_RANK_CUSUM_H_
