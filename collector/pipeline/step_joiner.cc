#include "collector/pipeline/step_joiner.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rankscope::collector {
namespace {

size_t BitsetWords(uint32_t bits) { return (static_cast<size_t>(bits) + 63) / 64; }

bool TestBit(const std::vector<uint64_t>& bits, uint32_t i) {
  return (bits[i >> 6] >> (i & 63)) & 1;
}

void SetBit(std::vector<uint64_t>& bits, uint32_t i) { bits[i >> 6] |= uint64_t{1} << (i & 63); }

}  // namespace

bool StepJoiner::OpenStep::Contains(uint32_t rank) const {
  return present.empty() ? present_sparse.contains(rank) : TestBit(present, rank);
}

void StepJoiner::OpenStep::Insert(uint32_t rank) {
  if (present.empty()) {
    present_sparse.insert(rank);
  } else {
    SetBit(present, rank);
  }
}

namespace {

// The ranks in [0, world_size) whose bit is clear, ascending. O(world_size / 64 + result).
std::vector<uint32_t> ClearBits(const std::vector<uint64_t>& bits, uint32_t world_size) {
  std::vector<uint32_t> out;
  for (size_t w = 0; w < bits.size(); ++w) {
    uint64_t clear = ~bits[w];
    while (clear != 0) {
      const uint32_t rank = static_cast<uint32_t>(w * 64 + __builtin_ctzll(clear));
      if (rank >= world_size) break;
      out.push_back(rank);
      clear &= clear - 1;
    }
  }
  return out;
}

}  // namespace

bool StepJoiner::RankSet::Contains(uint32_t rank) const {
  switch (form) {
    case Form::kPresent:
      return std::binary_search(ranks.begin(), ranks.end(), rank);
    case Form::kMissing:
      return !std::binary_search(ranks.begin(), ranks.end(), rank);
    case Form::kBitset:
      return TestBit(bits, rank);
  }
  return false;
}

void StepJoiner::RankSet::Insert(uint32_t rank) {
  auto it = std::lower_bound(ranks.begin(), ranks.end(), rank);
  const bool listed = it != ranks.end() && *it == rank;
  switch (form) {
    case Form::kPresent:
      if (!listed) ranks.insert(it, rank);
      break;
    case Form::kMissing:
      if (listed) ranks.erase(it);
      break;
    case Form::kBitset:
      SetBit(bits, rank);
      break;
  }
}

StepJoiner::StepJoiner(JoinerOptions options) : options_(options) {
  options_.max_open_steps_per_job = std::max<size_t>(options_.max_open_steps_per_job, 1);
}

absl::Status StepJoiner::RegisterJob(absl::string_view job, uint32_t world_size) {
  if (world_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("world_size 0 for job ", job, "; must be >= 1"));
  }
  auto [it, inserted] = jobs_.try_emplace(std::string(job));
  if (inserted) {
    it->second.world_size = world_size;
    return absl::OkStatus();
  }
  if (it->second.world_size != world_size) {
    return absl::FailedPreconditionError(
        absl::StrCat("world_size ", world_size, " != ", it->second.world_size, " for job ", job));
  }
  return absl::OkStatus();
}

void StepJoiner::ForgetJob(absl::string_view job_name, std::vector<JoinedStep>* closed) {
  auto it = jobs_.find(job_name);
  if (it == jobs_.end()) return;
  Job& job = it->second;
  while (!job.open_by_age.empty()) {
    closed->push_back(
        Close(it->first, job, job.open_by_age.begin()->second, JoinedStep::Reason::kEvicted));
  }
  jobs_.erase(it);
}

AddOutcome StepJoiner::Add(absl::string_view job_name, RankReport& report, absl::Time now,
                           std::vector<JoinedStep>* closed) {
  auto job_it = jobs_.find(job_name);
  if (job_it == jobs_.end()) return AddOutcome::kUnknownJob;
  const std::string& name = job_it->first;
  Job& job = job_it->second;
  if (report.rank >= job.world_size) return AddOutcome::kRankOutOfRange;

  if (auto open_it = job.open.find(report.step); open_it != job.open.end()) {
    OpenStep& open = open_it->second;
    if (report.attempt < open.attempt) return AddOutcome::kStale;
    if (report.attempt > open.attempt) {
      closed->push_back(Close(name, job, report.step, JoinedStep::Reason::kSuperseded));
      Open(name, job, report, now, closed);
      return AddOutcome::kAccepted;
    }
    if (open.Contains(report.rank)) {
      // A resend while the step is open. Linear in the step's reports, but only on this path.
      for (RankReport& held : open.reports) {
        if (held.rank != report.rank) continue;
        held.acks.insert(held.acks.end(), std::make_move_iterator(report.acks.begin()),
                         std::make_move_iterator(report.acks.end()));
        break;
      }
      report.acks.clear();
      return AddOutcome::kDuplicate;
    }
    open.Insert(report.rank);
    open.reports.push_back(std::move(report));
    if (open.reports.size() == job.world_size) {
      closed->push_back(Close(name, job, open_it->first, JoinedStep::Reason::kComplete));
    }
    return AddOutcome::kAccepted;
  }

  if (auto closed_it = job.closed.find(report.step); closed_it != job.closed.end()) {
    ClosedStep& done = closed_it->second;
    if (report.attempt < done.attempt) return AddOutcome::kStale;
    if (report.attempt == done.attempt) {
      if (done.ranks.Contains(report.rank)) return AddOutcome::kDuplicate;
      done.ranks.Insert(report.rank);  // a resend of this late report is then a duplicate
      return AddOutcome::kLate;
    }
    // A newer attempt: join the step again from scratch. The old record stays until the new
    // attempt closes and replaces it; while the step is open, lookups find the open step first.
  }

  Open(name, job, report, now, closed);
  return AddOutcome::kAccepted;
}

void StepJoiner::Open(const std::string& job_name, Job& job, RankReport& report, absl::Time now,
                      std::vector<JoinedStep>* closed) {
  const uint64_t step = report.step;
  // A single-rank step completes at once and never occupies an open slot.
  if (job.world_size > 1) {
    while (job.open.size() >= options_.max_open_steps_per_job) {
      const uint64_t oldest = job.open_by_age.begin()->second;
      closed->push_back(Close(job_name, job, oldest, JoinedStep::Reason::kEvicted));
    }
  }
  OpenStep& open = job.open[step];
  open.attempt = report.attempt;
  open.opened_at = now;
  if (job.world_size <= kMaxDenseWorldSize) open.present.assign(BitsetWords(job.world_size), 0);
  open.Insert(report.rank);
  open.reports.push_back(std::move(report));
  job.open_by_age.emplace(now, step);
  deadlines_.emplace(now, job_name, step);
  if (open.reports.size() == job.world_size) {
    closed->push_back(Close(job_name, job, step, JoinedStep::Reason::kComplete));
  }
}

JoinedStep StepJoiner::Close(const std::string& job_name, Job& job, uint64_t step,
                             JoinedStep::Reason reason) {
  auto it = job.open.find(step);
  OpenStep& open = it->second;

  JoinedStep out;
  out.job = job_name;
  out.step = step;
  out.attempt = open.attempt;
  out.world_size = job.world_size;
  out.reason = reason;
  out.opened_at = open.opened_at;
  out.reports = std::move(open.reports);
  std::sort(out.reports.begin(), out.reports.end(),
            [](const RankReport& a, const RankReport& b) { return a.rank < b.rank; });
  if (out.reports.size() < job.world_size) {
    if (!open.present.empty()) {
      out.missing_ranks = ClearBits(open.present, job.world_size);
    } else {
      // Sparse: the complement of the (sorted) ranks present. O(world_size), at close only.
      out.missing_ranks.reserve(job.world_size - out.reports.size());
      size_t next = 0;
      for (uint32_t rank = 0; rank < job.world_size; ++rank) {
        if (next < out.reports.size() && out.reports[next].rank == rank) {
          ++next;
        } else {
          out.missing_ranks.push_back(rank);
        }
      }
    }
  }

  job.open_by_age.erase({open.opened_at, step});
  deadlines_.erase(DeadlineKey{open.opened_at, job_name, step});

  // A superseded step is not remembered: the newer attempt's open step replaces it at once.
  if (reason != JoinedStep::Reason::kSuperseded) {
    const size_t present = out.reports.size();
    const size_t missing = out.missing_ranks.size();
    RankSet ranks;
    if (open.present.empty() || 4 * std::min(present, missing) <= 8 * open.present.size()) {
      if (missing <= present) {
        ranks.form = RankSet::Form::kMissing;
        ranks.ranks = out.missing_ranks;
      } else {
        ranks.form = RankSet::Form::kPresent;
        ranks.ranks.reserve(present);
        for (const RankReport& r : out.reports) ranks.ranks.push_back(r.rank);
      }
    } else {
      ranks.form = RankSet::Form::kBitset;
      ranks.bits = std::move(open.present);
    }
    Remember(job, step, open.attempt, std::move(ranks));
  }
  job.open.erase(it);
  return out;
}

void StepJoiner::Remember(Job& job, uint64_t step, uint32_t attempt, RankSet ranks) {
  const uint64_t seq = job.next_close_seq++;
  ClosedStep& done = job.closed[step];
  done.attempt = attempt;
  done.close_seq = seq;
  done.ranks = std::move(ranks);
  job.closed_order.emplace_back(step, seq);

  auto is_live = [&job](const std::pair<uint64_t, uint64_t>& entry) {
    auto it = job.closed.find(entry.first);
    return it != job.closed.end() && it->second.close_seq == entry.second;
  };
  // Every record has a live entry, so this pops a live one before the deque runs dry.
  while (job.closed.size() > options_.completed_steps_remembered) {
    const auto entry = job.closed_order.front();
    job.closed_order.pop_front();
    if (is_live(entry)) job.closed.erase(entry.first);
  }
  // Drop stale entries once they outnumber the live ones: O(1) amortized, memory stays bounded.
  if (job.closed_order.size() > 2 * job.closed.size() + 16) {
    job.closed_order.erase(
        std::remove_if(job.closed_order.begin(), job.closed_order.end(),
                       [&](const std::pair<uint64_t, uint64_t>& e) { return !is_live(e); }),
        job.closed_order.end());
  }
}

void StepJoiner::ForgetClosedStep(absl::string_view job_name, uint64_t step, uint32_t attempt) {
  auto job_it = jobs_.find(job_name);
  if (job_it == jobs_.end()) return;
  Job& job = job_it->second;
  auto it = job.closed.find(step);
  // Its closed_order entry goes stale and is dropped like any other stale entry.
  if (it != job.closed.end() && it->second.attempt == attempt) job.closed.erase(it);
}

void StepJoiner::Expire(absl::Time now, std::vector<JoinedStep>* closed) {
  while (!deadlines_.empty()) {
    const auto& [opened_at, job_name, step] = *deadlines_.begin();
    if (opened_at + options_.step_timeout > now) break;
    auto job_it = jobs_.find(job_name);
    const uint64_t expiring = step;  // the key dies inside Close
    closed->push_back(
        Close(job_it->first, job_it->second, expiring, JoinedStep::Reason::kTimedOut));
  }
}

absl::Time StepJoiner::NextDeadline() const {
  if (deadlines_.empty()) return absl::InfiniteFuture();
  return std::get<0>(*deadlines_.begin()) + options_.step_timeout;
}

size_t StepJoiner::open_steps(absl::string_view job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.open.size();
}

size_t StepJoiner::open_steps_total() const { return deadlines_.size(); }

size_t StepJoiner::remembered_steps(absl::string_view job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.closed.size();
}

}  // namespace rankscope::collector
