// AgentStream: the collector core's view of one agent's stream. It can be acked (AckSink), sent
// a control message, and is detached by the ingest service when the stream ends.
#ifndef RANKSCOPE_COLLECTOR_PIPELINE_AGENT_STREAM_H_
#define RANKSCOPE_COLLECTOR_PIPELINE_AGENT_STREAM_H_

#include "collector/model/ack.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

class AgentStream : public AckSink {
 public:
  // Queues a control message for the agent. Thread-safe, must not block; ignored once the stream
  // ended.
  virtual void SendControl(const v1::Control& control) = 0;
};

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_PIPELINE_AGENT_STREAM_H_
