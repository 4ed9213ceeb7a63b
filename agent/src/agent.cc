// The agent's implementation: a ReportRing fed by Record(), one sender thread per agent that
// owns the gRPC stream, and one reader thread per open stream that applies acks and controls.
//
// Thread safety: every field shared between the training thread, the sender and the reader is
// guarded by mu_. Stream objects (context, stream) are owned by the sender thread; the only
// cross-thread access to them is ClientContext::TryCancel() from Close(), which gRPC allows.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "backoff.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/agent.h"
#include "rankscope/v1/rankscope.grpc.pb.h"
#include "report_queue.h"

namespace rankscope {
namespace {

namespace v1 = ::rankscope::v1;

bool ValidJobName(const std::string& job) {
  if (job.empty() || job.size() > 128) return false;
  for (char c : job) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::string Hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

class AgentImpl final : public Agent {
 public:
  explicit AgentImpl(AgentOptions options)
      : options_(std::move(options)),
        ring_(options_.queue_capacity, options_.sketch_dim),
        backoff_(options_.initial_backoff, options_.max_backoff,
                 static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^
                     (static_cast<uint64_t>(options_.rank) << 32)) {
    if (options_.host.empty()) options_.host = Hostname();
    grpc::ChannelArguments args;
    // Keep the channel's own reconnect quick; our backoff governs stream attempts.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options_.max_backoff)));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    channel_ = grpc::CreateCustomChannel(options_.collector_address,
                                         grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Ingest::NewStub(channel_);
    sender_ = std::thread([this] { SenderLoop(); });
  }

  ~AgentImpl() override {
    Close(absl::ZeroDuration()).IgnoreError();
  }

  absl::Status Record(const StepReport& report) override {
    const int64_t now = absl::GetCurrentTimeNanos();
    absl::MutexLock lock(&mu_);
    if (closed_) {
      return absl::FailedPreconditionError("rankscope agent is closed");
    }
    if (report.sketch.size() != options_.sketch_dim &&
        (!current_sketch_dim_ || report.sketch.size() != *current_sketch_dim_)) {
      ++stats_.invalid;
      return absl::InvalidArgumentError(
          absl::StrCat("sketch has ", report.sketch.size(), " values, agent uses sketch_dim ",
                       options_.sketch_dim));
    }
    if (ring_.Push(report, now)) {  // the oldest queued report was overwritten
      ++stats_.dropped;
      --outstanding_;
    }
    ++stats_.recorded;
    ++outstanding_;
    return absl::OkStatus();
  }

  absl::Status Flush(absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return outstanding_ == 0 || sender_done_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&drained), timeout);
    if (outstanding_ == 0) return absl::OkStatus();
    return absl::DeadlineExceededError(
        absl::StrCat(outstanding_, " rankscope reports not acknowledged by the collector at ",
                     options_.collector_address, " within ", absl::FormatDuration(timeout)));
  }

  absl::Status Close(absl::Duration timeout) override {
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return close_status_;
    }
    absl::Status flushed = Flush(timeout);
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      stopping_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    if (sender_.joinable()) sender_.join();
    absl::MutexLock lock(&mu_);
    // What never got acked is lost: count it.
    stats_.dropped += outstanding_;
    outstanding_ = 0;
    close_status_ = flushed;
    return flushed;
  }

  AgentStats stats() const override {
    absl::MutexLock lock(&mu_);
    AgentStats s = stats_;
    s.queued = ring_.size();
    s.unacked = unacked_.size();
    return s;
  }

  std::optional<AgentControl> control() const override {
    absl::MutexLock lock(&mu_);
    return control_;
  }

  const AgentOptions& options() const override { return options_; }

 private:
  using MessagePtr = std::shared_ptr<const v1::AgentMessage>;

  // Builds the wire message for one report (on the sender thread: it allocates).
  MessagePtr BuildMessage(const internal::QueuedReport& q, uint64_t seq, uint64_t dropped) {
    auto msg = std::make_shared<v1::AgentMessage>();
    v1::StepReport* r = msg->mutable_report();
    r->set_seq(seq);
    r->set_step(q.step);
    r->set_loss(q.loss);
    r->set_grad_norm(q.grad_norm);
    r->mutable_sketch()->Add(q.sketch.begin(), q.sketch.end());
    r->set_recorded_unix_nanos(q.recorded_unix_nanos);
    r->set_dropped_total(dropped);
    if (q.reduced_grad_fingerprint) r->set_reduced_grad_fingerprint(*q.reduced_grad_fingerprint);
    if (q.param_fingerprint) r->set_param_fingerprint(*q.param_fingerprint);
    if (q.reduced_grad_norm) r->set_reduced_grad_norm(*q.reduced_grad_norm);
    if (q.step_time_seconds) r->set_step_time_seconds(*q.step_time_seconds);
    r->set_local_batch_size(q.local_batch_size);
    return msg;
  }

  v1::AgentMessage HelloMessage() const {
    v1::AgentMessage msg;
    v1::Hello* h = msg.mutable_hello();
    h->set_job(options_.job);
    h->set_rank(options_.rank);
    h->set_world_size(options_.world_size);
    h->set_sketch_dim(options_.sketch_dim);
    h->set_sketch_seed(options_.sketch_seed);
    h->set_attempt(options_.attempt);
    h->set_host(options_.host);
    h->set_agent_version(kAgentVersion);
    h->set_framework_version(options_.framework_version);
    h->set_auth_token(options_.auth_token);
    return msg;
  }

  void SenderLoop() {
    while (true) {
      RunStream();
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      const absl::Duration delay = backoff_.Next();
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop), delay);
      if (stopping_) break;
      ++stats_.reconnects;
    }
    absl::MutexLock lock(&mu_);
    sender_done_ = true;
  }

  // One stream's life: hello, resend what is unacked, then stream new reports until the stream
  // breaks or the agent stops.
  void RunStream() {
    auto context = std::make_unique<grpc::ClientContext>();
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      context_ = context.get();
      stream_broken_ = false;
    }
    std::shared_ptr<grpc::ClientReaderWriter<v1::AgentMessage, v1::CollectorMessage>> stream =
        stub_->Stream(context.get());
    std::thread reader;
    bool ok = stream->Write(HelloMessage());
    if (ok) {
      {
        absl::MutexLock lock(&mu_);
        stats_.connected = true;
      }
      reader = std::thread([this, stream] { ReaderLoop(stream.get()); });
      ok = ResendUnacked(stream.get());
      while (ok) {
        internal::QueuedReport* q = &scratch_;
        uint64_t seq, dropped;
        {
          absl::MutexLock lock(&mu_);
          auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return !ring_.empty() || stopping_ || stream_broken_;
          };
          mu_.Await(absl::Condition(&ready));
          if (stopping_ || stream_broken_) break;
          ring_.Pop(q);
          seq = next_seq_++;
          dropped = stats_.dropped;
          ++in_transit_;
        }
        MessagePtr msg = BuildMessage(*q, seq, dropped);
        {
          absl::MutexLock lock(&mu_);
          --in_transit_;
          if (unacked_.size() >= std::max<size_t>(options_.max_unacked, 1)) {
            unacked_.erase(unacked_.begin());  // oldest
            ++stats_.dropped;
            --outstanding_;
          }
          unacked_.emplace(seq, msg);
        }
        ok = stream->Write(*msg);
        if (ok) {
          absl::MutexLock lock(&mu_);
          ++stats_.sent;
        }
      }
    }
    // Half-close, or cancel if we are stopping or the stream is already broken.
    {
      absl::MutexLock lock(&mu_);
      stats_.connected = false;
      if (stopping_ || !ok) context->TryCancel();
    }
    if (ok) stream->WritesDone();
    if (reader.joinable()) reader.join();
    grpc::Status status = stream->Finish();
    absl::MutexLock lock(&mu_);
    context_ = nullptr;
    if (!status.ok() && !stopping_) {
      last_error_ = status.error_message();
      // Log once per distinct failure, quietly: the training job must not be spammed.
      if (!warned_down_) {
        warned_down_ = true;
        const bool refused = status.error_code() != grpc::StatusCode::UNAVAILABLE &&
                             status.error_code() != grpc::StatusCode::CANCELLED &&
                             status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
        std::fprintf(stderr,
                     "rankscope: collector %s %s (%s); training continues, reports are "
                     "buffered and resent\n",
                     options_.collector_address.c_str(),
                     refused ? "refused this rank's stream" : "unavailable",
                     status.error_message().c_str());
      }
    }
  }

  // Resends every unacked report in sequence order. Returns false if the stream broke.
  bool ResendUnacked(grpc::ClientReaderWriter<v1::AgentMessage, v1::CollectorMessage>* stream) {
    uint64_t next = 0;
    while (true) {
      MessagePtr msg;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_ || stream_broken_) return false;
        auto it = unacked_.lower_bound(next);
        if (it == unacked_.end()) return true;
        next = it->first + 1;
        msg = it->second;
      }
      if (!stream->Write(*msg)) return false;
      absl::MutexLock lock(&mu_);
      ++stats_.sent;
    }
  }

  void ReaderLoop(grpc::ClientReaderWriter<v1::AgentMessage, v1::CollectorMessage>* stream) {
    v1::CollectorMessage msg;
    bool first = true;
    while (stream->Read(&msg)) {
      absl::MutexLock lock(&mu_);
      if (first) {
        first = false;
        backoff_.Reset();
        warned_down_ = false;
      }
      switch (msg.kind_case()) {
        case v1::CollectorMessage::kAck:
          for (uint64_t seq : msg.ack().seqs()) {
            if (unacked_.erase(seq) > 0) {
              ++stats_.acked;
              --outstanding_;
            }
          }
          break;
        case v1::CollectorMessage::kRejection:
          if (unacked_.erase(msg.rejection().seq()) > 0) {
            ++stats_.rejected;
            --outstanding_;
          }
          break;
        case v1::CollectorMessage::kControl: {
          const v1::Control& c = msg.control();
          if (!control_ || c.generation() > control_->generation) {
            AgentControl ctl;
            ctl.generation = c.generation();
            ctl.apply_at_step = c.apply_at_step();
            ctl.enabled = c.enabled();
            ctl.every = std::max<uint32_t>(c.every(), 1);
            ctl.sketch_dim = c.sketch_dim();
            control_ = ctl;
            if (ctl.sketch_dim != 0) current_sketch_dim_ = ctl.sketch_dim;
          }
          break;
        }
        case v1::CollectorMessage::KIND_NOT_SET:
          break;
      }
    }
    absl::MutexLock lock(&mu_);
    stream_broken_ = true;
  }

  AgentOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Ingest::Stub> stub_;
  internal::QueuedReport scratch_;  // sender thread only

  mutable absl::Mutex mu_;
  internal::ReportRing ring_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, MessagePtr> unacked_ ABSL_GUARDED_BY(mu_);
  internal::Backoff backoff_ ABSL_GUARDED_BY(mu_);
  AgentStats stats_ ABSL_GUARDED_BY(mu_);
  std::optional<AgentControl> control_ ABSL_GUARDED_BY(mu_);
  std::optional<uint32_t> current_sketch_dim_ ABSL_GUARDED_BY(mu_);
  // Reports recorded and neither acked, rejected nor dropped yet.
  uint64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t in_transit_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool sender_done_ ABSL_GUARDED_BY(mu_) = false;
  bool warned_down_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  absl::Status close_status_ ABSL_GUARDED_BY(mu_);

  std::thread sender_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(AgentOptions options) {
  if (!ValidJobName(options.job)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job name '", options.job, "' must be 1-128 characters of [A-Za-z0-9_.:-]"));
  }
  if (options.world_size == 0) {
    return absl::InvalidArgumentError("world_size must be >= 1");
  }
  if (options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", options.rank, " >= world_size ",
                                                   options.world_size));
  }
  if (options.sketch_dim == 0 || options.sketch_dim > kMaxSketchDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("sketch_dim ", options.sketch_dim, " must be in [1, ", kMaxSketchDim, "]"));
  }
  if (options.collector_address.empty()) {
    return absl::InvalidArgumentError("collector_address is empty");
  }
  if (options.queue_capacity == 0) options.queue_capacity = 1;
  return std::unique_ptr<Agent>(new AgentImpl(std::move(options)));
}

}  // namespace rankscope
