// IngestService: the gRPC edge for agents (rankscope.v1.Ingest/Stream), callback API.
//
// One StreamReactor per stream. The first message must be a Hello (else FAILED_PRECONDITION);
// a rejected hello finishes the stream with the rejection's status. Reports are validated and
// handed to the StepPipeline; a refused report is answered with a Rejection message and the
// stream goes on. Outbound messages (acks from the store writer thread, controls from the
// query service) are queued and written one at a time (at most one write in flight), with acks
// coalesced into one Ack message per write.
//
// Limits: at most `max_streams` streams open at once (RESOURCE_EXHAUSTED beyond). A message over
// `max_message_bytes` ends its stream with RESOURCE_EXHAUSTED naming the flag, counted as
// message_too_large; the server builder's hard limit (see Collector) sits at twice that, so a
// grossly oversized message is refused by gRPC itself before it is buffered.
//
// The method is registered raw (ByteBuffer in and out) and the reactor parses each message
// itself: gRPC's own parse failure reaches a callback reactor as a plain failed read, which is
// indistinguishable from the agent half-closing, so random or truncated bytes would end the stream
// with OK. Parsed here, they end it with INVALID_ARGUMENT saying which message failed.
//
// Thread safety: reactions run on gRPC's callback threads; the reactor's outbound queue is
// guarded by its own mutex; AgentStream handles may be called from any thread.
#ifndef RANKSCOPE_COLLECTOR_INGEST_SERVICE_H_
#define RANKSCOPE_COLLECTOR_INGEST_SERVICE_H_

#include <atomic>
#include <cstddef>

#include "collector/health_metrics.h"
#include "collector/pipeline.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

namespace rankscope::collector {

class IngestService final : public v1::Ingest::WithRawCallbackMethod_Stream<v1::Ingest::Service> {
 public:
  // max_message_bytes 0: no check here (the server builder's limit only).
  IngestService(StepPipeline* pipeline, HealthMetrics* health, size_t max_streams,
                size_t max_message_bytes = 0);

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* context) override;

  size_t open_streams() const { return open_streams_.load(); }

 private:
  friend class StreamReactor;
  StepPipeline* const pipeline_;
  HealthMetrics* const health_;
  const size_t max_streams_;
  const size_t max_message_bytes_;
  std::atomic<size_t> open_streams_{0};
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_INGEST_SERVICE_H_
