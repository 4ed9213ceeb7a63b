// Fuzzes collector/validation: bytes -> the wire messages the collector accepts
// (rankscope.v1.AgentMessage holding a Hello or a StepReport) -> ValidateHello, CheckJobIdentity,
// ValidateReport. Each verdict is compared with a reference predicate written from validation.h's
// contract (both ways: valid iff within the documented limits), its status code and reason label
// are checked, and validating again, or after a serialize/parse round trip, must agree.
//
// Input layout (tests/fuzz/make_corpus.py writes seeds in it):
//   u8 flags            bit 0: use the limits below instead of IngestLimits' defaults
//   u32 max_world_size, u32 max_sketch_dim, u8 max_job_name_length
//   u8 identity_mode    0: the job identity is the first hello's own; else the fields below
//   u32 world_size, u32 sketch_dim, u64 sketch_seed, u8 sketch_encoding (3 and up: unknown, as
//                       an identity restored from the store)
//   u8 dim_mode         0: reports are checked against the hello's sketch_dim; else the u32 below
//   u32 sketch_dim
//   u16 n, then n bytes: the first AgentMessage; the rest: the second AgentMessage
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "collector/ingest/validation.h"
#include "common/job_name.h"
#include "google/protobuf/stubs/logging.h"
#include "rankscope/v1/rankscope.pb.h"
#include "tests/fuzz/byte_reader.h"
#include "tests/fuzz/fuzz_check.h"

namespace rankscope::fuzz {
namespace {

namespace v1 = ::rankscope::v1;
using collector::IngestLimits;
using collector::JobIdentity;
using collector::Rejection;

bool ReferenceJobName(const std::string& job, size_t max_length) {
  static constexpr absl::string_view kAllowed =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-";
  if (job.empty() || job.size() > max_length) return false;
  for (char c : job) {
    if (kAllowed.find(c) == absl::string_view::npos) return false;
  }
  return true;
}

bool Printable(absl::string_view s) {
  for (char c : s) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

bool Same(const Rejection& a, const Rejection& b) {
  return a.status == b.status && a.reason == b.reason;
}

// Checks ValidateHello's verdict on `hello`; returns whether it was accepted.
bool CheckHello(const v1::Hello& hello, const IngestLimits& limits) {
  const bool name_ok = ReferenceJobName(hello.job(), limits.max_job_name_length);
  FUZZ_CHECK(collector::IsValidJobName(hello.job(), limits.max_job_name_length) == name_ok);
  // Who the rank is: an empty group is the job's only one; an instance id is opaque bytes.
  const bool who_ok =
      (hello.group().empty() || ReferenceJobName(hello.group(), kMaxGroupNameLength)) &&
      hello.instance_id().size() <= collector::kMaxInstanceIdLength;
  const bool world_ok = hello.world_size() >= 1 && hello.world_size() <= limits.max_world_size;
  const bool rank_ok = hello.rank() < hello.world_size();
  const bool dim_ok = hello.sketch_dim() >= 1 && hello.sketch_dim() <= limits.max_sketch_dim &&
                      hello.sketch_encoding() >= 0 && hello.sketch_encoding() <= 2;
  const bool text_ok = hello.host().size() <= limits.max_host_length &&
                       hello.agent_version().size() <= limits.max_version_length &&
                       hello.framework_version().size() <= limits.max_version_length;
  const bool expected = name_ok && who_ok && world_ok && rank_ok && dim_ok && text_ok;

  const Rejection r = collector::ValidateHello(hello, limits);
  FUZZ_CHECK(r.status.ok() == expected);
  FUZZ_CHECK(r.status.ok() == ReasonLabel(r.reason).empty());
  if (!expected) {
    FUZZ_CHECK(r.status.code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(!r.status.message().empty());
    // The first failing check names the reason; only an out-of-range rank has its own label.
    const bool rank_first = name_ok && who_ok && world_ok && !rank_ok;
    FUZZ_CHECK(ReasonLabel(r.reason) == (rank_first ? "rank_out_of_range" : "bad_hello"));
    // Messages reach logs and gRPC status details: a job name is quoted only once it is valid,
    // so they never carry the agent's raw bytes.
    FUZZ_CHECK(Printable(r.status.message()));
  }
  // Deterministic, and the same after a round trip through the wire format.
  FUZZ_CHECK(Same(collector::ValidateHello(hello, limits), r));
  v1::Hello copy;
  FUZZ_CHECK(copy.ParseFromString(hello.SerializeAsString()));
  FUZZ_CHECK(Same(collector::ValidateHello(copy, limits), r));
  return expected;
}

void CheckIdentity(const v1::Hello& hello, const JobIdentity& identity) {
  const bool world_same = hello.world_size() == identity.world_size;
  const std::optional<SketchEncoding> encoding = SketchEncodingFromWire(hello.sketch_encoding());
  const bool sketch_same =
      hello.sketch_dim() == identity.sketch_dim && hello.sketch_seed() == identity.sketch_seed &&
      (!identity.sketch_encoding || !encoding || *encoding == *identity.sketch_encoding);
  const Rejection r = collector::CheckJobIdentity(hello, identity);
  FUZZ_CHECK(r.status.ok() == (world_same && sketch_same));
  FUZZ_CHECK(r.status.ok() == ReasonLabel(r.reason).empty());
  if (!r.status.ok()) {
    FUZZ_CHECK(r.status.code() == absl::StatusCode::kFailedPrecondition);
    FUZZ_CHECK(ReasonLabel(r.reason) == (world_same ? "sketch_mismatch" : "world_size_changed"));
  }
  FUZZ_CHECK(Same(collector::CheckJobIdentity(hello, identity), r));
}

void CheckReport(const v1::StepReport& report, const v1::Hello& hello, uint32_t sketch_dim,
                 bool hello_valid) {
  const bool step_ok = report.step() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  // The hello's encoding (an unknown one, refused at the hello, reads as float32 here).
  const SketchEncoding encoding =
      SketchEncodingFromWire(hello.sketch_encoding()).value_or(SketchEncoding::kFloat32);
  const size_t per_bin = SketchBytesPerBin(encoding);
  const size_t packed = report.sketch_packed().size();
  bool length_ok, scale_ok = true;
  if (encoding == SketchEncoding::kFloat32) {
    length_ok = packed == 0 && static_cast<uint64_t>(report.sketch_size()) == sketch_dim;
  } else {
    length_ok = report.sketch_size() == 0 && packed % per_bin == 0 &&
                packed / per_bin == static_cast<uint64_t>(sketch_dim);
    const float scale = report.sketch_scale();
    scale_ok = std::isnan(scale) || (scale > 0.0f && std::isfinite(scale));
  }
  const Rejection r = collector::ValidateReport(report, hello, {sketch_dim});
  FUZZ_CHECK(r.status.ok() == (step_ok && length_ok && scale_ok));
  FUZZ_CHECK(r.status.ok() == ReasonLabel(r.reason).empty());
  if (!r.status.ok()) {
    FUZZ_CHECK(r.status.code() == absl::StatusCode::kInvalidArgument);
    // Checked in this order: step, then the packed form's shape, then its scale, then k.
    const bool shape_ok = encoding == SketchEncoding::kFloat32
                              ? packed == 0
                              : report.sketch_size() == 0 && packed % per_bin == 0;
    const char* expected = !step_ok    ? "invalid_report"
                           : !shape_ok ? "sketch_length"
                           : !scale_ok ? "invalid_report"
                                       : "sketch_length";
    FUZZ_CHECK(ReasonLabel(r.reason) == expected);
    if (hello_valid) FUZZ_CHECK(Printable(r.status.message()));
  } else {
    // What the store and the statistics rely on: the step fits SQLite's int64, and exactly
    // sketch_dim values (non-finite ones included) are there to read.
    FUZZ_CHECK(static_cast<int64_t>(report.step()) >= 0);
    FUZZ_CHECK(collector::ReportSketchDim(report, hello) == sketch_dim);
    if (encoding == SketchEncoding::kFloat32) {
      FUZZ_CHECK(report.sketch().size() == static_cast<int>(sketch_dim));
    } else {
      FUZZ_CHECK(packed == sketch_dim * per_bin);
    }
  }
  FUZZ_CHECK(Same(collector::ValidateReport(report, hello, {sketch_dim}), r));
  v1::StepReport copy;
  FUZZ_CHECK(copy.ParseFromString(report.SerializeAsString()));
  FUZZ_CHECK(Same(collector::ValidateReport(copy, hello, {sketch_dim}), r));
}

}  // namespace
}  // namespace rankscope::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Invalid UTF-8 in a string field fails the parse, as it should, and protobuf logs an ERROR
  // line for each: silence them, or a run prints little else.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rankscope::fuzz;  // NOLINT(build/namespaces): this function only
  ByteReader in(data, size);
  IngestLimits limits;
  const uint8_t flags = in.U8();
  const uint32_t max_world = in.U32();
  const uint32_t max_dim = in.U32();
  const uint8_t max_name = in.U8();
  if (flags & 1) {
    limits.max_world_size = max_world;
    limits.max_sketch_dim = max_dim;
    limits.max_job_name_length = max_name;
  }
  const uint8_t identity_mode = in.U8();
  JobIdentity identity;
  identity.world_size = in.U32();
  identity.sketch_dim = in.U32();
  identity.sketch_seed = in.U64();
  identity.sketch_encoding = rankscope::SketchEncodingFromWire(in.U8());
  const uint8_t dim_mode = in.U8();
  const uint32_t fixed_dim = in.U32();
  const absl::string_view first_bytes = in.Bytes(in.U16());
  const absl::string_view second_bytes = in.Rest();

  v1::AgentMessage first, second;
  v1::Hello hello;  // the stream's hello (default: empty, as before a hello arrived)
  bool hello_valid = false;
  if (first.ParseFromArray(first_bytes.data(), static_cast<int>(first_bytes.size()))) {
    if (first.has_hello()) {
      hello = first.hello();
      hello_valid = CheckHello(hello, limits);
      if (identity_mode == 0) {
        identity = rankscope::collector::IdentityOf(hello);
      }
      CheckIdentity(hello, identity);
    } else if (first.has_report()) {
      CheckReport(first.report(), hello, dim_mode == 0 ? hello.sketch_dim() : fixed_dim, false);
    }
  }
  if (second.ParseFromArray(second_bytes.data(), static_cast<int>(second_bytes.size()))) {
    const uint32_t sketch_dim = dim_mode == 0 ? hello.sketch_dim() : fixed_dim;
    if (second.has_report()) {
      CheckReport(second.report(), hello, sketch_dim, hello_valid);
    } else if (second.has_hello()) {
      // Another rank of the same job: checked on its own, then against the job's identity.
      CheckHello(second.hello(), limits);
      CheckIdentity(second.hello(), identity);
    }
  }
  return 0;
}
