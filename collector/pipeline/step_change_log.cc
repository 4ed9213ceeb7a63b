#include "collector/pipeline/step_change_log.h"

#include <algorithm>
#include <limits>

namespace rankscope::collector {

StepChangeLog::StepChangeLog(uint64_t instance, size_t max_entries_per_job, size_t max_jobs)
    : instance_(instance),
      max_entries_per_job_(std::max<size_t>(max_entries_per_job, 1)),
      max_jobs_(std::max<size_t>(max_jobs, 1)) {}

void StepChangeLog::Record(const StoreBatch& batch) {
  if (batch.steps.empty()) return;
  MutexLock lock(&mu_);
  const uint64_t seq = ++seq_;
  // Consecutive StepWrites of one job (the usual batch) go in together.
  for (size_t i = 0; i < batch.steps.size();) {
    const std::string& job = batch.steps[i].job;
    std::vector<uint64_t> steps;
    for (; i < batch.steps.size() && batch.steps[i].job == job; ++i) {
      steps.push_back(batch.steps[i].step);
    }
    AddLocked(job, seq, steps);
  }
}

void StepChangeLog::RecordSteps(absl::string_view job, const std::vector<uint64_t>& steps) {
  MutexLock lock(&mu_);
  AddLocked(job, ++seq_, steps);
}

void StepChangeLog::AddLocked(absl::string_view job, uint64_t seq,
                              const std::vector<uint64_t>& steps) {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) {
    if (jobs_.size() >= max_jobs_) {
      // Forget the job recorded least recently.
      auto oldest = jobs_.begin();
      for (auto j = jobs_.begin(); j != jobs_.end(); ++j) {
        if (j->second.last_seq < oldest->second.last_seq) oldest = j;
      }
      jobs_forgotten_through_ = std::max(jobs_forgotten_through_, oldest->second.last_seq);
      jobs_.erase(oldest);
    }
    it = jobs_.try_emplace(std::string(job)).first;
    // Changes of this job before now may have been forgotten with it.
    it->second.forgotten_through = jobs_forgotten_through_;
  }
  JobLog& log = it->second;
  log.last_seq = seq;
  for (uint64_t step : steps) {
    // A step recorded again in the same commit is one entry.
    if (!log.entries.empty() && log.entries.back() == std::make_pair(seq, step)) continue;
    log.entries.emplace_back(seq, step);
  }
  while (log.entries.size() > max_entries_per_job_) {
    log.forgotten_through = std::max(log.forgotten_through, log.entries.front().first);
    log.entries.pop_front();
  }
}

ChangeCursor StepChangeLog::Now() const {
  MutexLock lock(&mu_);
  return {instance_, seq_};
}

StepChangeLog::Changes StepChangeLog::StepsChangedSince(absl::string_view job,
                                                        const ChangeCursor& cursor, uint64_t first,
                                                        uint64_t last) const {
  Changes out;
  MutexLock lock(&mu_);
  if (cursor.instance != instance_ || cursor.seq > seq_) return out;
  auto it = jobs_.find(job);
  if (it == jobs_.end()) {
    // Never recorded, or forgotten whole: complete unless it was forgotten after the cursor.
    out.complete = cursor.seq >= jobs_forgotten_through_;
    return out;
  }
  const JobLog& log = it->second;
  if (cursor.seq < log.forgotten_through) return out;
  out.complete = true;
  auto from = std::upper_bound(
      log.entries.begin(), log.entries.end(), cursor.seq,
      [](uint64_t seq, const std::pair<uint64_t, uint64_t>& e) { return seq < e.first; });
  for (; from != log.entries.end(); ++from) {
    if (from->second >= first && from->second <= last) out.steps.push_back(from->second);
  }
  std::sort(out.steps.begin(), out.steps.end());
  out.steps.erase(std::unique(out.steps.begin(), out.steps.end()), out.steps.end());
  return out;
}

}  // namespace rankscope::collector
