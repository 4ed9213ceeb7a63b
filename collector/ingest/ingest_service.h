// IngestService: the gRPC edge for agents (rankscope.v1.Ingest/Stream), callback API.
//
// One StreamReactor per stream. The first message must be a Hello (else FAILED_PRECONDITION);
// a rejected hello finishes the stream with the rejection's status. Reports are validated and
// handed to the StepPipeline; a refused report is answered with a Rejection message and the
// stream goes on. Outbound messages (acks from the store writer thread, controls from the
// query service) are queued and written one at a time (at most one write in flight), with acks
// coalesced into one Ack message per write.
//
// Limits (IngestOptions): at most `max_streams` streams open at once (RESOURCE_EXHAUSTED beyond).
// A message over `max_message_bytes` ends its stream with RESOURCE_EXHAUSTED naming the flag,
// counted as message_too_large; the server builder's hard limit (see Collector) sits at twice
// that, so a grossly oversized message is refused by gRPC itself before it is buffered. A stream
// whose first message has not arrived `hello_timeout` after it opened is ended with
// DEADLINE_EXCEEDED and counted (rankscope_streams_hello_timeout_total), so streams that never
// say hello cannot hold the --max_streams slots. What waits to be written to one stream is
// bounded: more than `max_queued_messages` Rejections/Controls, or more than `max_pending_acks`
// acked sequence numbers, not yet written (the agent does not read) end the stream with
// RESOURCE_EXHAUSTED, counted (rankscope_streams_overflowed_total); the stream reads nothing more.
//
// End of a stream: when the agent half-closes, the stream stays open until every report it
// handed to the pipeline is acked (its step stored) or rejected, then finishes with OK; the
// acks are written first. A cancelled call, an abandoned stream (AckSink::Abandon) or an overflow
// ends it at once; undelivered acks are dropped then (the agent resends those reports).
//
// The method is registered raw (ByteBuffer in and out) and the reactor parses each message
// itself: gRPC's own parse failure reaches a callback reactor as a plain failed read, which is
// indistinguishable from the agent half-closing, so random or truncated bytes would end the stream
// with OK. Parsed here, they end it with INVALID_ARGUMENT saying which message failed.
//
// Thread safety: reactions run on gRPC's callback threads; the reactor's outbound queue is
// guarded by its own mutex; AgentStream handles may be called from any thread. One thread of the
// service's own ("rs-hello-watch") ends the streams whose hello is late.
#ifndef RANKSCOPE_COLLECTOR_INGEST_INGEST_SERVICE_H_
#define RANKSCOPE_COLLECTOR_INGEST_INGEST_SERVICE_H_

#include <atomic>
#include <cstddef>
#include <deque>
#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "collector/metrics/health_metrics.h"
#include "collector/pipeline/pipeline.h"
#include "common/mutex.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

namespace rankscope::collector {

struct IngestOptions {
  size_t max_streams = 10'000;
  size_t max_message_bytes = 0;  // 0: no check here (the server builder's limit only)
  // A stream's first message must arrive within this (--hello_timeout); <= 0: no deadline.
  absl::Duration hello_timeout = absl::Seconds(5);
  // Per stream: Rejections and Controls waiting to be written, and acked sequence numbers
  // waiting (coalesced into the next Ack). An agent that reads its stream never comes near them
  // (it keeps at most max_unacked reports in flight, 8,192 by default).
  size_t max_queued_messages = 1024;
  size_t max_pending_acks = 65'536;
};

class StreamHandle;

class IngestService final : public v1::Ingest::WithRawCallbackMethod_Stream<v1::Ingest::Service> {
 public:
  IngestService(StepPipeline* pipeline, HealthMetrics* health, IngestOptions options);
  // Stops the hello watchdog. The gRPC server must have been shut down (no stream left).
  ~IngestService() override;

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;

  size_t open_streams() const { return open_streams_.load(); }

 private:
  friend class StreamReactor;
  // Registers a new stream for the hello deadline (FIFO: every stream has the same timeout).
  void WatchHello(std::weak_ptr<StreamHandle> stream);
  void WatchLoop();

  StepPipeline* const pipeline_;
  HealthMetrics* const health_;
  const IngestOptions options_;
  std::atomic<size_t> open_streams_{0};

  Mutex watch_mu_;
  // Streams in the order they opened, each with its hello deadline. An entry whose stream ended
  // or said hello is dropped when its deadline comes: one entry per stream opened within the
  // last hello_timeout.
  std::deque<std::pair<absl::Time, std::weak_ptr<StreamHandle>>> watched_
      ABSL_GUARDED_BY(watch_mu_);
  bool stopping_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watcher_;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_INGEST_INGEST_SERVICE_H_
