// The agent's side of the wire format (proto/rankscope/v1/rankscope.proto): its options and
// queued reports as messages, and a received Control as the agent's control state.
//
// Thread-safe (pure functions).
#ifndef RANKSCOPE_AGENT_SRC_WIRE_H_
#define RANKSCOPE_AGENT_SRC_WIRE_H_

#include <cstdint>
#include <optional>

#include "rankscope/agent.h"
#include "rankscope/v1/rankscope.pb.h"
#include "report_queue.h"
#include "unacked_buffer.h"

namespace rankscope::internal {

// The hello that opens each stream of an agent with `options` (agent_version kAgentVersion).
v1::AgentMessage HelloMessage(const AgentOptions& options,
                              const std::optional<AgentControl>& control = std::nullopt);

// The message carrying one queued report as number `seq`, with the agent's count of dropped
// reports so far. Allocates: call it without the agent's lock.
// Its sketch is packed in `encoding` (common/sketch_encoding.h): `repeated float sketch` for
// kFloat32, `sketch_packed` and `sketch_scale` otherwise.
MessagePtr ReportMessage(const QueuedReport& report, uint64_t seq, uint64_t dropped_total,
                         SketchEncoding encoding = SketchEncoding::kFloat32);

// The control state to adopt on receiving `control`: set when there is none yet or `control` is
// of a higher generation (`every` 0 read as 1), nullopt when `current` is as new or newer.
std::optional<AgentControl> NewerControl(const v1::Control& control,
                                         const std::optional<AgentControl>& current);

}  // namespace rankscope::internal

#endif  // RANKSCOPE_AGENT_SRC_WIRE_H_
