#include "collector/ingest/ingest_service.h"

#include <pthread.h>

#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/mutex.h"
#include "common/tsan.h"
#include "google/protobuf/arena.h"

namespace rankscope::collector {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Each stream parses its messages into a protobuf arena whose first block is the reactor's own
// and which is reset before every read, so a report (its StepReport and its k floats) costs no
// malloc and no free: a message parsed into a plain AgentMessage reallocates both every time (the
// oneof is cleared by deleting the sub-message). 5 KiB holds a report with k <= 1024 (4,264 bytes
// at k = 1024); a larger one spills into blocks that the next reset frees.
constexpr size_t kArenaBlockBytes = 5 << 10;

google::protobuf::ArenaOptions ArenaOn(char* block, size_t size) {
  google::protobuf::ArenaOptions options;
  options.initial_block = block;
  options.initial_block_size = size;
  return options;
}

}  // namespace

class StreamReactor;

// The AgentStream handed to the pipeline: forwards to the reactor while the stream lives.
class StreamHandle final : public AgentStream {
 public:
  explicit StreamHandle(StreamReactor* reactor) : reactor_(reactor) {}
  void Ack(absl::Span<const uint64_t> seqs) override;
  void SendControl(const v1::Control& control) override;
  void Abandon(const absl::Status& why) override;
  // Ends the stream with DEADLINE_EXCEEDED if its first message has not arrived (the hello
  // watchdog, at the stream's deadline). True if it did.
  bool ExpireIfNoHello(absl::Duration timeout);
  void Detach() {
    MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  Mutex mu_;
  StreamReactor* reactor_ ABSL_GUARDED_BY(mu_);
};

class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // The caller has counted this stream in open_streams_ already (IngestService::Stream).
  StreamReactor(IngestService* service, bool over_limit)
      : service_(service),
        handle_(std::make_shared<StreamHandle>(this)),
        arena_(ArenaOn(arena_block_, sizeof(arena_block_))) {
    service_->health_->StreamOpened();
    if (over_limit) {
      service_->health_->Rejected(RejectReason::kTooManyStreams);
      RequestFinish(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("collector has ", service_->options_.max_streams,
                       " agent streams open (its --max_streams limit); the agent retries with "
                       "backoff, or raise --max_streams / shard jobs across collectors")));
      return;
    }
    service_->WatchHello(handle_);
    Read();
  }

  // Each reaction acquires what the thread that started its operation released before the
  // Start*/Finish call: the ordering gRPC guarantees, made visible to ThreadSanitizer
  // (common/tsan.h).
  // Long: the reactor's one read reaction (parse, hello or report, hand it to the pipeline, answer,
  // read on) between its ThreadSanitizer hand-offs; each early return is one way the stream ends.
  void OnReadDone(bool ok) override {
    RANKSCOPE_TSAN_ACQUIRE(this);
    if (!ok) {  // the agent half-closed or the call was cancelled (then OnCancel finishes it)
      MutexLock lock(&mu_);
      read_closed_ = true;
      StartNextWriteLocked();  // finishes with OK once every report handed over is acked
      return;
    }
    if (messages_read_ == 0) {
      MutexLock lock(&mu_);
      first_message_ = true;
    }
    service_->health_->ReportsReceived();
    ++messages_read_;
    const size_t max_message_bytes = service_->options_.max_message_bytes;
    if (max_message_bytes > 0 && in_buf_.Length() > max_message_bytes) {
      service_->health_->Rejected(RejectReason::kMessageTooLarge);
      RequestFinish(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("message ", messages_read_, " of this stream has ", in_buf_.Length(),
                       " bytes, more than the collector's --max_message_bytes ", max_message_bytes,
                       " (a report carries 4 bytes per sketch value): lower the agents' "
                       "sketch_dim or raise --max_message_bytes")));
      return;
    }
    if (grpc::Status parsed =
            grpc::SerializationTraits<v1::AgentMessage>::Deserialize(&in_buf_, in_);
        !parsed.ok()) {
      service_->health_->Rejected(have_hello_ ? RejectReason::kInvalidReport
                                              : RejectReason::kBadHello);
      RequestFinish(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("message ", messages_read_,
                       " of this stream could not be parsed as a rankscope.v1.AgentMessage "
                       "(truncated, corrupted, or not rankscope's protocol)",
                       parsed.error_message().empty() ? "" : ": ", parsed.error_message())));
      return;
    }
    const v1::AgentMessage& in = *in_;
    if (!have_hello_) {
      if (in.kind_case() != v1::AgentMessage::kHello) {
        service_->health_->Rejected(RejectReason::kBeforeHello);
        RequestFinish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                   "the first message of a stream must be a Hello"));
        return;
      }
      hello_ = in.hello();  // a deep copy, off the arena
      Rejection r = service_->pipeline_->AcceptHello(hello_, handle_);
      if (!r.status.ok()) {
        service_->health_->Rejected(r.reason);
        RequestFinish(ToGrpc(r.status));
        return;
      }
      have_hello_ = true;
    } else if (in.kind_case() == v1::AgentMessage::kReport) {
      const v1::StepReport& report = in.report();
      {
        // Before the pipeline has it: its ack may come from the store writer before OnReport
        // returns.
        MutexLock lock(&mu_);
        unacked_.insert(report.seq());
      }
      Rejection r = service_->pipeline_->OnReport(hello_, report, AckHandle{handle_, report.seq()});
      if (!r.status.ok()) {
        {
          MutexLock lock(&mu_);
          unacked_.erase(report.seq());
        }
        service_->health_->Rejected(r.reason);
        v1::CollectorMessage msg;
        v1::Rejection* rej = msg.mutable_rejection();
        rej->set_seq(report.seq());
        rej->set_step(report.step());
        rej->set_code(static_cast<int32_t>(r.status.code()));
        rej->set_message(std::string(r.status.message()));
        Send(std::move(msg));
      }
    } else {
      service_->health_->Rejected(RejectReason::kInvalidReport);
      RequestFinish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                 in.kind_case() == v1::AgentMessage::kHello
                                     ? "a stream sends exactly one Hello"
                                     : "empty AgentMessage"));
      return;
    }
    Read();
  }

  void OnWriteDone(bool ok) override {
    RANKSCOPE_TSAN_ACQUIRE(this);
    MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      // The peer is gone; nothing more can be written.
      out_.clear();
      pending_acks_.clear();
      if (!finish_requested_) {
        finish_requested_ = true;
        finish_status_ = grpc::Status::OK;
      }
    }
    StartNextWriteLocked();
  }

  void OnCancel() override {
    RANKSCOPE_TSAN_ACQUIRE(this);
    RequestFinish(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    RANKSCOPE_TSAN_ACQUIRE(this);
    handle_->Detach();
    if (have_hello_) service_->pipeline_->StreamClosed(hello_, handle_);
    --service_->open_streams_;
    service_->health_->StreamClosed();
    delete this;
  }

  // Called through StreamHandle from any thread.
  void QueueAcks(absl::Span<const uint64_t> seqs) {
    MutexLock lock(&mu_);
    if (finish_requested_) return;
    for (uint64_t seq : seqs) unacked_.erase(seq);
    if (pending_acks_.size() + seqs.size() > service_->options_.max_pending_acks) {
      OverflowLocked(absl::StrCat(pending_acks_.size() + seqs.size(), " acks"));
      return;
    }
    pending_acks_.insert(pending_acks_.end(), seqs.begin(), seqs.end());
    StartNextWriteLocked();
  }

  // Ends the stream with `status` (see AckSink::Abandon). Called through StreamHandle.
  void Abandon(grpc::Status status) { RequestFinish(std::move(status)); }

  void Send(v1::CollectorMessage msg) {
    MutexLock lock(&mu_);
    if (finish_requested_) return;
    if (out_.size() >= service_->options_.max_queued_messages) {
      OverflowLocked(absl::StrCat(out_.size() + 1, " messages (rejections or controls)"));
      return;
    }
    out_.push_back(std::move(msg));
    StartNextWriteLocked();
  }

  // The hello watchdog, through StreamHandle: see StreamHandle::ExpireIfNoHello.
  bool ExpireIfNoHello(absl::Duration timeout) {
    MutexLock lock(&mu_);
    if (first_message_ || finish_requested_) return false;
    RequestFinishLocked(grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("no Hello within the collector's --hello_timeout (",
                     absl::FormatDuration(timeout),
                     "): the first message of a stream must be a Hello, sent at once")));
    return true;
  }

 private:
  void RequestFinish(grpc::Status status) {
    MutexLock lock(&mu_);
    RequestFinishLocked(std::move(status));
  }

  void RequestFinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finish_requested_) return;
    finish_requested_ = true;
    finish_status_ = std::move(status);
    // Undelivered acks are dropped: the agent resends those reports on its next stream.
    StartNextWriteLocked();
  }

  // The agent does not read what it is sent: ends the stream rather than queue more.
  void OverflowLocked(const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    service_->health_->StreamOverflowed();
    RequestFinishLocked(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("the agent does not read its stream: ", what,
                     " wait to be written, more than the collector queues for one stream; "
                     "the agent must read acks and rejections as they come")));
  }

  // Starts the next write, or Finish once nothing is left and a finish was requested (or the
  // agent half-closed and every report it handed over has been acked).
  void StartNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_) return;
    if (!finish_requested_ && read_closed_ && unacked_.empty() && pending_acks_.empty() &&
        out_.empty()) {
      finish_requested_ = true;
      finish_status_ = grpc::Status::OK;
    }
    if (!finish_requested_) {
      if (!pending_acks_.empty()) {
        ack_.Clear();
        ack_.mutable_ack()->mutable_seqs()->Add(pending_acks_.begin(), pending_acks_.end());
        pending_acks_.clear();
        StartWriteLocked(ack_);
        return;
      }
      if (!out_.empty()) {
        const v1::CollectorMessage msg = std::move(out_.front());
        out_.pop_front();
        StartWriteLocked(msg);
        return;
      }
      return;
    }
    finished_ = true;
    RANKSCOPE_TSAN_RELEASE(this);
    Finish(finish_status_);
  }

  void StartWriteLocked(const v1::CollectorMessage& msg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool own_buffer = false;
    current_.Clear();
    // Serializing a message we built cannot fail short of running out of memory.
    grpc::SerializationTraits<v1::CollectorMessage>::Serialize(msg, &current_, &own_buffer)
        .IgnoreError();
    writing_ = true;
    RANKSCOPE_TSAN_RELEASE(this);
    StartWrite(&current_);
  }

  IngestService* const service_;
  const std::shared_ptr<StreamHandle> handle_;
  // The next message is parsed into a fresh AgentMessage on arena_ (reset first); nothing parsed
  // before is referenced by then.
  void Read() {
    {
      // A finish may have been requested from inside this reaction (e.g. the store writer
      // abandoned this stream while OnReport enqueued): no read is started after it.
      MutexLock lock(&mu_);
      if (finish_requested_) return;
    }
    arena_.Reset();
    in_ = google::protobuf::Arena::CreateMessage<v1::AgentMessage>(&arena_);
    RANKSCOPE_TSAN_RELEASE(this);  // after the last access to a member before the hand-off
    StartRead(&in_buf_);
  }

  alignas(16) char arena_block_[kArenaBlockBytes];  // reactor callbacks only, through arena_
  google::protobuf::Arena arena_;                   // reactor callbacks only
  v1::AgentMessage* in_ = nullptr;                  // on arena_; reactor callbacks only
  grpc::ByteBuffer in_buf_;                         // the raw message read; reactor callbacks only
  uint64_t messages_read_ = 0;                      // reactor callbacks only
  v1::Hello hello_;                                 // set once, before have_hello_
  bool have_hello_ = false;

  Mutex mu_;
  bool first_message_ ABSL_GUARDED_BY(mu_) = false;  // a message was read (hello or not)
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;    // the agent half-closed (or the call ended)
  // Sequence numbers handed to the pipeline and neither acked nor rejected yet.
  absl::flat_hash_set<uint64_t> unacked_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::CollectorMessage> out_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> pending_acks_ ABSL_GUARDED_BY(mu_);
  v1::CollectorMessage ack_ ABSL_GUARDED_BY(mu_);  // reused for every coalesced Ack
  grpc::ByteBuffer current_ ABSL_GUARDED_BY(mu_);  // the write in flight, serialized
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

void StreamHandle::Ack(absl::Span<const uint64_t> seqs) {
  MutexLock lock(&mu_);
  if (reactor_ != nullptr) reactor_->QueueAcks(seqs);
}

void StreamHandle::Abandon(const absl::Status& why) {
  MutexLock lock(&mu_);
  if (reactor_ != nullptr) reactor_->Abandon(ToGrpc(why));
}

bool StreamHandle::ExpireIfNoHello(absl::Duration timeout) {
  MutexLock lock(&mu_);
  return reactor_ != nullptr && reactor_->ExpireIfNoHello(timeout);
}

void StreamHandle::SendControl(const v1::Control& control) {
  MutexLock lock(&mu_);
  if (reactor_ == nullptr) return;
  v1::CollectorMessage msg;
  *msg.mutable_control() = control;
  reactor_->Send(std::move(msg));
}

IngestService::IngestService(StepPipeline* pipeline, HealthMetrics* health, IngestOptions options)
    : pipeline_(pipeline), health_(health), options_(options) {
  if (options_.hello_timeout > absl::ZeroDuration())
    watcher_ = std::thread([this] { WatchLoop(); });
}

IngestService::~IngestService() {
  {
    MutexLock lock(&watch_mu_);
    stopping_ = true;
  }
  if (watcher_.joinable()) watcher_.join();
}

void IngestService::WatchHello(std::weak_ptr<StreamHandle> stream) {
  if (options_.hello_timeout <= absl::ZeroDuration()) return;
  MutexLock lock(&watch_mu_);
  watched_.emplace_back(absl::Now() + options_.hello_timeout, std::move(stream));
}

void IngestService::WatchLoop() {
  pthread_setname_np(pthread_self(), "rs-hello-watch");
  watch_mu_.Lock();
  // Evaluated by absl with watch_mu_ held.
  auto queued = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) {
    return stopping_ || !watched_.empty();
  };
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) { return stopping_; };
  while (!stopping_) {
    if (watched_.empty()) {
      watch_mu_.Await(absl::Condition(&queued));
      continue;
    }
    // Entries are in deadline order (one timeout for all): only the front can be due.
    if (const absl::Time next = watched_.front().first; next > absl::Now()) {
      watch_mu_.AwaitWithDeadline(absl::Condition(&stopping), next);
      continue;
    }
    std::shared_ptr<StreamHandle> handle = watched_.front().second.lock();
    watched_.pop_front();
    if (handle == nullptr) continue;  // the stream has ended
    watch_mu_.Unlock();               // the stream's locks are never taken under watch_mu_
    const bool expired = handle->ExpireIfNoHello(options_.hello_timeout);
    handle.reset();
    watch_mu_.Lock();
    if (expired) health_->HelloTimedOut();
  }
  watch_mu_.Unlock();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* IngestService::Stream(
    grpc::CallbackServerContext* context) {
  // Counted here, atomically with the check: of N streams arriving at once only max_streams
  // pass. A refused stream stays counted until its OnDone, like any other.
  const bool over_limit = open_streams_.fetch_add(1) >= options_.max_streams;
  return new StreamReactor(this, over_limit);
}

}  // namespace rankscope::collector
