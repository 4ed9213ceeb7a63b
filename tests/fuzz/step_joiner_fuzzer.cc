// Fuzzes collector/step_joiner: bytes -> joiner options and a sequence of operations (register
// or forget a job, add a report of rank r for step s and attempt a, advance the injected clock,
// expire) run against both the StepJoiner and a small reference model written from
// step_joiner.h's contract (ordered maps and sets, no cleverness). After every operation:
//  - Add's outcome and the exact list of steps it closed (which, in which order, for what reason)
//    are the model's; so are Expire's and ForgetJob's;
//  - every closed step holds each rank at most once, sorted, exactly the reports accepted into it
//    (with the acks of their duplicates), and names exactly the other ranks as missing;
//  - a step closes at most once per attempt while it is remembered ("nothing completes twice");
//  - open steps per job <= max_open_steps_per_job, the counters and NextDeadline agree;
//  - a report not accepted is left intact (its sketch and, unless merged, its acks).
// At the end every open step is expired: every accepted report came out exactly once.
//
// Input layout (tests/fuzz/make_corpus.py writes seeds in it): u8 step_timeout_seconds - 1,
// u8 max_open_steps_per_job, u8 completed_steps_remembered, then operations, each an opcode byte
// followed by its operands (see the switch below).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <list>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "collector/pipeline/step_joiner.h"
#include "tests/fuzz/byte_reader.h"
#include "tests/fuzz/fuzz_check.h"

namespace rankscope::fuzz {
namespace {

using collector::AddOutcome;
using collector::JoinedStep;
using collector::JoinerOptions;
using collector::RankReport;
using collector::StepJoiner;
using Reason = JoinedStep::Reason;

const char* const kJobs[] = {"job-a", "job-b", "job-c"};

struct ModelRank {
  uint64_t id = 0;             // the accepted report's id (its loss)
  std::vector<uint64_t> acks;  // its ack seqs, then those of duplicates merged into it
};
struct ModelOpen {
  uint32_t attempt = 0;
  absl::Time opened_at;
  std::map<uint32_t, ModelRank> ranks;
};
struct ModelClosed {
  uint32_t attempt = 0;
  std::set<uint32_t> ranks;
};
struct ModelJob {
  uint32_t world_size = 0;
  std::map<uint64_t, ModelOpen> open;
  std::map<uint64_t, ModelClosed> closed;  // remembered closed steps
  std::list<uint64_t> closing_order;       // of the remembered steps, oldest first
};

// What the model expects a call to close: (job, step, reason), in order.
using Expected = std::vector<std::tuple<std::string, uint64_t, Reason>>;

class Harness {
 public:
  explicit Harness(JoinerOptions options) : options_(options), joiner_(options) {
    cap_ = std::max<size_t>(options.max_open_steps_per_job, 1);
  }

  void Register(const std::string& job, uint32_t world_size) {
    const absl::Status st = joiner_.RegisterJob(job, world_size);
    auto it = jobs_.find(job);
    if (world_size == 0) {
      FUZZ_CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    } else if (it == jobs_.end()) {
      FUZZ_CHECK(st.ok());
      jobs_[job].world_size = world_size;
    } else if (it->second.world_size != world_size) {
      FUZZ_CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    } else {
      FUZZ_CHECK(st.ok());
    }
  }

  void Forget(const std::string& job) {
    Expected expected;
    auto it = jobs_.find(job);
    if (it != jobs_.end()) {
      for (const uint64_t step : ByAge(it->second))
        expected.emplace_back(job, step, Reason::kEvicted);
    }
    std::vector<JoinedStep> closed;
    joiner_.ForgetJob(job, &closed);
    ApplyClosed(expected, closed);
    jobs_.erase(job);
  }

  // Long: the fuzzer's reference model of the joiner's rules for one report, case by case beside
  // the real joiner's answer; split, the cases would lose their order.
  void Add(const std::string& job, uint32_t rank, uint64_t step, uint32_t attempt) {
    const uint64_t id = ++next_id_;
    RankReport report;
    report.rank = rank;
    report.step = step;
    report.attempt = attempt;
    report.loss = static_cast<double>(id);
    report.sketch = {static_cast<float>(id % 1000)};
    report.received_at = now_;
    report.acks.push_back(collector::AckHandle{nullptr, id});

    // The model's verdict.
    AddOutcome expected_outcome = AddOutcome::kAccepted;
    Expected expected;
    bool merged = false;  // a duplicate merged into an open step (its acks taken)
    bool opens = false;
    auto it = jobs_.find(job);
    if (it == jobs_.end()) {
      expected_outcome = AddOutcome::kUnknownJob;
    } else if (rank >= it->second.world_size) {
      expected_outcome = AddOutcome::kRankOutOfRange;
    } else if (auto open = it->second.open.find(step); open != it->second.open.end()) {
      if (attempt < open->second.attempt) {
        expected_outcome = AddOutcome::kStale;
      } else if (attempt > open->second.attempt) {
        expected.emplace_back(job, step, Reason::kSuperseded);
        opens = true;
      } else if (open->second.ranks.count(rank) > 0) {
        expected_outcome = AddOutcome::kDuplicate;
        merged = true;
      } else if (open->second.ranks.size() + 1 == it->second.world_size) {
        expected.emplace_back(job, step, Reason::kComplete);
      }
    } else if (auto done = it->second.closed.find(step); done != it->second.closed.end()) {
      if (attempt < done->second.attempt) {
        expected_outcome = AddOutcome::kStale;
      } else if (attempt == done->second.attempt) {
        expected_outcome =
            done->second.ranks.count(rank) > 0 ? AddOutcome::kDuplicate : AddOutcome::kLate;
      } else {
        opens = true;
      }
    } else {
      opens = true;
    }
    if (opens) {
      // Evictions (oldest first) make room unless a single-rank step completes at once.
      ModelJob& mj = it->second;
      size_t open_after_supersede = mj.open.size() - (expected.empty() ? 0 : 1);
      if (mj.world_size > 1 && open_after_supersede >= cap_) {
        std::vector<uint64_t> by_age = ByAge(mj);
        size_t i = 0;
        while (open_after_supersede >= cap_) {
          if (by_age[i] == step && !expected.empty()) {  // the superseded one is gone already
            ++i;
            continue;
          }
          expected.emplace_back(job, by_age[i++], Reason::kEvicted);
          --open_after_supersede;
        }
      }
      if (mj.world_size == 1) expected.emplace_back(job, step, Reason::kComplete);
    }

    std::vector<JoinedStep> closed;
    const AddOutcome outcome = joiner_.Add(job, report, now_, &closed);
    FUZZ_CHECK(outcome == expected_outcome);

    // Update the model for the report itself before checking the closes it caused (a
    // completing report is part of the step it completes).
    if (outcome == AddOutcome::kAccepted) {
      ModelJob& mj = it->second;
      // Superseded and evicted steps are checked against the model before the new one opens.
      std::vector<JoinedStep> before_open;
      std::vector<JoinedStep> rest;
      Expected expected_before, expected_rest;
      for (size_t i = 0; i < expected.size(); ++i) {
        const bool is_new_complete =
            std::get<2>(expected[i]) == Reason::kComplete && std::get<1>(expected[i]) == step;
        (is_new_complete ? expected_rest : expected_before).push_back(expected[i]);
      }
      FUZZ_CHECK(closed.size() == expected.size());
      for (size_t i = 0; i < closed.size(); ++i) {
        (i < expected_before.size() ? before_open : rest).push_back(std::move(closed[i]));
      }
      ApplyClosed(expected_before, before_open);
      ModelOpen& mo = mj.open[step];
      if (opens) {
        mo.attempt = attempt;
        mo.opened_at = now_;
        mo.ranks.clear();
      }
      mo.ranks[rank] = ModelRank{id, {id}};
      ApplyClosed(expected_rest, rest);
    } else {
      FUZZ_CHECK(closed.empty() && expected.empty());
      FUZZ_CHECK(report.sketch.size() == 1 && report.sketch[0] == static_cast<float>(id % 1000));
      FUZZ_CHECK(report.rank == rank && report.step == step && report.attempt == attempt);
      if (merged) {
        FUZZ_CHECK(report.acks.empty());
        it->second.open[step].ranks[rank].acks.push_back(id);
      } else {
        FUZZ_CHECK(report.acks.size() == 1 && report.acks[0].seq == id);
      }
      if (outcome == AddOutcome::kLate) it->second.closed[step].ranks.insert(rank);
    }
    CheckCounters();
  }

  void AdvanceAndExpire(absl::Duration d, bool expire) {
    now_ += d;
    if (!expire) return;
    Expire(now_);
  }

  void Expire(absl::Time now) {
    std::vector<std::tuple<absl::Time, std::string, uint64_t>> due;
    for (const auto& [name, mj] : jobs_) {
      for (const auto& [step, mo] : mj.open) {
        if (mo.opened_at + options_.step_timeout <= now) due.emplace_back(mo.opened_at, name, step);
      }
    }
    std::sort(due.begin(), due.end());
    Expected expected;
    for (const auto& [at, name, step] : due) expected.emplace_back(name, step, Reason::kTimedOut);
    std::vector<JoinedStep> closed;
    joiner_.Expire(now, &closed);
    ApplyClosed(expected, closed);
    CheckCounters();
  }

  // Closes everything still open; every accepted report must then have come out.
  void Drain() {
    Expire(absl::InfiniteFuture());
    for (const auto& [name, mj] : jobs_) FUZZ_CHECK(mj.open.empty());
    FUZZ_CHECK(joiner_.open_steps_total() == 0);
  }

  uint32_t world_size(const std::string& job) const {
    auto it = jobs_.find(job);
    return it == jobs_.end() ? 0 : it->second.world_size;
  }

 private:
  // Open steps of a job by (opened_at, step): the eviction order.
  static std::vector<uint64_t> ByAge(const ModelJob& mj) {
    std::vector<std::pair<absl::Time, uint64_t>> v;
    for (const auto& [step, mo] : mj.open) v.emplace_back(mo.opened_at, step);
    std::sort(v.begin(), v.end());
    std::vector<uint64_t> out;
    for (const auto& e : v) out.push_back(e.second);
    return out;
  }

  // Checks each closed step against the model's open step, then moves it to the model's
  // remembered steps.
  void ApplyClosed(const Expected& expected, const std::vector<JoinedStep>& closed) {
    FUZZ_CHECK(closed.size() == expected.size());
    for (size_t i = 0; i < closed.size(); ++i) {
      const JoinedStep& js = closed[i];
      FUZZ_CHECK(js.job == std::get<0>(expected[i]));
      FUZZ_CHECK(js.step == std::get<1>(expected[i]));
      FUZZ_CHECK(js.reason == std::get<2>(expected[i]));
      ModelJob& mj = jobs_.at(js.job);
      auto open_it = mj.open.find(js.step);
      FUZZ_CHECK(open_it != mj.open.end());
      const ModelOpen& mo = open_it->second;
      FUZZ_CHECK(js.attempt == mo.attempt);
      FUZZ_CHECK(js.world_size == mj.world_size);
      FUZZ_CHECK(js.opened_at == mo.opened_at);
      // Each rank at most once, sorted, exactly the accepted reports, with their merged acks.
      FUZZ_CHECK(js.reports.size() == mo.ranks.size());
      auto want = mo.ranks.begin();
      for (size_t r = 0; r < js.reports.size(); ++r, ++want) {
        const RankReport& got = js.reports[r];
        if (r > 0) FUZZ_CHECK(js.reports[r - 1].rank < got.rank);
        FUZZ_CHECK(got.rank == want->first);
        FUZZ_CHECK(got.rank < js.world_size);
        FUZZ_CHECK(got.step == js.step && got.attempt == js.attempt);
        FUZZ_CHECK(got.loss == static_cast<double>(want->second.id));
        FUZZ_CHECK(got.acks.size() == want->second.acks.size());
        for (size_t a = 0; a < got.acks.size(); ++a) {
          FUZZ_CHECK(got.acks[a].seq == want->second.acks[a]);
        }
      }
      // Missing ranks: exactly the others, sorted.
      std::vector<uint32_t> missing;
      for (uint32_t r = 0; r < mj.world_size; ++r) {
        if (mo.ranks.count(r) == 0) missing.push_back(r);
      }
      FUZZ_CHECK(js.missing_ranks == missing);
      FUZZ_CHECK((js.reason == Reason::kComplete) == missing.empty());

      if (js.reason != Reason::kSuperseded) {
        // Nothing completes twice: while a step is remembered, it closes again only for a
        // newer attempt.
        auto done = mj.closed.find(js.step);
        FUZZ_CHECK(done == mj.closed.end() || done->second.attempt < js.attempt);
        ModelClosed& record = mj.closed[js.step];
        record.attempt = js.attempt;
        record.ranks.clear();
        for (const auto& [rank, unused] : mo.ranks) record.ranks.insert(rank);
        mj.closing_order.remove(js.step);
        mj.closing_order.push_back(js.step);
        while (mj.closed.size() > options_.completed_steps_remembered) {
          mj.closed.erase(mj.closing_order.front());
          mj.closing_order.pop_front();
        }
      }
      mj.open.erase(open_it);
    }
  }

  void CheckCounters() {
    size_t total = 0;
    absl::Time next = absl::InfiniteFuture();
    for (const char* name : kJobs) {
      auto it = jobs_.find(name);
      const size_t open = it == jobs_.end() ? 0 : it->second.open.size();
      const size_t remembered = it == jobs_.end() ? 0 : it->second.closed.size();
      FUZZ_CHECK(joiner_.open_steps(name) == open);
      FUZZ_CHECK(joiner_.open_steps(name) <= cap_);
      FUZZ_CHECK(joiner_.remembered_steps(name) == remembered);
      FUZZ_CHECK(remembered <= options_.completed_steps_remembered);
      total += open;
      if (it == jobs_.end()) continue;
      for (const auto& [step, mo] : it->second.open) {
        next = std::min(next, mo.opened_at + options_.step_timeout);
      }
    }
    FUZZ_CHECK(joiner_.open_steps_total() == total);
    FUZZ_CHECK(joiner_.NextDeadline() == next);
  }

  const JoinerOptions options_;
  size_t cap_ = 1;
  StepJoiner joiner_;
  std::map<std::string, ModelJob> jobs_;
  absl::Time now_ = absl::FromUnixSeconds(1'700'000'000);
  uint64_t next_id_ = 0;
};

}  // namespace
}  // namespace rankscope::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rankscope::fuzz;  // NOLINT(build/namespaces): this function only
  ByteReader in(data, size);
  rankscope::collector::JoinerOptions options;
  options.step_timeout = absl::Seconds(1 + in.U8() % 8);
  options.max_open_steps_per_job = in.U8() % 6;
  options.completed_steps_remembered = in.U8() % 8;
  Harness h(options);
  int ops = 0;
  while (!in.empty() && ++ops <= 2000) {
    const uint8_t op = in.U8();
    const std::string job = kJobs[in.U8() % 3];
    switch (op % 8) {
      case 0:
      case 1:
      case 2:
      case 3: {  // Add: u8 rank, u8 step (or u64 when op & 0x80), u8 attempt
        const uint32_t world = h.world_size(job);
        const uint8_t r = in.U8();
        // Mostly in range; sometimes == world_size or beyond (the caller's bug).
        const uint32_t rank = world == 0 ? r : r % (world + 2);
        const uint64_t step = (op & 0x80) ? in.U64() : in.U8() % 12;
        const uint32_t attempt = in.U8() % 3;
        h.Add(job, rank, step, attempt);
        break;
      }
      case 4:  // u8 seconds: advance the clock, then Expire
        h.AdvanceAndExpire(absl::Seconds(in.U8() % 12), true);
        break;
      case 5: {  // u8: RegisterJob with a small world size, or 60..123 (multi-word bitsets)
        const uint8_t b = in.U8();
        h.Register(job, b < 192 ? b % 6 : 60 + (b - 192));
        break;
      }
      case 6:
        h.Forget(job);
        break;
      case 7:  // u8 milliseconds * 100: advance the clock without expiring
        h.AdvanceAndExpire(absl::Milliseconds(100 * (in.U8() % 16)), false);
        break;
    }
  }
  h.Drain();
  return 0;
}
