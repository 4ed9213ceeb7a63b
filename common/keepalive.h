// The gRPC keepalive settings of both ends of an agent's stream, in one place: how often each side
// pings an idle connection and how long it waits for the answer, hence how long each side takes to
// notice a peer that vanished without closing its socket (a node powered off, a network partition,
// a half-open connection left behind). docs/reliability.md "Network faults" gives the figures.
//
//   agent      notices a dead collector within kPingIntervalMs + kPingTimeoutMs (40 s): its stream
//              fails UNAVAILABLE, it reconnects with backoff and resends everything unacked.
//   collector  notices a dead agent within its --grpc_keepalive_time + --grpc_keepalive_timeout
//              (20 s + 10 s by default, kServerPingInterval + kServerPingTimeout): the stream is
//              cancelled, its rank slot and memory are freed, and a run refused because that
//              stream held the job is admitted at its next retry. A connection that never
//              completes its TLS/HTTP2 handshake is closed after kServerHandshakeTimeoutMs (10 s).
//
// Pings go on without data and without calls (a paused job, an agent between streams), so both
// sides keep watching an idle connection; the collector accepts the agent's pings down to
// kServerMinPingIntervalMs apart instead of gRPC's default 5 minutes (which would answer the
// agent's 30 s pings with GOAWAY "too_many_pings").
//
// Pure functions over gRPC's argument objects; thread-compatible.
#ifndef RANKSCOPE_COMMON_KEEPALIVE_H_
#define RANKSCOPE_COMMON_KEEPALIVE_H_

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace rankscope::keepalive {

inline constexpr int kPingIntervalMs = 30000;  // a ping after this long without one (each side)
inline constexpr int kPingTimeoutMs = 10000;   // no ping ack within this: the peer is dead
inline constexpr absl::Duration kServerPingInterval = absl::Seconds(20);  // flag defaults
inline constexpr absl::Duration kServerPingTimeout = absl::Seconds(10);
inline constexpr int kServerMinPingIntervalMs = 10000;   // the agent may ping this often
inline constexpr int kServerHandshakeTimeoutMs = 10000;  // TCP accepted, handshake unfinished

// The agent's channel: pings every kPingIntervalMs, gives up after kPingTimeoutMs.
void ApplyToChannel(grpc::ChannelArguments* args);

// What the collector accepts of its peers' pings. The defaults allow the agent's (every
// kPingIntervalMs, with or without calls). gRPC's own defaults, which a collector older than these
// settings used (at most one ping per 5 minutes without data, none without calls, GOAWAY
// "too_many_pings" after 2 strikes), can be set (--grpc_agent_min_ping_interval, ...) to check
// agents against such a collector: the agent reconnects and resends what is unacked, nothing is
// lost (docs/reliability.md "Keepalive").
struct AgentPingPolicy {
  absl::Duration min_interval = absl::Milliseconds(kServerMinPingIntervalMs);
  bool permit_without_calls = true;
  int max_strikes = 2;  // gRPC's default: bad pings tolerated before GOAWAY too_many_pings
};

// The collector's server: pings towards agents every `ping_interval`, a connection whose ping is
// unanswered after `ping_timeout` closed (ping_interval <= 0: gRPC's defaults, 2 h), the agents'
// pings allowed as `policy` says, the handshake timeout.
void ApplyToServer(grpc::ServerBuilder* builder, absl::Duration ping_interval,
                   absl::Duration ping_timeout, const AgentPingPolicy& policy = {});

}  // namespace rankscope::keepalive

#endif  // RANKSCOPE_COMMON_KEEPALIVE_H_
