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
//   data drift  y = u(loss) + u(grad_norm) + u(-consensus_cosine), x = y / sigma: a higher loss,
//               a larger local gradient and a gradient that agrees less with the others' all
//               count; a signal that is NaN for a rank (or known for fewer than 2 ranks)
//               contributes 0, so a missing signal only slows detection. The three signals of a
//               rank are correlated in real training (a harder batch raises its loss and its
//               gradient norm together), so y's variance is not 3: sigma^2 is the pooled mean of
//               y^2 over every rank and step of the job so far (y is centred across the ranks of
//               each step, so no mean is needed), started from a prior of 3 (independent
//               signals) with the weight of kCusumPriorRankSteps rank-steps. On i.i.d. signals
//               sigma^2 ~ 3 and x = y / sqrt(3); on fully correlated ones sigma^2 ~ 9 and x
//               keeps unit variance, so the false-alarm rate below holds either way. A step on
//               which the caller says the ranks are not exchangeable (ranks with duplicate data:
//               their pair agrees with itself, which pushes the others' consensus cosines down)
//               leaves every data-drift statistic and sigma as they were;
//   slow        x = u(step_time_seconds): the rank's position in the step's time, i.e. its share
//               of the step against the others', whatever the noise of the times; but a rank
//               that is late by no more than the slowdown floor (its time minus the step's median
//               time, at most max(1 ms, 5 % of that median)) gets x = min(u, 0), as if it were
//               not late. The floor: every rank waits for the slowest at the all-reduce, so a rank
//               late by d costs the job d a step; under 5 % of the others' compute that is not
//               worth a page, and under 1 ms (the order of an OS scheduler's time slice) it is the
//               lateness a healthy rank gets from sharing its CPU. Without it a healthy rank of a
//               job with sub-millisecond compute on a crowded machine (4 ranks on 2 cores) was
//               named slow: it was the latest by a few hundred microseconds on most of 15 steps.
//               The floor only lowers increments, so the false-alarm rates below are upper
//               bounds, and a rank late by more than the floor on every step is named after the
//               same fixed delay.
// Each is S_t = min(2h, max(0, S_{t-1} + x_t - k)), started at 0, updated on the steps the rank
// reported; the rank is named (drifting / slow) while S_t > h. The cap 2h bounds how long a rank
// stays named after the fault stops: S falls by k = 0.5 a step on average once the rank is
// healthy again (by at least k when it is then the best rank), so ~2h steps to fall below h.
//
// Parameters: k = 0.5 (half of a shift of one unit of x: a rank one standard deviation worse on
// its signals' scores), h = 8 + ln(max(W, 4) / 4) (W: the job's world size), so that the expected
// steps between false alarms of the *whole job* (any rank) stay about the same at every W, where a
// fixed h would give a 10,000-rank job a false alarm every few steps. False alarms on a healthy
// job, measured with this code on i.i.d. N(0,1) signals (tests/collector/rank_cusum_test.cc; a
// false alarm is a new crossing of h by any rank, which is what an alert sees):
//     W (h)                                           4 (8.00)   8 (8.69)   64 (10.77)
//     healthy rank-steps per false alarm, data drift   19,800     30,800     530,000 (3 alarms)
//       same, W = 4, loss correlated 0.8 with the norm and the cosine deficit: 35,600
//     healthy rank-steps per false alarm, slow        100,000     53,000     800,000 (2 alarms)
//     job steps per false alarm, data drift             4,900      3,800       8,300
// The per-step rule's false alarms at W = 4 are ~6e-5 per rank-step (one per ~16,000 rank-steps):
// the CUSUM raises fewer there (at W >= 8 the per-step rule's are rarer still: its per-step flag
// rate falls fast with W, see rank_diagnostics.h). Detection delay (simulated with sigma fixed
// at sqrt(3), mean steps from the shift to the crossing, h = 8): a shift of one standard deviation
// on all three data signals, 13 steps at W = 4; half of one, 49 at W = 4 and 31 at W = 8. Nothing
// is tuned to a benchmark.
//
// State: per rank of one job, two doubles; ranks at zero are not stored, so a detector holds at
// most world-size entries. The owner (StepAnalyzer) keeps one per job and epoch and frees it with
// the job. A collector restart starts every statistic from zero (a persistent fault is named
// again after the same delay).
#ifndef RANKSCOPE_COLLECTOR_ANALYSIS_RANK_CUSUM_H_
#define RANKSCOPE_COLLECTOR_ANALYSIS_RANK_CUSUM_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace rankscope::collector {

inline constexpr double kCusumDrift = 0.5;      // k
inline constexpr double kCusumThreshold = 8.0;  // h at W <= 4
// Weight of the prior variance of the data-drift sum (in rank-steps).
inline constexpr double kCusumPriorRankSteps = 64.0;
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

// h for a job of `world_size` ranks: kCusumThreshold + ln(max(W, 4) / 4), so that the expected
// steps between false alarms of the whole job (any rank) stay about the same whatever W.
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
  double data = 0.0;      // S of the data-drift score, in [0, 2h]
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
  // `exchangeable` false (the step has ranks with duplicate data) the data-drift statistics and
  // sigma are left as they were; the slow statistics are updated.
  std::vector<RankDrift> Update(absl::Span<const RankDriftSignals> ranks, bool exchangeable = true);

  // sigma of the data-drift sum (see above).
  double data_sigma() const;

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
  double y2_sum_ = 3.0 * kCusumPriorRankSteps;  // prior: variance 3
  double y2_count_ = kCusumPriorRankSteps;
  absl::flat_hash_map<uint32_t, RankDrift> state_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_ANALYSIS_RANK_CUSUM_H_
