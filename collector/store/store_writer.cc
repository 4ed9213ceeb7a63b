#include "collector/store/store_writer.h"

#include <pthread.h>

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rankscope::collector {
namespace {

void Append(StoreBatch& into, StoreBatch&& from) {
  std::move(from.jobs.begin(), from.jobs.end(), std::back_inserter(into.jobs));
  std::move(from.rank_identities.begin(), from.rank_identities.end(),
            std::back_inserter(into.rank_identities));
  std::move(from.steps.begin(), from.steps.end(), std::back_inserter(into.steps));
}

// Sends the acks of committed items, one Ack call per sink.
void SendAcks(std::vector<WriteItem>& items) {
  absl::flat_hash_map<AckSink*, std::pair<std::shared_ptr<AckSink>, std::vector<uint64_t>>> by;
  for (WriteItem& item : items) {
    for (AckHandle& h : item.acks) {
      if (h.sink == nullptr) continue;
      auto& entry = by[h.sink.get()];
      if (entry.first == nullptr) entry.first = h.sink;
      entry.second.push_back(h.seq);
    }
  }
  for (auto& [raw, entry] : by) entry.first->Ack(entry.second);
}

// Ends the streams of every sink among `items`' acks with UNAVAILABLE (see AckSink::Abandon).
void AbandonSinks(const std::vector<WriteItem>& items, const absl::Status& why) {
  absl::flat_hash_map<AckSink*, std::shared_ptr<AckSink>> sinks;
  for (const WriteItem& item : items) {
    for (const AckHandle& h : item.acks) {
      if (h.sink != nullptr) sinks.emplace(h.sink.get(), h.sink);
    }
  }
  const absl::Status status = absl::UnavailableError(
      absl::StrCat("the collector dropped reports of this stream before storing them (",
                   why.message(), "); reconnect and resend every unacked report"));
  for (auto& [raw, sink] : sinks) sink->Abandon(status);
}

// Disk full, a lock held elsewhere, a file made unwritable: an operator or time can fix these.
bool IsRetryable(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::IsUnavailable(s) || absl::IsPermissionDenied(s);
}

// Group commit: the writer starts a transaction at most once per kCommitInterval (counted from
// the previous commit's start) unless max_batch_items are already queued or it is stopping.
// Under load a transaction then holds several steps, and each agent stream gets one Ack message
// for all its reports in the batch instead of one per step: with 1,024 streams at 50 steps/s, at
// most 20 commits/s send <= 20,000 Ack writes/s instead of 50,000, each a gRPC write and a
// syscall here and a read on the agent (docs/PERFORMANCE.md "Collector ingest"). An idle writer
// commits at once, so a lone step is not delayed; under load an ack (not a metric) waits up to
// one interval more, and Flush() may take up to one interval longer.
constexpr absl::Duration kCommitInterval = absl::Milliseconds(50);

StoreWriterOptions WithDefaultClock(StoreWriterOptions options) {
  if (!options.clock) options.clock = [] { return absl::Now(); };
  return options;
}

}  // namespace

StoreWriter::StoreWriter(std::unique_ptr<SqliteStore> store, StoreWriterOptions options,
                         StoreWriterHooks hooks)
    : options_(WithDefaultClock(std::move(options))),
      hooks_(std::move(hooks)),
      store_(std::move(store)) {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "rs-store-writer");  // for top -H, perf and the bench
    Run();
  });
}

StoreWriter::~StoreWriter() { Stop(absl::Seconds(5)).IgnoreError(); }

void StoreWriter::Enqueue(WriteItem item) {
  std::vector<WriteItem> dropped;
  size_t depth;
  {
    MutexLock lock(&mu_);
    pending_.push_back(std::move(item));
    ++enqueued_;
    while (pending_.size() > std::max<size_t>(options_.max_pending_items, 1)) {
      dropped.push_back(std::move(pending_.front()));
      pending_.pop_front();
      ++finished_;
    }
    depth = pending_.size();
  }
  if (!dropped.empty()) {
    const absl::Status why = absl::ResourceExhaustedError(
        absl::StrCat("store queue over ", options_.max_pending_items, " items, oldest dropped"));
    StoreBatch rows;
    for (WriteItem& d : dropped) Append(rows, std::move(d.batch));
    if (hooks_.on_drop) hooks_.on_drop(rows, dropped.size(), why);
    AbandonSinks(dropped, why);
  }
  if (hooks_.on_queue_depth) hooks_.on_queue_depth(depth);
}

bool StoreWriter::Flush(absl::Duration timeout) {
  MutexLock lock(&mu_);
  const uint64_t target = enqueued_;
  auto done = [this, target]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_ >= target || stopped_; };
  mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  return finished_ >= target;
}

absl::Status StoreWriter::Stop(absl::Duration timeout) {
  {
    MutexLock lock(&mu_);
    if (!stopping_) {
      stopping_ = true;
      stop_deadline_ = options_.clock() + timeout;
    }
  }
  if (thread_.joinable()) thread_.join();
  MutexLock lock(&mu_);
  if (!pending_.empty()) {
    return absl::DataLossError(absl::StrCat(
        pending_.size(), " store items were not committed at shutdown: ", health_.ToString()));
  }
  return absl::OkStatus();
}

absl::Status StoreWriter::health() const {
  MutexLock lock(&mu_);
  return health_;
}

bool StoreWriter::WaitRetentionIdle(absl::Duration timeout) {
  if (!options_.retention) return false;
  MutexLock lock(&mu_);
  const uint64_t after = retention_checks_;
  retention_wanted_ = true;  // wakes an idle writer for a check now
  auto idle = [this, after]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return retention_idle_check_ > after || stopped_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
  return retention_idle_check_ > after;
}

bool StoreWriter::RetentionPass() {
  const RetentionOptions& retention = *options_.retention;
  uint64_t check;
  {
    MutexLock lock(&mu_);
    check = ++retention_checks_;
  }
  const absl::Time now = options_.retention_clock ? options_.retention_clock() : options_.clock();
  PruneAction action;
  absl::Status status = [&]() -> absl::Status {
    auto usage = store_->Usage();
    if (!usage.ok()) return usage.status();
    auto jobs = store_->JobExtents();
    if (!jobs.ok()) return jobs.status();
    action = NextPruneAction(retention, now, *usage, *jobs);
    if (hooks_.on_usage) hooks_.on_usage(*usage, action.over_cap);
    return absl::OkStatus();
  }();
  bool pruned = false;
  if (status.ok() && action.kind != PruneAction::Kind::kNone) {
    const absl::Time start = options_.clock();
    auto result = store_->Prune(action, retention.window_steps, retention.outlier_threshold);
    if (result.ok()) {
      if (hooks_.on_prune) hooks_.on_prune(action, *result, options_.clock() - start);
      pruned = result->steps > 0;
    } else {
      status = result.status();
    }
  }
  if (!status.ok() && hooks_.on_prune_error) hooks_.on_prune_error(status);
  if (!pruned) {
    MutexLock lock(&mu_);
    retention_idle_check_ = check;
  }
  return pruned;
}

void StoreWriter::Run() {
  std::vector<WriteItem> items;
  while (true) {
    if (RetentionDue() && Idle()) {
      Prune();
      continue;
    }
    switch (TakeBatch(items)) {
      case Take::kAgain:
        continue;
      case Take::kStopped:
        return;
      case Take::kBatch:
        break;
    }
    if (!CommitBatch(items)) return;
  }
}

bool StoreWriter::RetentionDue() const {
  return options_.retention && (retention_backlog_ || options_.clock() >= next_retention_check_);
}

void StoreWriter::Prune() {
  retention_backlog_ = RetentionPass();
  if (!retention_backlog_) {
    next_retention_check_ = options_.clock() + options_.retention->check_interval;
  }
}

bool StoreWriter::Idle() const {
  MutexLock lock(&mu_);
  return pending_.empty() && !stopping_;
}

StoreWriter::Take StoreWriter::TakeBatch(std::vector<WriteItem>& items) {
  MutexLock lock(&mu_);
  auto ready = [this]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !pending_.empty() || stopping_; };
  if (options_.retention) {
    auto ready_or_wanted = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !pending_.empty() || stopping_ || retention_wanted_;
    };
    const absl::Duration until_check =
        retention_backlog_
            ? absl::ZeroDuration()
            : std::max(absl::ZeroDuration(), next_retention_check_ - options_.clock());
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready_or_wanted), until_check)) return Take::kAgain;
    if (retention_wanted_) {
      retention_wanted_ = false;
      next_retention_check_ = absl::InfinitePast();
      if (!ready()) return Take::kAgain;
    }
  } else {
    mu_.Await(absl::Condition(&ready));
  }
  // Group commit: wait up to kCommitInterval after the last commit for a full batch.
  auto full = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_.size() >= std::max<size_t>(options_.max_batch_items, 1) || stopping_;
  };
  const absl::Time next_commit = last_commit_ + kCommitInterval;
  if (const absl::Time now = options_.clock(); !full() && now < next_commit) {
    mu_.AwaitWithTimeout(absl::Condition(&full), next_commit - now);
  }
  last_commit_ = options_.clock();
  if (pending_.empty() || (stopping_ && options_.clock() >= stop_deadline_)) {
    stopped_ = true;
    return Take::kStopped;
  }
  const size_t n = std::min(pending_.size(), std::max<size_t>(options_.max_batch_items, 1));
  items.clear();
  for (size_t i = 0; i < n; ++i) {
    items.push_back(std::move(pending_.front()));
    pending_.pop_front();
  }
  return Take::kBatch;
}

bool StoreWriter::CommitBatch(std::vector<WriteItem>& items) {
  StoreBatch batch;
  for (WriteItem& item : items) Append(batch, std::move(item.batch));
  const absl::Time start = options_.clock();
  absl::Status status = batch.empty() ? absl::OkStatus() : store_->Write(batch);
  if (status.ok()) {
    const absl::Duration commit_time = options_.clock() - start;  // the commit, not the acks
    if (hooks_.on_stored && !batch.empty()) hooks_.on_stored(batch);
    SendAcks(items);
    if (hooks_.on_commit) hooks_.on_commit(commit_time, items.size());
    bool stopping;
    {
      MutexLock lock(&mu_);
      finished_ += items.size();
      health_ = absl::OkStatus();
      if (hooks_.on_queue_depth) hooks_.on_queue_depth(pending_.size());
      stopping = stopping_;
    }
    // One pruning transaction between two commits while there is a backlog to prune.
    if (!stopping && RetentionDue()) Prune();
    return true;
  }
  if (hooks_.on_error) hooks_.on_error(status);
  if (!IsRetryable(status)) {
    // The same batch would fail the same way forever: drop it unacked so that the queue behind
    // it keeps moving, and make its agents resend (where validation or the store refuses it
    // again, or a smaller batch succeeds).
    if (hooks_.on_drop) hooks_.on_drop(batch, items.size(), status);
    AbandonSinks(items, status);
    MutexLock lock(&mu_);
    finished_ += items.size();
    health_ = status;
    return true;
  }
  // Not stored: nothing is acked. Put the items back in front (their rows were moved into
  // `batch`, so rebuild one item holding the whole batch and all acks) and retry later.
  WriteItem retry;
  retry.batch = std::move(batch);
  for (WriteItem& item : items) {
    std::move(item.acks.begin(), item.acks.end(), std::back_inserter(retry.acks));
  }
  MutexLock lock(&mu_);
  health_ = status;
  // The merged item stands for items.size() enqueued items.
  finished_ += items.size() - 1;
  pending_.push_front(std::move(retry));
  auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
  mu_.AwaitWithTimeout(absl::Condition(&stop), options_.retry_backoff);
  if (stopping_ && options_.clock() >= stop_deadline_) {
    stopped_ = true;
    return false;
  }
  return true;
}

}  // namespace rankscope::collector
