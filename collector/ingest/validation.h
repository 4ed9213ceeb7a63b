// Validation of what agents send, before anything reaches the joiner or the store.
//
// Pure functions over the wire types: no I/O, no state. Each failure is a Status whose code the
// ingest service returns to the agent as is, and whose message names the offending value and
// the job ("rank 9 >= world_size 8 for job exp-42"). Each `reason` is a RejectReason
// (reject_reason.h), whose ReasonLabel is the label value of rankscope_reports_rejected_total.
#ifndef RANKSCOPE_COLLECTOR_INGEST_VALIDATION_H_
#define RANKSCOPE_COLLECTOR_INGEST_VALIDATION_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "collector/model/reject_reason.h"
#include "common/sketch_dim.h"
#include "common/sketch_encoding.h"
#include "rankscope/v1/rankscope.pb.h"

namespace rankscope::collector {

struct IngestLimits {
  uint32_t max_world_size = 1'000'000;
  uint32_t max_sketch_dim = 1u << 20;
  size_t max_job_name_length = 128;
  // The hello's free-text fields: kept for the stream's life and echoed in logs and refusals, so
  // bounded (a hello over them is INVALID_ARGUMENT, reason bad_hello).
  size_t max_host_length = 255;     // a DNS name is at most 253 characters
  size_t max_version_length = 128;  // agent_version, framework_version
};

inline constexpr size_t kMaxInstanceIdLength = 128;
// Hello.bucket_names: at most this many names of at most kMaxBucketNameBytes bytes each (the
// agent's kMaxBucketNames, kMaxBucketNameLength).
inline constexpr int kMaxHelloBuckets = 256;
inline constexpr size_t kMaxBucketNameBytes = 128;

// What a job is fixed to once its first hello was accepted.
struct JobIdentity {
  uint32_t world_size = 0;
  uint32_t sketch_dim = 0;
  uint64_t sketch_seed = 0;
  // The sketch encoding of the job's hellos; nullopt when not known (an identity restored from
  // the store, which does not keep it): the next hello's encoding is then adopted.
  std::optional<SketchEncoding> sketch_encoding;
  // Coordinates per block of the sketch's hash (Hello.sketch_block, 0 read as 16); nullopt when
  // not known (restored from the store), as sketch_encoding.
  std::optional<uint32_t> sketch_block;
};

// The hash block a hello states: Hello.sketch_block, where 0 (older agents) means 16.
uint32_t SketchBlockOf(const v1::Hello& hello);

// The identity a hello states.
JobIdentity IdentityOf(const v1::Hello& hello);

// A rejected input: the status to answer with and the metric's reason. OK status iff kNone.
struct Rejection {
  absl::Status status;
  RejectReason reason = RejectReason::kNone;
};

// True iff `job` is 1..max characters of [A-Za-z0-9_.:-].
bool IsValidJobName(absl::string_view job, size_t max_length);

// Checks a hello on its own: job and group names, instance id length, 1 <= world_size <= max,
// rank < world_size, 1 <= sketch_dim <= max, a known sketch_encoding, host, agent_version and
// framework_version within their lengths (the message gives the length and the limit, never the
// bytes). An OK status (empty reason) on success.
Rejection ValidateHello(const v1::Hello& hello, const IngestLimits& limits);

// Checks a hello against the identity its job already has: world size, sketch dim, seed and
// encoding (when the identity knows it) must match (FailedPrecondition otherwise; cosines across
// different sketches mean nothing, and a job keeps one encoding).
Rejection CheckJobIdentity(const v1::Hello& hello, const JobIdentity& identity);

// Checks one report of a stream whose hello was accepted: the step must fit SQLite's int64 and
// the sketch must be in the hello's encoding (float32: `sketch`, no `sketch_packed`; float16 and
// int8: `sketch_packed` of a whole number of bins, no `sketch`, and a scale that is finite and
// > 0, or NaN for a sketch that held NaN/Inf) and its number of bins one of the job's
// (SketchDimAccepted; `dims.base_dim` is the hello's sketch_dim). Non-finite loss, grad_norm or
// float sketch values are accepted (stored and flagged).
Rejection ValidateReport(const v1::StepReport& report, const v1::Hello& hello,
                         const SketchDimSchedule& dims);

// The number of bins of `report`'s sketch in the hello's encoding (a packed sketch's bytes over
// the bytes per bin, rounded down).
uint64_t ReportSketchDim(const v1::StepReport& report, const v1::Hello& hello);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_INGEST_VALIDATION_H_
