#include "collector/ingest/validation.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "collector/model/rank_report.h"
#include "common/job_name.h"

namespace rankscope::collector {
namespace {

Rejection Reject(absl::Status status, RejectReason reason) {
  return Rejection{std::move(status), reason};
}

// kReplicaProjections finite projections and a finite rounding >= 0.
bool SummaryValid(const v1::ReplicaSummary& summary) {
  bool finite = std::isfinite(summary.rounding()) && summary.rounding() >= 0.0;
  for (double p : summary.projections()) finite = finite && std::isfinite(p);
  return finite && static_cast<size_t>(summary.projections_size()) == kReplicaProjections;
}

}  // namespace

uint32_t SketchBlockOf(const v1::Hello& hello) {
  constexpr uint32_t kBlockOfOlderAgents = 16;  // before Hello.sketch_block existed
  return hello.sketch_block() == 0 ? kBlockOfOlderAgents : hello.sketch_block();
}

JobIdentity IdentityOf(const v1::Hello& hello) {
  return JobIdentity{hello.world_size(), hello.sketch_dim(), hello.sketch_seed(),
                     SketchEncodingFromWire(hello.sketch_encoding()), SketchBlockOf(hello)};
}

uint64_t ReportSketchDim(const v1::StepReport& report, const v1::Hello& hello) {
  const std::optional<SketchEncoding> e = SketchEncodingFromWire(hello.sketch_encoding());
  if (!e || *e == SketchEncoding::kFloat32) return static_cast<uint64_t>(report.sketch_size());
  return report.sketch_packed().size() / SketchBytesPerBin(*e);
}

bool IsValidJobName(absl::string_view job, size_t max_length) {
  return rankscope::IsValidJobName(job, max_length);
}

// Long: a flat list of independent checks, each with its own actionable message and reason, in the
// order an operator reads them: nothing to factor but the list.
Rejection ValidateHello(const v1::Hello& hello, const IngestLimits& limits) {
  // The name's bytes came over the wire: the message gives its length, never the bytes.
  if (absl::Status name =
          ValidateJobName(hello.job(), JobNameEcho::kLengthOnly, limits.max_job_name_length);
      !name.ok()) {
    return Reject(std::move(name), RejectReason::kBadHello);
  }
  if (absl::Status group = ValidateGroupName(hello.group(), JobNameEcho::kLengthOnly);
      !group.ok()) {
    return Reject(std::move(group), RejectReason::kBadHello);
  }
  if (hello.instance_id().size() > kMaxInstanceIdLength) {
    return Reject(
        absl::InvalidArgumentError(absl::StrCat("instance_id has ", hello.instance_id().size(),
                                                " bytes; at most ", kMaxInstanceIdLength)),
        RejectReason::kBadHello);
  }
  if (hello.run_id().size() > kMaxInstanceIdLength) {
    return Reject(
        absl::InvalidArgumentError(absl::StrCat("run_id has ", hello.run_id().size(),
                                                " bytes; at most ", kMaxInstanceIdLength)),
        RejectReason::kBadHello);
  }
  if (hello.world_size() == 0 || hello.world_size() > limits.max_world_size) {
    return Reject(absl::InvalidArgumentError(absl::StrCat("world_size ", hello.world_size(),
                                                          " must be in [1, ", limits.max_world_size,
                                                          "] for job ", hello.job())),
                  RejectReason::kBadHello);
  }
  if (hello.rank() >= hello.world_size()) {
    return Reject(
        absl::InvalidArgumentError(absl::StrCat("rank ", hello.rank(), " >= world_size ",
                                                hello.world_size(), " for job ", hello.job())),
        RejectReason::kRankOutOfRange);
  }
  if (hello.sketch_dim() == 0 || hello.sketch_dim() > limits.max_sketch_dim) {
    return Reject(absl::InvalidArgumentError(absl::StrCat("sketch_dim ", hello.sketch_dim(),
                                                          " must be in [1, ", limits.max_sketch_dim,
                                                          "] for job ", hello.job())),
                  RejectReason::kBadHello);
  }
  if (!SketchEncodingFromWire(hello.sketch_encoding())) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
                      "sketch_encoding ", hello.sketch_encoding(), " of job ", hello.job(),
                      " is unknown: float32 (0), float16 (1) and int8 (2) are; upgrade the "
                      "collector or attach with another sketch_encoding")),
                  RejectReason::kBadHello);
  }
  struct TextField {
    const char* name;
    const std::string& value;
    size_t max;
  };
  for (const TextField& f :
       {TextField{"host", hello.host(), limits.max_host_length},
        TextField{"agent_version", hello.agent_version(), limits.max_version_length},
        TextField{"framework_version", hello.framework_version(), limits.max_version_length}}) {
    if (f.value.size() > f.max) {
      return Reject(absl::InvalidArgumentError(absl::StrCat(
                        "hello field ", f.name, " has ", f.value.size(), " bytes, more than ",
                        f.max, " for job ", hello.job(), ": send a shorter ", f.name)),
                    RejectReason::kBadHello);
    }
  }
  if (hello.bucket_names_size() > kMaxHelloBuckets) {
    return Reject(
        absl::InvalidArgumentError(absl::StrCat(
            "hello names ", hello.bucket_names_size(), " buckets, more than ", kMaxHelloBuckets,
            " for job ", hello.job(), ": group the parameters coarser")),
        RejectReason::kBadHello);
  }
  for (const std::string& name : hello.bucket_names()) {
    if (name.size() > kMaxBucketNameBytes) {
      return Reject(absl::InvalidArgumentError(
                        absl::StrCat("a bucket name has ", name.size(), " bytes, more than ",
                                     kMaxBucketNameBytes, " for job ", hello.job())),
                    RejectReason::kBadHello);
    }
  }
  return {};
}

Rejection CheckJobIdentity(const v1::Hello& hello, const JobIdentity& identity) {
  if (hello.world_size() != identity.world_size) {
    return Reject(
        absl::FailedPreconditionError(absl::StrCat(
            "world_size ", hello.world_size(), " != ", identity.world_size, " for job ",
            hello.job(), ": a job's world size is fixed; use a new job name for a resized run")),
        RejectReason::kWorldSizeChanged);
  }
  if (hello.sketch_dim() != identity.sketch_dim || hello.sketch_seed() != identity.sketch_seed) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
                      "sketch (dim ", hello.sketch_dim(), ", seed ", hello.sketch_seed(),
                      ") differs from job ", hello.job(), "'s (dim ", identity.sketch_dim,
                      ", seed ", identity.sketch_seed,
                      "): every rank must use the same sketch or cosines mean nothing")),
                  RejectReason::kSketchMismatch);
  }
  const std::optional<SketchEncoding> encoding = SketchEncodingFromWire(hello.sketch_encoding());
  if (identity.sketch_encoding && encoding && *encoding != *identity.sketch_encoding) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
                      "sketch_encoding ", SketchEncodingName(*encoding), " differs from job ",
                      hello.job(), "'s (", SketchEncodingName(*identity.sketch_encoding),
                      "): a job uses one sketch encoding; attach every rank with the same "
                      "sketch_encoding, or use a new job name")),
                  RejectReason::kSketchMismatch);
  }
  if (identity.sketch_block && SketchBlockOf(hello) != *identity.sketch_block) {
    return Reject(absl::FailedPreconditionError(absl::StrCat(
                      "sketch_block ", SketchBlockOf(hello), " differs from job ", hello.job(),
                      "'s (", *identity.sketch_block,
                      "): this rank's agent hashes the gradient in blocks of another size (a "
                      "different rankscope version), so its sketch cannot be compared; run one "
                      "rankscope version on every rank, or use a new job name")),
                  RejectReason::kSketchMismatch);
  }
  return {};
}

Rejection ValidateReport(const v1::StepReport& report, const v1::Hello& hello,
                         const SketchDimSchedule& dims) {
  if (report.bucket_norms_size() != 0 && report.bucket_norms_size() != hello.bucket_names_size()) {
    return Reject(absl::InvalidArgumentError(
                      absl::StrCat("report of step ", report.step(), " carries ",
                                   report.bucket_norms_size(), " bucket norms, the hello of job ",
                                   hello.job(), " names ", hello.bucket_names_size(), " buckets")),
                  RejectReason::kInvalidReport);
  }
  if (report.step() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Reject(absl::InvalidArgumentError(absl::StrCat("step ", report.step(), " of job ",
                                                          hello.job(), " exceeds 2^63-1")),
                  RejectReason::kInvalidReport);
  }
  const SketchEncoding encoding =
      SketchEncodingFromWire(hello.sketch_encoding()).value_or(SketchEncoding::kFloat32);
  const char* name = SketchEncodingName(encoding);
  uint64_t dim = static_cast<uint64_t>(report.sketch_size());
  if (encoding == SketchEncoding::kFloat32) {
    if (!report.sketch_packed().empty()) {
      return Reject(absl::InvalidArgumentError(absl::StrCat(
                        "report of step ", report.step(), " carries ",
                        report.sketch_packed().size(), " bytes of sketch_packed, but job ",
                        hello.job(), "'s hello states sketch_encoding float32 (`sketch`)")),
                    RejectReason::kSketchLength);
    }
  } else {
    const size_t per_bin = SketchBytesPerBin(encoding);
    const size_t bytes = report.sketch_packed().size();
    if (report.sketch_size() != 0 || bytes % per_bin != 0) {
      return Reject(absl::InvalidArgumentError(absl::StrCat(
                        "sketch of step ", report.step(), " has ", report.sketch_size(),
                        " float values and ", bytes, " packed bytes; job ", hello.job(), " uses ",
                        name, " (", per_bin, " bytes a bin in sketch_packed, no float values)")),
                    RejectReason::kSketchLength);
    }
    dim = bytes / per_bin;
    const float scale = report.sketch_scale();
    if (!std::isnan(scale) && !(scale > 0.0f && std::isfinite(scale))) {
      return Reject(absl::InvalidArgumentError(absl::StrCat(
                        "sketch_scale ", scale, " of step ", report.step(), " of job ", hello.job(),
                        " must be finite and > 0 (or NaN for a non-finite sketch)")),
                    RejectReason::kInvalidReport);
    }
  }
  if (dim > std::numeric_limits<uint32_t>::max() ||
      !SketchDimAccepted(dims, static_cast<uint32_t>(dim))) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
                      "sketch of step ", report.step(), " has ", dim,
                      encoding == SketchEncoding::kFloat32 ? "" : absl::StrCat(" ", name),
                      " values, job ", hello.job(), " uses sketch_dim ", dims.base_dim)),
                  RejectReason::kSketchLength);
  }
  if (report.reduced_sketch_size() != 0 &&
      (static_cast<uint64_t>(report.reduced_sketch_size()) != dim ||
       report.reduced_grad_mantissa_bits() < 1 || report.reduced_grad_mantissa_bits() > 53)) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
                      "reduced_sketch of step ", report.step(), " has ",
                      report.reduced_sketch_size(), " values and reduced_grad_mantissa_bits ",
                      report.reduced_grad_mantissa_bits(), "; job ", hello.job(), "'s report has ",
                      dim, " sketch bins, and the bits must be in [1, 53]")),
                  RejectReason::kSketchLength);
  }
  const bool param_ok = !report.has_param_summary() ||
                        (report.has_param_fingerprint() && SummaryValid(report.param_summary()));
  const bool grad_ok =
      !report.has_reduced_grad_summary() ||
      (report.has_reduced_grad_fingerprint() && SummaryValid(report.reduced_grad_summary()) &&
       report.reduced_grad_summary().precision() >= 1 &&
       report.reduced_grad_summary().precision() <= 53);
  if (!param_ok || !grad_ok) {
    return Reject(absl::InvalidArgumentError(absl::StrCat(
                      "the replica summary ", param_ok ? "reduced_grad_summary" : "param_summary",
                      " of step ", report.step(), " of job ", hello.job(),
                      " must come with its fingerprint and hold ", kReplicaProjections,
                      " finite projections, a finite rounding >= 0 and (the reduced "
                      "gradient's) a precision in [1, 53]")),
                  RejectReason::kInvalidReport);
  }
  return {};
}

}  // namespace rankscope::collector
