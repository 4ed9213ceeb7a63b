// The agent's orchestration: AgentImpl (agent_impl.h, which states its threads and locking
// contract) and Agent::Create.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "agent_impl.h"
#include "backoff.h"
#include "common/client_tls.h"
#include "common/collector_dns.h"
#include "common/collector_shard.h"
#include "common/job_name.h"
#include "common/keepalive.h"
#include "common/mutex.h"
#include "common/sketch_dim.h"
#include "common/tsan.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/v1/rankscope.grpc.pb.h"
#include "report_queue.h"
#include "send_poller.h"
#include "unacked_buffer.h"
#include "wire.h"

namespace rankscope {
namespace internal {
namespace {

std::string Hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

// "host:pid:16 hex digits": unique per agent, stable across its reconnects.
std::string NewInstanceId(const std::string& host) {
  std::random_device device;
  const uint64_t random = (static_cast<uint64_t>(device()) << 32) ^ device() ^
                          static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  return absl::StrCat(host.substr(0, 64), ":", getpid(), ":", absl::Hex(random, absl::kZeroPad16));
}

// True for the codes that mean the collector will refuse this stream again, whatever the
// backoff: the job's shape differs (FAILED_PRECONDITION), or this rank may not report
// (PERMISSION_DENIED). ALREADY_EXISTS (another process or run holds the rank) is not: it lasts
// while the holder's streams live, and a crashed holder's stream is dropped by the collector's
// keepalive, so the agent retries (AgentStats::held_elsewhere).
bool IsPermanentRefusal(grpc::StatusCode code) {
  return code == grpc::StatusCode::FAILED_PRECONDITION ||
         code == grpc::StatusCode::PERMISSION_DENIED;
}

// What a failed stream means, in the warning a person reads.
const char* DescribeFailure(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "unavailable";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "refused this rank's credentials";
    default:
      return "refused this rank's stream";
  }
}

// The name of the status's code ("UNAVAILABLE"): gRPC's codes are absl's canonical codes,
// number for number.
std::string StatusCodeName(const grpc::Status& status) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()));
}

// A replica summary (StepReport's param_* / reduced_grad_*) is absent (no projections) or holds
// kReplicaProjections finite values, a finite rounding >= 0 and a precision in [1, 53], and
// comes with its fingerprint.
bool SummaryValid(absl::Span<const double> projections, double rounding, bool has_fingerprint,
                  uint32_t precision) {
  if (projections.empty()) return true;
  bool finite = std::isfinite(rounding) && rounding >= 0.0;
  for (double p : projections) finite = finite && std::isfinite(p);
  return finite && has_fingerprint && projections.size() == kReplicaProjections && precision >= 1 &&
         precision <= 53;
}

}  // namespace

AgentImpl::AgentImpl(AgentOptions options, std::string collector,
                     std::shared_ptr<grpc::ChannelCredentials> credentials)
    : options_(std::move(options)),
      collector_(std::move(collector)),
      ring_(options_.queue_capacity, options_.sketch_dim, options_.bucket_names.size()),
      unacked_(options_.max_unacked),
      backoff_(options_.initial_backoff, options_.max_backoff,
               static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^
                   (static_cast<uint64_t>(options_.rank) << 32)),
      sketch_dims_{options_.sketch_dim} {
  if (options_.host.empty()) options_.host = Hostname();
  if (options_.instance_id.empty()) options_.instance_id = NewInstanceId(options_.host);
  grpc::ChannelArguments args;
  // Keep the channel's own reconnect quick; our backoff governs stream attempts.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options_.max_backoff)));
  keepalive::ApplyToChannel(&args);  // a dead collector noticed within 40 s (common/keepalive.h)
  // Each agent owns its connection, as a rank in its own process does; agents created in one
  // process (loadgen, tests, benchmarks) would otherwise share one TCP connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  tls::ApplyTargetName(options_.tls, &args);
  channel_ = grpc::CreateCustomChannel(collector_, credentials, args);
  stub_ = v1::Ingest::NewStub(channel_);
  sender_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "rs-agent-send");  // visible in top -H and py-spy
    SenderLoop();
  });
  SendPoller::Get().Register(this);
}

AgentImpl::~AgentImpl() { Close(absl::ZeroDuration()).IgnoreError(); }

absl::Status AgentImpl::Record(const StepReport& report) {
  const int64_t now = absl::GetCurrentTimeNanos();
  bool wake;
  {
    MutexLock lock(&mu_);
    if (closed_) {
      return absl::FailedPreconditionError("rankscope agent is closed");
    }
    if (refused_) {
      ++stats_.rejected;
      return absl::FailedPreconditionError(
          absl::StrCat("the collector refused this rank: ", last_error_));
    }
    if (!SketchDimAccepted(sketch_dims_, report.sketch.size())) {
      ++stats_.invalid;
      return absl::InvalidArgumentError(absl::StrCat("sketch has ", report.sketch.size(),
                                                     " values, agent uses sketch_dim ",
                                                     options_.sketch_dim));
    }
    if (!report.bucket_norms.empty() &&
        report.bucket_norms.size() != options_.bucket_names.size()) {
      ++stats_.invalid;
      return absl::InvalidArgumentError(
          absl::StrCat("bucket_norms has ", report.bucket_norms.size(), " values, the agent names ",
                       options_.bucket_names.size(), " buckets"));
    }
    if (!report.reduced_sketch.empty() &&
        (report.reduced_sketch.size() != report.sketch.size() ||
         report.reduced_grad_mantissa_bits < 1 || report.reduced_grad_mantissa_bits > 53)) {
      ++stats_.invalid;
      return absl::InvalidArgumentError(
          absl::StrCat("reduced_sketch has ", report.reduced_sketch.size(),
                       " values and mantissa bits ", report.reduced_grad_mantissa_bits,
                       "; the sketch has ", report.sketch.size(), " and bits must be in [1, 53]"));
    }
    if (!SummaryValid(report.param_projections, report.param_rounding,
                      report.param_fingerprint.has_value(), 53) ||
        !SummaryValid(report.reduced_grad_projections, report.reduced_grad_rounding,
                      report.reduced_grad_fingerprint.has_value(), report.reduced_grad_precision)) {
      ++stats_.invalid;
      return absl::InvalidArgumentError(absl::StrCat(
          "a replica summary (param_projections: ", report.param_projections.size(),
          " values, reduced_grad_projections: ", report.reduced_grad_projections.size(), ") needs ",
          kReplicaProjections,
          " finite values, a finite rounding >= 0, its fingerprint and (reduced gradient) a "
          "precision in [1, 53]"));
    }
    if (ring_.Push(report, now)) {  // the oldest queued report was overwritten
      ++stats_.dropped;
      --outstanding_;
    }
    ++stats_.recorded;
    ++outstanding_;
    // No thread is woken for a report (a wake-up is a syscall, and an IPI, on the training
    // thread): the SendPoller finds it within kMinSendPoll..kMaxSendPoll (send_poller.h), or
    // at once when the ring gets half full.
    wake = ring_.size() == wake_threshold_;
  }
  if (wake) SendPoller::Get().Wake();
  return absl::OkStatus();
}

absl::Status AgentImpl::Flush(absl::Duration timeout) {
  MutexLock lock(&mu_);
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return outstanding_ == 0 || sender_done_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&drained), timeout);
  if (outstanding_ == 0) return absl::OkStatus();
  return absl::DeadlineExceededError(
      absl::StrCat(outstanding_, " rankscope reports not acknowledged by the collector at ",
                   collector_, " within ", absl::FormatDuration(timeout)));
}

absl::Status AgentImpl::Close(absl::Duration timeout) {
  {
    MutexLock lock(&mu_);
    if (closed_) return close_status_;
  }
  absl::Status flushed = Flush(timeout);
  {
    MutexLock lock(&mu_);
    closed_ = true;
    stopping_ = true;  // the sender thread cancels the stream and returns
  }
  {
    MutexLock lock(&wake_mu_);
    stop_requested_ = true;
  }
  if (sender_.joinable()) sender_.join();
  SendPoller::Get().Unregister(this);
  MutexLock lock(&mu_);
  // What never got acked is lost: count it.
  stats_.dropped += outstanding_;
  outstanding_ = 0;
  close_status_ = flushed;
  return flushed;
}

AgentStats AgentImpl::stats() const {
  MutexLock lock(&mu_);
  AgentStats s = stats_;
  s.queued = ring_.size();
  s.unacked = unacked_.size();
  s.last_error = last_error_;
  s.refused = refused_;
  s.held_elsewhere = held_elsewhere_;
  return s;
}

std::optional<AgentControl> AgentImpl::control() const {
  MutexLock lock(&mu_);
  return control_;
}

void AgentImpl::StreamCall::OnWriteDone(bool ok) {
  RANKSCOPE_TSAN_ACQUIRE(this);
  agent_->OnWriteDone(this, ok);
}

void AgentImpl::StreamCall::OnReadDone(bool ok) {
  RANKSCOPE_TSAN_ACQUIRE(this);
  agent_->OnReadDone(this, ok);
}

void AgentImpl::StreamCall::OnDone(const grpc::Status& status) {
  RANKSCOPE_TSAN_ACQUIRE(this);
  agent_->OnStreamDone(status);
}

void AgentImpl::SenderLoop() {
  while (true) {
    RunStream();
    absl::Duration delay;
    {
      MutexLock lock(&mu_);
      if (stopping_ || refused_) break;
      delay = backoff_.Next();
    }
    {
      // Waits on wake_mu_, not mu_, so that Record() never evaluates a waiter's condition.
      MutexLock lock(&wake_mu_);
      wake_mu_.AwaitWithTimeout(absl::Condition(&stop_requested_), delay);
    }
    MutexLock lock(&mu_);
    if (stopping_ || refused_) break;
    ++stats_.reconnects;
  }
  MutexLock lock(&mu_);
  sender_done_ = true;
}

void AgentImpl::Wake() {
  MutexLock lock(&wake_mu_);
  wake_ = true;
}

void AgentImpl::WaitForWake(absl::Duration timeout) {
  MutexLock lock(&wake_mu_);
  auto woken = [this]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(wake_mu_) { return wake_ || stop_requested_; };
  wake_mu_.AwaitWithTimeout(absl::Condition(&woken), timeout);
  wake_ = false;
}

bool AgentImpl::HasWorkLocked() const { return unacked_.HasResend() || !ring_.empty(); }

bool AgentImpl::PollSend() {
  StreamCall* call;
  {
    MutexLock lock(&mu_);
    if (live_call_ == nullptr || writing_ || stopping_ || stream_broken_ || !HasWorkLocked()) {
      return false;
    }
    writing_ = true;
    call = live_call_;
    ++poller_starting_;
  }
  MessagePtr msg = NextMessage();
  const bool started = msg != nullptr;
  if (started) {
    call->current = std::move(msg);
    const v1::AgentMessage* next = call->current.get();
    RANKSCOPE_TSAN_RELEASE(call);  // after the last access to *call before the hand-off
    call->StartWrite(next);        // from here on the write token is the chain's
  }
  MutexLock lock(&mu_);
  if (!started) writing_ = false;
  --poller_starting_;
  return started;
}

// Long: the sender thread's life in one loop (open a stream, write the hello, mark the resend
// range, wait for its end, then stop, give up for good or back off and reconnect), so that its lock
// hand-offs read in one place.
void AgentImpl::RunStream() {
  auto call = std::make_unique<StreamCall>(this);
  std::optional<AgentControl> control;  // stated in the hello (a restarted collector's view)
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    control = control_;
    stream_broken_ = false;
    stream_done_ = false;
    writing_ = true;  // the hello
    // Every report sent before this stream and not acked is resent first, in seq order.
    unacked_.StartResend(next_seq_);
  }
  call->hello = HelloMessage(options_, control);
  stub_->async()->Stream(&call->context, call.get());
  RANKSCOPE_TSAN_RELEASE(call.get());
  call->StartWrite(&call->hello);
  call->StartRead(&call->in);
  call->AddHold();  // for the poller's StartWrite calls, made outside reactions
  call->StartCall();
  {
    MutexLock lock(&mu_);
    live_call_ = call.get();  // from now on the poller may start writes on it
  }
  // The stream runs by itself (OnWriteDone chains writes, the poller starts them, OnReadDone
  // applies acks): the sender only waits for its end.
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stopping_ || stream_broken_) break;
    }
    WaitForWake(absl::Seconds(1));
  }
  bool stopping;
  {
    MutexLock lock(&mu_);
    stats_.connected = false;
    stopping = stopping_;
    live_call_ = nullptr;
    // A poller StartWrite in progress needs the hold: let it return first.
    auto no_poller = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return poller_starting_ == 0; };
    mu_.Await(absl::Condition(&no_poller));
  }
  // A broken stream ends by itself (its status is on the way); a stopping agent cancels.
  RANKSCOPE_TSAN_RELEASE(call.get());
  if (stopping) call->context.TryCancel();
  call->RemoveHold();
  grpc::Status status;
  {
    MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stream_done_; };
    mu_.Await(absl::Condition(&done));
    status = stream_status_;
  }
  call.reset();
  // What to tell the job's stderr, printed once mu_ is released: a write to stderr may block (a
  // pipe nobody reads), and must then block this thread only, never the poller or a Record().
  std::string note;
  {
    MutexLock lock(&mu_);
    note = StreamEndNoteLocked(status);
  }
  if (!note.empty()) std::fputs(note.c_str(), stderr);
}

std::string AgentImpl::StreamEndNoteLocked(const grpc::Status& status) {
  if (status.ok() || stopping_) return "";
  last_error_ = absl::StrCat(StatusCodeName(status), ": ", status.error_message());
  if (IsPermanentRefusal(status.error_code())) return RefuseLocked();
  if (status.error_code() == grpc::StatusCode::ALREADY_EXISTS) {
    // Said once per episode: nothing of this rank is stored until the holder's streams are gone.
    if (held_elsewhere_) return "";
    held_elsewhere_ = true;
    return absl::StrCat("rankscope: collector ", collector_, " does NOT store job ", options_.job,
                        " group '", options_.group, "' rank ", options_.rank, ": ", last_error_,
                        "; this rank keeps its reports (bounded) and retries until the holder's "
                        "streams are gone, training continues\n");
  }
  // Said once per outage, quietly: the training job must not be spammed.
  if (warned_down_) return "";
  warned_down_ = true;
  return absl::StrCat("rankscope: collector ", collector_, " ",
                      DescribeFailure(status.error_code()), " (", last_error_, ")",
                      TransportHint(status),
                      "; training continues, reports are buffered and resent\n");
}

std::string AgentImpl::RefuseLocked() {
  refused_ = true;
  stats_.rejected += outstanding_;
  outstanding_ = 0;
  ring_.Clear();
  unacked_.Clear();
  return absl::StrCat("rankscope: collector ", collector_, " refused job ", options_.job,
                      " group '", options_.group, "' rank ", options_.rank, " for good (",
                      last_error_, "); this rank stops reporting to it, training continues\n");
}

std::string AgentImpl::TransportHint(const grpc::Status& status) const {
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE) return "";
  // GOAWAY too_many_pings: the connection worked, the collector's ping policy is older than the
  // agent's keepalive (docs/reliability.md "Keepalive"); TLS is not the problem.
  if (absl::StrContains(status.error_message(), "Too many pings")) {
    return "; the collector allows fewer keepalive pings than the agent sends (an older "
           "collector, or --grpc_agent_min_ping_interval above 30s): it closes an idle "
           "connection after a few; the agent reconnects and resends what is unacked, nothing "
           "is lost";
  }
  if (!options_.tls.enabled()) {
    return "; connecting in plaintext: if the collector serves TLS, give the agent its CA "
           "(tls_ca_file, RANKSCOPE_TLS_CA)";
  }
  if (options_.tls.cert_file.empty()) {
    return "; connecting over TLS without a client certificate: if the collector requires "
           "mutual TLS, give tls_cert_file/tls_key_file (RANKSCOPE_TLS_CERT/RANKSCOPE_TLS_KEY)";
  }
  return "; connecting over mutual TLS: check that the collector's CA signed this rank's "
         "certificate and that tls_ca_file signed the collector's";
}

MessagePtr AgentImpl::NextMessage() {
  uint64_t seq, dropped;
  {
    MutexLock lock(&mu_);
    if (stopping_ || stream_broken_) return nullptr;
    if (MessagePtr resend = unacked_.NextResend()) return resend;
    if (!ring_.Pop(&scratch_)) return nullptr;
    seq = next_seq_++;
    dropped = stats_.dropped;
  }
  // Allocates (and packs the sketch in its encoding): outside mu_.
  MessagePtr msg = ReportMessage(scratch_, seq, dropped, options_.sketch_encoding);
  MutexLock lock(&mu_);
  if (unacked_.Add(seq, msg)) {  // the oldest unacked report was forgotten
    ++stats_.dropped;
    --outstanding_;
  }
  return msg;
}

void AgentImpl::OnWriteDone(StreamCall* call, bool ok) {
  bool keep_writing = true;
  {
    MutexLock lock(&mu_);
    if (ok) {
      if (!call->hello_written) {
        call->hello_written = true;
        stats_.connected = true;
      } else {
        ++stats_.sent;
      }
    } else {
      stream_broken_ = true;
    }
    if (!ok || stopping_ || stream_broken_ || !HasWorkLocked()) {
      writing_ = false;  // the sender thread takes over when work arrives
      keep_writing = false;
    }
  }
  if (!keep_writing) {
    if (!ok) Wake();  // the sender reconnects
    return;
  }
  MessagePtr msg = NextMessage();
  if (msg == nullptr) {
    MutexLock lock(&mu_);
    writing_ = false;
    return;
  }
  call->current = std::move(msg);
  const v1::AgentMessage* next = call->current.get();
  RANKSCOPE_TSAN_RELEASE(call);  // after the last access to *call before the hand-off
  call->StartWrite(next);
}

void AgentImpl::OnReadDone(StreamCall* call, bool ok) {
  if (!ok) {
    {
      MutexLock lock(&mu_);
      stream_broken_ = true;
    }
    Wake();
    return;
  }
  bool stored_again = false;  // said below, without mu_ (a write to stderr may block)
  {
    MutexLock lock(&mu_);
    if (!call->received_any) {
      call->received_any = true;
      backoff_.Reset();
      warned_down_ = false;
      stored_again = held_elsewhere_;
      held_elsewhere_ = false;
    }
    const v1::CollectorMessage& msg = call->in;
    switch (msg.kind_case()) {
      case v1::CollectorMessage::kAck:
        break;  // below, without holding mu_ throughout
      case v1::CollectorMessage::kRejection:
        if (unacked_.Reject(msg.rejection().seq())) {
          ++stats_.rejected;
          --outstanding_;
        }
        break;
      case v1::CollectorMessage::kControl: {
        if (std::optional<AgentControl> ctl = NewerControl(msg.control(), control_)) {
          control_ = ctl;
          if (ctl->sketch_dim != 0) {
            sketch_dims_.retuned_dim = ctl->sketch_dim;
            sketch_dims_.apply_at_step = ctl->apply_at_step;
          }
        }
        break;
      }
      case v1::CollectorMessage::KIND_NOT_SET:
        break;
    }
  }
  if (stored_again) {
    std::fprintf(stderr,
                 "rankscope: collector %s now stores job %s group '%s' rank %u (the run that "
                 "held it is gone)\n",
                 collector_.c_str(), options_.job.c_str(), options_.group.c_str(), options_.rank);
  }
  if (call->in.kind_case() == v1::CollectorMessage::kAck) ApplyAcks(call->in.ack().seqs());
  RANKSCOPE_TSAN_RELEASE(call);
  call->StartRead(&call->in);
}

void AgentImpl::ApplyAcks(const google::protobuf::RepeatedField<uint64_t>& seqs) {
  constexpr int kChunk = 32;
  std::vector<MessagePtr> acked;
  acked.reserve(std::min(seqs.size(), kChunk));
  for (int begin = 0; begin < seqs.size(); begin += kChunk) {
    const int end = std::min(begin + kChunk, seqs.size());
    {
      MutexLock lock(&mu_);
      for (int i = begin; i < end; ++i) {
        MessagePtr message = unacked_.Ack(seqs.Get(i));
        if (message == nullptr) continue;
        acked.push_back(std::move(message));
        ++stats_.acked;
        --outstanding_;
      }
    }
    acked.clear();
  }
}

void AgentImpl::OnStreamDone(const grpc::Status& status) {
  MutexLock lock(&mu_);
  stream_status_ = status;
  stream_broken_ = true;
  stream_done_ = true;  // the sender waits for this on mu_
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(AgentOptions options) {
  if (absl::Status name = ValidateJobName(options.job, JobNameEcho::kQuote); !name.ok()) {
    return name;
  }
  if (options.world_size == 0) {
    return absl::InvalidArgumentError("world_size must be >= 1");
  }
  if (options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " >= world_size ", options.world_size));
  }
  if (options.sketch_dim == 0 || options.sketch_dim > kMaxSketchDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("sketch_dim ", options.sketch_dim, " must be in [1, ", kMaxSketchDim, "]"));
  }
  if (!SketchEncodingFromWire(static_cast<int>(options.sketch_encoding))) {
    return absl::InvalidArgumentError(
        absl::StrCat("sketch_encoding ", static_cast<int>(options.sketch_encoding),
                     " is not one of float32 (0), float16 (1), int8 (2)"));
  }
  if (absl::Status group = ValidateGroupName(options.group, JobNameEcho::kQuote); !group.ok()) {
    return group;
  }
  if (options.instance_id.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance_id has ", options.instance_id.size(), " characters; at most 128"));
  }
  if (options.run_id.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("run_id has ", options.run_id.size(), " characters; at most 128"));
  }
  // A fleet: every rank of the job picks the same shard of the list (common/collector_shard.h),
  // once, here; a shard that is down is retried like a lone collector, never skipped.
  absl::StatusOr<std::vector<std::string>> shards = ParseCollectorList(options.collector_address);
  if (!shards.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("collector_address: ", shards.status().message()));
  }
  if (options.bucket_names.size() > kMaxBucketNames) {
    return absl::InvalidArgumentError(absl::StrCat("bucket_names has ", options.bucket_names.size(),
                                                   " names; at most ", kMaxBucketNames));
  }
  for (const std::string& name : options.bucket_names) {
    if (name.size() > kMaxBucketNameLength) {
      return absl::InvalidArgumentError(absl::StrCat("bucket name \"", name.substr(0, 32),
                                                     "...\" has ", name.size(), " bytes; at most ",
                                                     kMaxBucketNameLength));
    }
  }
  *shards = ExpandCollectorName(*std::move(shards));
  std::string collector = PickCollector(*shards, options.job);
  if (options.queue_capacity == 0) options.queue_capacity = 1;
  if (!options.tls.enabled() && !options.tls.target_name.empty()) {
    return absl::InvalidArgumentError(
        "tls_target_name is set but TLS is off: give tls_ca_file (or a client certificate)");
  }
  auto credentials = tls::ChannelCredentials(options.tls);
  if (!credentials.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("agent TLS options: ", credentials.status().message()));
  }
  // Debian's libabsl is built without NDEBUG, so absl::Mutex runs its deadlock detector on every
  // lock in the process, ours and gRPC's: a global lock and a graph update per acquisition
  // (~25 ns uncontended, serializing under contention) and, with the default kAbort, a crash of
  // the training job if it ever suspects a lock-order cycle. A monitoring agent must neither slow
  // nor abort the job it watches, so it turns the detector off (it is a debugging aid; builds
  // with NDEBUG have it off already).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return std::unique_ptr<Agent>(
      new internal::AgentImpl(std::move(options), std::move(collector), std::move(*credentials)));
}

}  // namespace rankscope
