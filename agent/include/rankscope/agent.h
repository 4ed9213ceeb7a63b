// rankscope agent: the whole public C++ API of the in-process agent.
//
// One Agent per rank. The training thread calls Record() once per reported optimizer step; a
// background thread streams the reports to the collector over one gRPC bidirectional stream
// (Ingest.Stream) and keeps every report until the collector acknowledges that it is stored.
//
//   auto agent = rankscope::Agent::Create({.collector_address = "127.0.0.1:50051",
//                                          .job = "exp-42", .rank = 3, .world_size = 8});
//   ...
//   (*agent)->Record(report);          // O(1), never blocks, never allocates in steady state
//   (*agent)->Close(absl::Seconds(5)); // flushes what it can, then stops
//
// Delivery: at least once. Record() copies the report into a bounded ring of preallocated slots;
// when the ring is full the oldest report is dropped and counted. The background thread moves
// reports from the ring to the stream and keeps them in an unacked buffer (bounded by
// max_unacked; overflow drops the oldest, counted) until acked; after a reconnect it resends
// every unacked report first, in order. The count of dropped reports rides on every report.
//
// Security: the optional shared token rides in the hello (AgentOptions::auth_token); TLS
// (AgentOptions::tls) verifies the collector's certificate and, with a client certificate,
// authenticates the rank to a collector that requires mutual TLS. Both compose. A collector that
// refuses the rank (wrong token: UNAUTHENTICATED; no or untrusted client certificate: a failed
// TLS handshake, UNAVAILABLE) is logged once on stderr and kept in AgentStats::last_error; the
// agent keeps retrying with backoff and buffering, and training is never blocked.
//
// Connection: jittered exponential backoff from initial_backoff to max_backoff, reset when the
// first message of a stream is received. A collector that is down never slows Record().
//
// Thread safety: Record() may be called from one thread at a time (the training thread);
// Flush(), Close(), stats() and control() are thread-safe.
#ifndef RANKSCOPE_AGENT_H_
#define RANKSCOPE_AGENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/client_tls_files.h"
#include "common/sketch_encoding.h"
#include "common/version.h"
#include "rankscope/sketch.h"

namespace rankscope {

// The Hello.agent_version of this build (common/version.h: the project's one version).
inline constexpr char kAgentVersion[] = RANKSCOPE_VERSION;

// TLS to the collector: the options every collector client shares (common/client_tls_files.h).
// Plaintext unless ca_file, cert_file or key_file is set; target_name is the name to check in the
// collector's certificate instead of the address's host (e.g. "rankscope-collector" when dialing
// an IP). Files are read and checked by Agent::Create (a missing, unreadable or non-PEM file, or a
// key that does not match its certificate, is an InvalidArgument there, not a silent retry loop
// later).
using ClientTlsOptions = tls::ClientTlsFiles;

struct AgentOptions {
  // One collector "host:port", or a fleet: "a:50051,b:50051,c:50051" (or one DNS name that
  // resolves to several addresses, as a Kubernetes headless service does). Of a fleet, Create()
  // picks the job's shard by rendezvous hashing of `job` (common/collector_shard.h): every rank
  // of the job meets there with no coordination. The agent keeps that shard for its life: one
  // that is down is retried with backoff while reports are buffered, never swapped for another.
  // Duplicates count once; an empty entry is an InvalidArgument.
  std::string collector_address = "127.0.0.1:50051";
  std::string job;          // required, [A-Za-z0-9_.:-]{1,128}
  uint32_t rank = 0;        // required, < world_size
  uint32_t world_size = 1;  // required, >= 1
  uint32_t sketch_dim = kDefaultSketchDim;
  uint64_t sketch_seed = kDefaultSketchSeed;
  // How the sketch's sketch_dim bins travel (common/sketch_encoding.h): float32 (4 bytes a bin),
  // float16 (2) or int8 (1, with a per-report scale). Record() still takes float values; the
  // agent packs them when it sends the report.
  SketchEncoding sketch_encoding = SketchEncoding::kFloat32;
  uint32_t attempt = 0;  // restart count of the job (e.g. TORCHELASTIC_RESTART_COUNT)
  std::string host;      // default: gethostname()
  // Who this rank is beyond (job, rank): its data-parallel group ([A-Za-z0-9_.:-]{0,64}, empty =
  // the job's only group; rank and world_size are then the rank's index in and the size of the
  // group) and its rank in the whole job (torch.distributed's global rank), shown in alerts.
  std::string group;
  std::optional<uint32_t> global_rank;
  // This agent's identity across its reconnects; default: host, pid and 64 random bits. A second
  // live stream for the same (job, group, rank) from another instance is refused (ALREADY_EXISTS).
  std::string instance_id;
  // The run this rank belongs to (Hello.run_id): the same on every rank of one launch of the job,
  // different for another launch; at most 128 characters, empty = unknown. While another run holds
  // live streams for the job's group, this rank is refused (ALREADY_EXISTS) and keeps retrying.
  std::string run_id;
  std::string framework_version;  // e.g. "torch 1.13.1"
  std::string auth_token;         // sent in the hello when non-empty
  ClientTlsOptions tls;           // plaintext by default
  size_t queue_capacity = 1024;   // ring slots between Record() and the sender
  size_t max_unacked = 8192;      // reports kept for resending
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(10);
  // Where in the model: the names of the parameter groups whose local gradient norms
  // StepReport::bucket_norms carries (Hello.bucket_names; at most kMaxBucketNames, each at most
  // kMaxBucketNameLength bytes). Empty: reports carry no per-bucket norms.
  std::vector<std::string> bucket_names;
};

inline constexpr size_t kMaxBucketNames = 256;
inline constexpr size_t kMaxBucketNameLength = 128;

// One rank's view of one step. `sketch` must have exactly sketch_dim values.
struct StepReport {
  uint64_t step = 0;
  double loss = 0.0;
  double grad_norm = 0.0;
  absl::Span<const float> sketch;
  std::optional<uint64_t> reduced_grad_fingerprint;
  std::optional<uint64_t> param_fingerprint;
  // With param_fingerprint: the replica set it belongs to (StepReport.replica_set: ranks that
  // send the same value hold replicas of the same values, e.g. HSDP's shard index). Unset: the
  // one set of the whole group.
  std::optional<uint32_t> replica_set;
  std::optional<double> reduced_grad_norm;
  std::optional<double> step_time_seconds;
  uint32_t local_batch_size = 0;
  // No loss this step (a pipeline stage before the last): `loss` is ignored, never flagged.
  bool loss_absent = false;
  // The local gradient's L2 norm per parameter group of AgentOptions::bucket_names, in that
  // order: empty (not measured) or exactly as many values as names.
  absl::Span<const float> bucket_norms;
  // Aggregation integrity: the count sketch of the reduced gradient (empty, or as long as
  // `sketch`), sent in float32, and the precision of the dtype the reduction ran in.
  absl::Span<const float> reduced_sketch;
  uint32_t reduced_grad_mantissa_bits = 0;
  // With param_fingerprint, on a rank whose replica check is "tolerance" (docs/DESIGN.md
  // "Replica check: exact or tolerance"): the parameters' float summary, kReplicaProjections
  // signed sums (empty: the exact check) and the size of a one-ulp difference in every value.
  absl::Span<const double> param_projections;
  double param_rounding = 0.0;
  // The same for the reduced gradient (with reduced_grad_fingerprint), and the precision (1..53
  // significand bits) of the dtype its reduction ran in.
  absl::Span<const double> reduced_grad_projections;
  double reduced_grad_rounding = 0.0;
  uint32_t reduced_grad_precision = 0;
};

inline constexpr size_t kReplicaProjections = 4;

struct AgentStats {
  uint64_t recorded = 0;    // Record() calls accepted
  uint64_t sent = 0;        // reports written to a stream (resends included)
  uint64_t acked = 0;       // reports the collector acknowledged as stored
  uint64_t rejected = 0;    // reports the collector refused (never resent)
  uint64_t dropped = 0;     // reports dropped (ring full or unacked buffer full)
  uint64_t invalid = 0;     // Record() calls refused locally (e.g. wrong sketch length)
  uint64_t reconnects = 0;  // streams opened after the first
  bool connected = false;   // a stream is open and its hello was sent
  size_t queued = 0;        // in the ring
  size_t unacked = 0;       // sent or waiting to be sent, not yet acked
  // Why the newest failed stream ended ("UNAUTHENTICATED: ...", "UNAVAILABLE: ... handshake
  // ..."); empty until a stream fails. Kept after the agent reconnects.
  std::string last_error;
  // The collector refused this rank for good (ALREADY_EXISTS, FAILED_PRECONDITION or
  // PERMISSION_DENIED: another process holds the rank, the job's shape differs, or this rank may
  // not report): the agent stopped reconnecting, dropped what it held (counted as rejected) and
  // refuses further Record() calls. last_error says why.
  bool refused = false;
  // The collector refuses this rank because another process or run holds it (ALREADY_EXISTS: a
  // second live run under the job name, or a crashed holder's stream not yet found dead): nothing
  // this rank sends is stored meanwhile. Unlike `refused`, the agent keeps what it buffered
  // (bounded, drops counted) and retries with backoff; it is admitted once the holder's streams
  // are gone (closed, or dropped by the collector's keepalive), and the flag clears at the first
  // message the collector sends then. last_error names the holder.
  bool held_elsewhere = false;

  // Adds other's counters (recorded through unacked) into this one: the totals of several agents.
  // connected and last_error are per agent and left unchanged.
  void Add(const AgentStats& other) {
    recorded += other.recorded;
    sent += other.sent;
    acked += other.acked;
    rejected += other.rejected;
    dropped += other.dropped;
    invalid += other.invalid;
    reconnects += other.reconnects;
    queued += other.queued;
    unacked += other.unacked;
  }
};

// A control message pushed by the collector (rankscope ctl), to apply at `apply_at_step`.
struct AgentControl {
  uint64_t generation = 0;
  uint64_t apply_at_step = 0;
  bool enabled = true;
  uint32_t every = 1;
  uint32_t sketch_dim = 0;  // 0 = unchanged
};

class Agent {
 public:
  // Validates the options (and reads the TLS files) and starts the background thread. Does not
  // wait for a connection. Errors: InvalidArgument naming the bad option or file.
  static absl::StatusOr<std::unique_ptr<Agent>> Create(AgentOptions options);

  virtual ~Agent() = default;  // Closes with a zero timeout if Close() was not called.

  // Hands one report to the background thread. O(1); never blocks on I/O and never allocates
  // once the ring is warm. Returns InvalidArgument (and counts it) if the sketch length is wrong,
  // FailedPrecondition after Close().
  virtual absl::Status Record(const StepReport& report) = 0;

  // Waits until every report recorded so far is acked, or the timeout passes
  // (DeadlineExceeded, with the number still unacked).
  virtual absl::Status Flush(absl::Duration timeout) = 0;

  // Flushes for at most `timeout`, then stops the background thread. Idempotent. Returns the
  // Flush result; reports still unacked are lost (and counted as dropped).
  virtual absl::Status Close(absl::Duration timeout) = 0;

  virtual AgentStats stats() const = 0;

  // The newest control message received, if any.
  virtual std::optional<AgentControl> control() const = 0;

  virtual const AgentOptions& options() const = 0;

  // The collector this agent streams to: collector_address itself, or the job's shard of it.
  virtual const std::string& collector() const = 0;
};

}  // namespace rankscope

#endif  // RANKSCOPE_AGENT_H_
