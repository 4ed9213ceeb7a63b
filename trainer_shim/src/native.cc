// rankscope._native: the pybind11 bridge between rankscope.torch and the C++ agent and sketch.
//
// Tensors cross this boundary as raw addresses (tensor.data_ptr()) plus a dtype code and an
// element count, so the extension needs no libtorch and copies nothing: the count sketch reads
// the gradient where it lies. The Python side guarantees that an address points at `n`
// contiguous elements of the given dtype that stay alive for the call.
//
// Errors: constructors raise ValueError with the absl::Status message; hot-path calls
// (Sketch.add*, Agent.record) never raise for a runtime condition, they return a status string
// ("" on success) so that the training loop cannot be broken by monitoring.
//
// GIL: released while a sketch kernel runs (a planned bucket's kernels: from
// kReleaseGilElements elements on) and while Flush/Close wait, never held by the agent's own
// threads (they do not touch Python).
//
// Thread safety: Sketch is thread-compatible: one caller at a time, reads included (a read
// merges the stripes and closes the open float sums, as StripedSketch and CountSketch). Agent
// follows rankscope::Agent: record() from one thread at a time, everything else from any thread.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/client_tls.h"
#include "common/collector_dns.h"
#include "common/collector_shard.h"
#include "common/query_client.h"
#include "common/sketch_encoding.h"
#include "grpcpp/grpcpp.h"
#include "rankscope/agent.h"
#include "rankscope/fingerprint.h"
#include "rankscope/sketch.h"
#include "rankscope/striped_sketch.h"
#include "rankscope/v1/rankscope.grpc.pb.h"

namespace py = pybind11;

namespace rankscope {
namespace {

absl::StatusOr<ScalarType> ToScalarType(int dtype) {
  switch (dtype) {
    case static_cast<int>(ScalarType::kFloat32):
      return ScalarType::kFloat32;
    case static_cast<int>(ScalarType::kBFloat16):
      return ScalarType::kBFloat16;
    case static_cast<int>(ScalarType::kFloat16):
      return ScalarType::kFloat16;
    default:
      return absl::InvalidArgumentError("dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  }
}

const void* AsPointer(uintptr_t address) { return reinterpret_cast<const void*>(address); }

// A bucket's kernels release the GIL from this many elements on (a few microseconds of work):
// below it the kernel is shorter than the risk it buys, handing the GIL to another thread (the
// comm hook's autograd thread and the all-reduce callback's thread take turns) and waiting to get
// it back. (Not measured apart: docs/PERFORMANCE.md's runs show no difference from it alone.)
constexpr size_t kReleaseGilElements = size_t{1} << 16;

// Where one DDP gradient bucket's parameters lie in its flat buffer and in the global flat
// vector, computed once (after DDP's bucket rebuild) so that a hook call is one C++ call: the
// sketch with the per-group squared norms (Sketch.add_plan) before the all-reduce, the replica
// fingerprint of the reduced bucket (BucketPlan.fingerprint) after it.
struct BucketPlan {
  ScalarType type = ScalarType::kFloat32;
  std::vector<size_t> byte_offsets;  // from the buffer's start
  std::vector<size_t> starts;        // the same, in elements (for FingerprintSegments)
  std::vector<size_t> counts;
  std::vector<uint64_t> global_offsets;
  // Per segment, the parameter group (rankscope._buckets) whose squared norm its squares add
  // to, or -1; empty: no per-group norms.
  std::vector<int32_t> groups;
  size_t total = 0;  // the sum of counts
};

// A StripedSketch owned by Python (a count sketch on `threads` threads, bit-identical whatever
// the count), plus a float scratch buffer for handing it to the agent.
class PySketch {
 public:
  PySketch(uint32_t dim, uint64_t seed, int threads)
      : sketch_(Check(dim), seed, CheckThreads(threads)), floats_(dim) {}

  uint32_t dim() const { return sketch_.dim(); }
  uint64_t seed() const { return sketch_.seed(); }
  int threads() const { return sketch_.threads(); }
  void Reset() {
    sketch_.Reset();
    std::fill(group_squares_.begin(), group_squares_.end(), 0.0);
  }
  double sum_squares() { return sketch_.sketch().sum_squares(); }

  // The per-group sums of squares add_plan accumulated since the last reset (float64, one per
  // group index up to the largest seen; sketch.h "Rounding", the call's squares, per segment).
  const std::vector<double>& group_squares() const { return group_squares_; }

  // Adds n elements at `address` as coordinates [offset, offset + n).
  std::string Add(uintptr_t address, int dtype, size_t n, uint64_t offset) {
    absl::StatusOr<ScalarType> type = ToScalarType(dtype);
    if (!type.ok()) return std::string(type.status().message());
    if (n == 0) return "";
    if (address == 0) return "null address";
    py::gil_scoped_release release;
    sketch_.Add(AsPointer(address), *type, n, offset);
    return "";
  }

  // One call per gradient bucket: segment i is ns[i] elements at addresses[i], coordinates
  // [offsets[i], offsets[i] + ns[i]). All segments have the same dtype.
  std::string AddMany(const std::vector<uintptr_t>& addresses, const std::vector<size_t>& ns,
                      const std::vector<uint64_t>& offsets, int dtype) {
    absl::StatusOr<ScalarType> type = ToScalarType(dtype);
    if (!type.ok()) return std::string(type.status().message());
    if (addresses.size() != ns.size() || ns.size() != offsets.size()) {
      return "addresses, ns and offsets must have the same length";
    }
    segments_.clear();
    for (size_t i = 0; i < addresses.size(); ++i) {
      if (ns[i] == 0) continue;
      if (addresses[i] == 0) return "null address";
      segments_.push_back({AsPointer(addresses[i]), ns[i], offsets[i]});
    }
    py::gil_scoped_release release;
    sketch_.AddSegments(segments_, *type);
    return "";
  }

  // Adds every segment of `plan`, reading the bucket buffer at `base_address`, and, when the
  // plan has groups and `groups` is true, each segment's sum of squares (read in the same pass)
  // to its group's.
  void AddPlan(const BucketPlan& plan, uintptr_t base_address, bool groups = true) {
    segments_.clear();
    for (size_t i = 0; i < plan.counts.size(); ++i) {
      segments_.push_back(
          {AsPointer(base_address + plan.byte_offsets[i]), plan.counts[i], plan.global_offsets[i]});
    }
    std::optional<py::gil_scoped_release> release;
    if (plan.total >= kReleaseGilElements) release.emplace();
    if (plan.groups.empty() || !groups) {
      sketch_.AddSegments(segments_, plan.type);
      return;
    }
    segment_squares_.assign(segments_.size(), 0.0);
    sketch_.AddSegments(segments_, plan.type, absl::MakeSpan(segment_squares_));
    for (size_t i = 0; i < plan.groups.size(); ++i) {
      const int32_t g = plan.groups[i];
      if (g < 0) continue;
      if (static_cast<size_t>(g) >= group_squares_.size()) group_squares_.resize(g + 1, 0.0);
      group_squares_[g] += segment_squares_[i];
    }
  }

  // Writes the bins as dim() float32 values at `address`.
  void CopyTo(uintptr_t address) {
    sketch_.sketch().CopyTo(absl::MakeSpan(reinterpret_cast<float*>(address), sketch_.dim()));
  }
  // Writes the bins as dim() float64 values at `address` (exact, for tests).
  void CopyBinsTo(uintptr_t address) {
    absl::Span<const double> bins = sketch_.sketch().bins();
    std::copy(bins.begin(), bins.end(), reinterpret_cast<double*>(address));
  }
  std::vector<float> values() { return sketch_.sketch().ToFloats(); }

  // The bins as float, refreshed on each call; valid until the next call or mutation.
  absl::Span<const float> Floats() {
    sketch_.sketch().CopyTo(absl::MakeSpan(floats_));
    return floats_;
  }

 private:
  static int CheckThreads(int threads) {
    if (threads < 1 || threads > 256) {
      throw py::value_error("sketch threads must be in [1, 256], got " + std::to_string(threads));
    }
    return threads;
  }
  static uint32_t Check(uint32_t dim) {
    if (dim < 1 || dim > kMaxSketchDim) {
      throw py::value_error("sketch_dim must be in [1, " + std::to_string(kMaxSketchDim) + "]");
    }
    return dim;
  }

  StripedSketch sketch_;
  // One bucket's segments, reused from call to call (no allocation on the hook's path once the
  // largest bucket was seen).
  std::vector<StripedSketch::Segment> segments_;
  std::vector<double> segment_squares_;
  std::vector<double> group_squares_;
  std::vector<float> floats_;
};

// (fingerprint, sum of squares) of segments of the buffer at `base`: segment k is counts[k]
// elements from element starts[k], at global indices from global_offsets[k]. The kernel is
// rankscope/fingerprint.h; `dtype` is a ScalarType code or kFingerprintFloat64.
py::tuple PyFingerprintSegments(uintptr_t base, int dtype, const std::vector<size_t>& starts,
                                const std::vector<size_t>& counts,
                                const std::vector<uint64_t>& global_offsets,
                                bool release_gil = true) {
  absl::StatusOr<ReplicaFingerprint> result;
  {
    std::optional<py::gil_scoped_release> release;  // the checks read only these vectors
    if (release_gil) release.emplace();
    result = rankscope::FingerprintSegments(AsPointer(base), dtype, starts, counts, global_offsets);
  }
  if (!result.ok()) throw py::value_error(std::string(result.status().message()));
  return py::make_tuple(result->fingerprint, result->sum_squares);
}

// The tolerance replica check's float summary of segments of CPU memory (the arithmetic is
// rankscope/replica_summary.py's): segment k is counts[k] values (dtype code as for
// fingerprint_segments) from element starts[k], at global indices from global_offsets[k].
// Returns ([P_0 .. P_3], sum of squares, sum of magnitudes, chain). Each P_j is summed in float64
// blocks of kSummaryBlock values in order (the blocks run on across segments), the blocks' sums
// added pairwise (a binary counter of partial sums, then its levels from the lowest), so each P_j
// is a chain of at most `chain` = kSummaryBlock + 2 * (levels used) additions, the bound
// replica_summary's R takes. The GIL is released.
constexpr size_t kSummaryBlock = 1024;

class SummaryAccumulator {
 public:
  void Add(uint64_t index, double x) {
    uint64_t z = index + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    for (int j = 0; j < 4; ++j) block_[j] += ((z >> (60 + j)) & 1) ? -x : x;
    squares_ += x * x;
    magnitude_ += x < 0 ? -x : x;
    if (++in_block_ == kSummaryBlock) Carry();
  }

  py::tuple Finish() {
    if (in_block_ > 0) Carry();
    std::array<double, 4> total{};
    for (size_t level = 0; level < levels_.size(); ++level) {
      if (!occupied_[level]) continue;
      for (int j = 0; j < 4; ++j) total[j] += levels_[level][j];
    }
    const size_t chain = kSummaryBlock + 2 * levels_.size();
    return py::make_tuple(std::vector<double>(total.begin(), total.end()), squares_, magnitude_,
                          chain);
  }

 private:
  // The finished block joins the binary counter: equal-sized sums are added pairwise.
  void Carry() {
    std::array<double, 4> sum = block_;
    block_ = {};
    in_block_ = 0;
    size_t level = 0;
    while (level < levels_.size() && occupied_[level]) {
      for (int j = 0; j < 4; ++j) sum[j] += levels_[level][j];
      occupied_[level] = false;
      ++level;
    }
    if (level == levels_.size()) {
      levels_.push_back({});
      occupied_.push_back(false);
    }
    levels_[level] = sum;
    occupied_[level] = true;
  }

  std::array<double, 4> block_{};
  size_t in_block_ = 0;
  std::vector<std::array<double, 4>> levels_;
  std::vector<bool> occupied_;
  double squares_ = 0.0;
  double magnitude_ = 0.0;
};

template <typename Load>
void SummarizeSegment(const char* base, size_t size, size_t start, size_t count, uint64_t offset,
                      Load load, SummaryAccumulator* acc) {
  const char* p = base + start * size;
  for (size_t i = 0; i < count; ++i) acc->Add(offset + i, load(p + i * size));
}

py::tuple PyReplicaSummarySegments(uintptr_t base, int dtype, const std::vector<size_t>& starts,
                                   const std::vector<size_t>& counts,
                                   const std::vector<uint64_t>& global_offsets) {
  if (dtype < 0 || dtype > kFingerprintFloat64) {
    throw py::value_error("dtype must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (float64)");
  }
  if (starts.size() != counts.size() || counts.size() != global_offsets.size()) {
    throw py::value_error("starts, counts and global_offsets differ in length");
  }
  if (base == 0 && !counts.empty()) throw py::value_error("null address");
  SummaryAccumulator acc;
  {
    py::gil_scoped_release release;
    const char* bytes = static_cast<const char*>(AsPointer(base));
    const size_t size = FingerprintElementSize(dtype);
    for (size_t k = 0; k < counts.size(); ++k) {
      switch (dtype) {
        case 0:
          SummarizeSegment(
              bytes, size, starts[k], counts[k], global_offsets[k],
              [](const char* q) {
                float v;
                std::memcpy(&v, q, sizeof v);
                return static_cast<double>(v);
              },
              &acc);
          break;
        case 1:
        case 2:
          SummarizeSegment(
              bytes, size, starts[k], counts[k], global_offsets[k],
              [dtype](const char* q) {
                uint16_t b;
                std::memcpy(&b, q, sizeof b);
                return static_cast<double>(dtype == 1 ? BFloat16ToFloat(b) : Float16ToFloat(b));
              },
              &acc);
          break;
        default:
          SummarizeSegment(
              bytes, size, starts[k], counts[k], global_offsets[k],
              [](const char* q) {
                double v;
                std::memcpy(&v, q, sizeof v);
                return v;
              },
              &acc);
      }
    }
  }
  return acc.Finish();
}

class PyAgent {
 public:
  explicit PyAgent(AgentOptions options) {
    absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Create(std::move(options));
    if (!agent.ok()) throw py::value_error(std::string(agent.status().message()));
    agent_ = std::move(*agent);
  }

  // Records one step whose sketch is `sketch`'s bins. Returns "" or the refusal's message.
  // The optional replica fields (fingerprints as uint64, the reduced gradient's norm) are sent
  // when given (rankscope.fingerprint); `reduced_sketch` (a Sketch or None) is the reduced
  // gradient's sketch on the steps this rank checks the aggregation (rankscope._integrity);
  // `param_*` and `reduced_grad_*` the float summaries under the tolerance replica check
  // (rankscope.replica_summary; empty projections: the exact check); `replica_set` the replica
  // set param_fingerprint belongs to (None: the whole group; HSDP: the shard index).
  std::string RecordSketch(uint64_t step, double loss, double grad_norm, PySketch& sketch,
                           std::optional<double> step_time_seconds, uint32_t local_batch_size,
                           std::optional<uint64_t> reduced_grad_fingerprint,
                           std::optional<uint64_t> param_fingerprint,
                           std::optional<double> reduced_grad_norm, bool loss_absent,
                           const std::vector<float>& bucket_norms, py::object reduced_sketch,
                           uint32_t reduced_grad_mantissa_bits,
                           const std::vector<double>& param_projections, double param_rounding,
                           const std::vector<double>& reduced_grad_projections,
                           double reduced_grad_rounding, uint32_t reduced_grad_precision,
                           std::optional<uint32_t> replica_set) {
    StepReport r;
    r.bucket_norms = bucket_norms;
    r.step = step;
    r.loss = loss;
    r.loss_absent = loss_absent;
    r.grad_norm = grad_norm;
    r.sketch = sketch.Floats();
    if (!reduced_sketch.is_none()) {
      r.reduced_sketch = reduced_sketch.cast<PySketch&>().Floats();
      r.reduced_grad_mantissa_bits = reduced_grad_mantissa_bits;
    }
    r.step_time_seconds = step_time_seconds;
    r.local_batch_size = local_batch_size;
    r.reduced_grad_fingerprint = reduced_grad_fingerprint;
    r.param_fingerprint = param_fingerprint;
    r.replica_set = replica_set;
    r.reduced_grad_norm = reduced_grad_norm;
    r.param_projections = param_projections;
    r.param_rounding = param_rounding;
    r.reduced_grad_projections = reduced_grad_projections;
    r.reduced_grad_rounding = reduced_grad_rounding;
    r.reduced_grad_precision = reduced_grad_precision;
    return StatusText(agent_->Record(r));
  }

  // Records one step whose sketch is `sketch_len` float32 values at `sketch_address`. The
  // reduced gradient's sketch (rankscope._integrity) is `reduced_sketch` (a Sketch) or, from the
  // deferred device path, `sketch_len` float32 values at `reduced_sketch_address` (0: none).
  std::string RecordRaw(uint64_t step, double loss, double grad_norm, uintptr_t sketch_address,
                        size_t sketch_len, std::optional<double> step_time_seconds,
                        uint32_t local_batch_size, std::optional<uint64_t> reduced_grad_fingerprint,
                        std::optional<uint64_t> param_fingerprint,
                        std::optional<double> reduced_grad_norm, bool loss_absent,
                        const std::vector<float>& bucket_norms, py::object reduced_sketch,
                        uint32_t reduced_grad_mantissa_bits, uintptr_t reduced_sketch_address,
                        const std::vector<double>& param_projections, double param_rounding,
                        const std::vector<double>& reduced_grad_projections,
                        double reduced_grad_rounding, uint32_t reduced_grad_precision,
                        std::optional<uint32_t> replica_set) {
    StepReport r;
    r.bucket_norms = bucket_norms;
    r.step = step;
    r.loss = loss;
    r.loss_absent = loss_absent;
    r.grad_norm = grad_norm;
    r.sketch = absl::MakeConstSpan(reinterpret_cast<const float*>(sketch_address), sketch_len);
    if (!reduced_sketch.is_none()) {
      r.reduced_sketch = reduced_sketch.cast<PySketch&>().Floats();
      r.reduced_grad_mantissa_bits = reduced_grad_mantissa_bits;
    } else if (reduced_sketch_address != 0) {
      r.reduced_sketch =
          absl::MakeConstSpan(reinterpret_cast<const float*>(reduced_sketch_address), sketch_len);
      r.reduced_grad_mantissa_bits = reduced_grad_mantissa_bits;
    }
    r.step_time_seconds = step_time_seconds;
    r.local_batch_size = local_batch_size;
    r.reduced_grad_fingerprint = reduced_grad_fingerprint;
    r.param_fingerprint = param_fingerprint;
    r.replica_set = replica_set;
    r.reduced_grad_norm = reduced_grad_norm;
    r.param_projections = param_projections;
    r.param_rounding = param_rounding;
    r.reduced_grad_projections = reduced_grad_projections;
    r.reduced_grad_rounding = reduced_grad_rounding;
    r.reduced_grad_precision = reduced_grad_precision;
    return StatusText(agent_->Record(r));
  }

  std::string Flush(double timeout_seconds) {
    py::gil_scoped_release release;
    return StatusText(agent_->Flush(absl::Seconds(timeout_seconds)));
  }

  std::string Close(double timeout_seconds) {
    py::gil_scoped_release release;
    return StatusText(agent_->Close(absl::Seconds(timeout_seconds)));
  }

  py::dict Stats() const {
    const AgentStats s = agent_->stats();
    py::dict d;
    d["recorded"] = s.recorded;
    d["sent"] = s.sent;
    d["acked"] = s.acked;
    d["rejected"] = s.rejected;
    d["dropped"] = s.dropped;
    d["invalid"] = s.invalid;
    d["reconnects"] = s.reconnects;
    d["connected"] = s.connected;
    d["queued"] = s.queued;
    d["unacked"] = s.unacked;
    d["last_error"] = s.last_error;
    d["refused"] = s.refused;
    d["held_elsewhere"] = s.held_elsewhere;
    return d;
  }

  // (generation, apply_at_step, enabled, every, sketch_dim) of the newest control, or None.
  std::optional<py::tuple> Control() const {
    std::optional<AgentControl> c = agent_->control();
    if (!c) return std::nullopt;
    return py::make_tuple(c->generation, c->apply_at_step, c->enabled, c->every, c->sketch_dim);
  }

 private:
  static std::string StatusText(const absl::Status& s) {
    return s.ok() ? std::string() : s.ToString();
  }

  std::unique_ptr<Agent> agent_;

 public:
  const AgentOptions& options() const { return agent_->options(); }
  const std::string& collector() const { return agent_->collector(); }
};

// The encoding Agent(sketch_encoding=...) names; ValueError for another name.
SketchEncoding SketchEncodingArg(const std::string& name) {
  std::optional<SketchEncoding> encoding = ParseSketchEncoding(name);
  if (!encoding) {
    throw py::value_error("sketch_encoding must be float32, float16 or int8, got '" + name + "'");
  }
  return *encoding;
}

// Query.SetControl, as `rankscope ctl` sends it. Returns the control the collector will push
// and the number of ranks notified; raises RuntimeError with the gRPC status otherwise.
py::dict SetControl(const std::string& collector, const std::string& job,
                    std::optional<bool> enabled, std::optional<uint32_t> every,
                    std::optional<uint32_t> sketch_dim, uint32_t lead_steps, double timeout_seconds,
                    const std::string& tls_ca_file, const std::string& tls_cert_file,
                    const std::string& tls_key_file, const std::string& tls_target_name,
                    const std::string& auth_token) {
  // A fleet's list: the job's shard, as its agents pick it (common/collector_shard.h).
  absl::StatusOr<std::vector<std::string>> shards = ParseCollectorList(collector);
  if (!shards.ok()) throw py::value_error("collector: " + std::string(shards.status().message()));
  *shards = ExpandCollectorName(*std::move(shards));
  const std::string shard = PickCollector(*shards, job);
  query::QueryClientOptions options;
  options.address = shard;
  options.tls.ca_file = tls_ca_file;
  options.tls.cert_file = tls_cert_file;
  options.tls.key_file = tls_key_file;
  options.tls.target_name = tls_target_name;
  options.auth_token = auth_token;
  options.timeout = absl::Seconds(timeout_seconds);
  absl::StatusOr<std::unique_ptr<query::QueryClient>> client =
      query::QueryClient::Create(std::move(options));
  if (!client.ok()) throw py::value_error(std::string(client.status().message()));
  v1::ControlRequest req;
  req.set_job(job);
  if (enabled) req.set_enabled(*enabled);
  if (every) req.set_every(*every);
  if (sketch_dim) req.set_sketch_dim(*sketch_dim);
  req.set_lead_steps(lead_steps);
  absl::StatusOr<v1::ControlResponse> set;
  {
    py::gil_scoped_release release;
    set = (*client)->SetControl(req);
    client->reset();  // the channel's teardown, too, without the GIL
  }
  if (!set.ok()) {
    throw std::runtime_error("SetControl on " + shard +
                             " failed: " + std::to_string(static_cast<int>(set.status().code())) +
                             " " + std::string(set.status().message()));
  }
  const v1::ControlResponse& resp = *set;
  py::dict d;
  d["generation"] = resp.control().generation();
  d["apply_at_step"] = resp.control().apply_at_step();
  d["enabled"] = resp.control().enabled();
  d["every"] = resp.control().every();
  d["sketch_dim"] = resp.control().sketch_dim();
  d["ranks_notified"] = resp.ranks_notified();
  return d;
}

}  // namespace
}  // namespace rankscope

// Long: the module's binding table, one .def per function or class the package imports, nothing to
// branch on; split, it would scatter the Python API's one list.
PYBIND11_MODULE(_native, m) {
  using namespace rankscope;
  m.doc() = "rankscope native bridge: count sketch kernel and agent (see rankscope.torch)";

  m.attr("DEFAULT_SKETCH_DIM") = kDefaultSketchDim;
  m.attr("DEFAULT_SKETCH_SEED") = kDefaultSketchSeed;
  m.attr("MAX_SKETCH_DIM") = kMaxSketchDim;
  // SketchMix's constants (sketch.h), for the shim's torch and Triton ports of the hash.
  m.attr("SKETCH_MIX_CONSTANTS") = py::make_tuple(kSketchMixGolden, kSketchMixM1, kSketchMixM2);
  m.attr("DTYPE_FLOAT32") = static_cast<int>(ScalarType::kFloat32);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(ScalarType::kBFloat16);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(ScalarType::kFloat16);
  m.attr("AGENT_VERSION") = kAgentVersion;
  {
    py::dict bytes_per_bin;
    for (SketchEncoding e :
         {SketchEncoding::kFloat32, SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
      bytes_per_bin[SketchEncodingName(e)] = SketchBytesPerBin(e);
    }
    m.attr("SKETCH_BYTES_PER_BIN") = bytes_per_bin;
  }
  // The agent's packing (common/sketch_encoding.h), for benchmarks and tests: the float sketch
  // `values` in `encoding` as (bytes, scale), and the exact values such a packed sketch stands for.
  m.def(
      "pack_sketch",
      [](const std::vector<float>& values, const std::string& encoding) {
        std::optional<SketchEncoding> e = ParseSketchEncoding(encoding);
        if (!e) throw py::value_error("unknown sketch encoding '" + encoding + "'");
        PackedSketch p = PackSketch(values, *e);
        return py::make_tuple(py::bytes(p.bins), p.scale);
      },
      py::arg("values"), py::arg("encoding"));
  m.def(
      "unpack_sketch",
      [](const std::string& bins, const std::string& encoding, float scale) {
        std::optional<SketchEncoding> e = ParseSketchEncoding(encoding);
        if (!e) throw py::value_error("unknown sketch encoding '" + encoding + "'");
        if (bins.size() % SketchBytesPerBin(*e) != 0) {
          throw py::value_error("packed sketch length is not a multiple of the bin size");
        }
        return DecodeSketch(
            SketchView(*e, bins.data(), bins.size() / SketchBytesPerBin(*e), scale));
      },
      py::arg("bins"), py::arg("encoding"), py::arg("scale"));
  m.attr("DTYPE_FLOAT64") = kFingerprintFloat64;
  m.def(
      "fingerprint_segments",
      [](uintptr_t base, int dtype, const std::vector<size_t>& starts,
         const std::vector<size_t>& counts, const std::vector<uint64_t>& global_offsets) {
        return PyFingerprintSegments(base, dtype, starts, counts, global_offsets);
      },
      py::arg("base_address"), py::arg("dtype"), py::arg("starts"), py::arg("counts"),
      py::arg("global_offsets"),
      "Replica fingerprint (uint64) and exact sum of squares (float) of segments of CPU "
      "memory; see rankscope/fingerprint.py. dtype 0 float32, 1 bfloat16, 2 float16, 3 "
      "float64. Releases the GIL.");

  m.def("replica_summary_segments", &PyReplicaSummarySegments, py::arg("base_address"),
        py::arg("dtype"), py::arg("starts"), py::arg("counts"), py::arg("global_offsets"),
        "The tolerance replica check's float summary of segments of CPU memory: ([P_0 .. P_3], "
        "sum of squares, sum of magnitudes, chain); see rankscope/replica_summary.py. dtype as "
        "for fingerprint_segments. Releases the GIL.");
  m.def("sketch_mix", &SketchMix, py::arg("index"), py::arg("seed"),
        "SplitMix64 output number `index` for `seed`; sketch_hash takes it at the block index "
        "(coordinate >> 5): base bin from the high 32 bits, the 32 signs from the low 32.");
  m.def(
      "sketch_hash",
      [](uint64_t index, uint64_t seed, uint32_t dim) {
        if (dim < 1) throw py::value_error("dim must be >= 1");
        const SketchSlot s = SketchHash(index, seed, dim);
        return py::make_tuple(s.bin, s.sign);
      },
      py::arg("index"), py::arg("seed"), py::arg("dim"), "(bin, sign) of one coordinate.");
  m.def(
      "fill_mix",
      [](uintptr_t out_address, uint64_t offset, size_t n, uint64_t seed) {
        auto* out = reinterpret_cast<uint64_t*>(out_address);
        py::gil_scoped_release release;
        for (size_t i = 0; i < n; ++i) out[i] = SketchMix(offset + i, seed);
      },
      py::arg("out_address"), py::arg("offset"), py::arg("n"), py::arg("seed"),
      "Writes SketchMix(offset + i, seed) for i < n as uint64 at out_address (tests).");
  m.def(
      "kernel_isa",
      [] { return std::string(sketch_internal::KernelIsaName(sketch_internal::BestKernelIsa())); },
      "The instruction set the sketch kernel uses on this CPU.");

  py::class_<BucketPlan>(m, "BucketPlan",
                         "Segments of one gradient bucket: byte offsets in its buffer, element "
                         "counts, global flat offsets, one dtype.")
      .def(py::init([](int dtype, std::vector<size_t> byte_offsets, std::vector<size_t> counts,
                       std::vector<uint64_t> global_offsets, std::vector<int32_t> groups) {
             absl::StatusOr<ScalarType> type = ToScalarType(dtype);
             if (!type.ok()) throw py::value_error(std::string(type.status().message()));
             if (byte_offsets.size() != counts.size() || counts.size() != global_offsets.size()) {
               throw py::value_error("byte_offsets, counts and global_offsets differ in length");
             }
             if (!groups.empty() && groups.size() != counts.size()) {
               throw py::value_error("groups must be empty or have one entry per segment");
             }
             const size_t size = FingerprintElementSize(dtype);
             auto plan = std::make_unique<BucketPlan>();
             plan->type = *type;
             for (size_t b : byte_offsets) {
               if (b % size != 0) throw py::value_error("a byte offset is not element-aligned");
               plan->starts.push_back(b / size);
             }
             plan->byte_offsets = std::move(byte_offsets);
             plan->counts = std::move(counts);
             for (size_t n : plan->counts) plan->total += n;
             plan->global_offsets = std::move(global_offsets);
             plan->groups = std::move(groups);
             return plan;
           }),
           py::arg("dtype"), py::arg("byte_offsets"), py::arg("counts"), py::arg("global_offsets"),
           py::arg("groups") = std::vector<int32_t>{})
      .def_property_readonly("segments", [](const BucketPlan& p) { return p.counts.size(); })
      .def(
          "fingerprint",
          [](const BucketPlan& p, uintptr_t base_address, PySketch* reduced_sketch) {
            if (reduced_sketch != nullptr) reduced_sketch->AddPlan(p, base_address, false);
            return PyFingerprintSegments(base_address, static_cast<int>(p.type), p.starts, p.counts,
                                         p.global_offsets, p.total >= kReleaseGilElements);
          },
          py::arg("base_address"), py::arg("reduced_sketch") = nullptr,
          "(fingerprint, sum of squares) of the plan's segments of the buffer at base_address, "
          "as fingerprint_segments; the segments' vectors built once, at the plan. With "
          "reduced_sketch (a Sketch), the segments are first added to it too (add_plan without "
          "the groups: the aggregation check's reduced sketch), in the same call. Releases the "
          "GIL for a plan of 65,536 elements or more.");

  py::class_<PySketch>(m, "Sketch", "A count sketch of a flat vector (rankscope/sketch.h).")
      .def(py::init<uint32_t, uint64_t, int>(), py::arg("dim"),
           py::arg("seed") = kDefaultSketchSeed, py::arg("threads") = 1)
      .def_property_readonly("dim", &PySketch::dim)
      .def_property_readonly("threads", &PySketch::threads)
      .def_property_readonly("seed", &PySketch::seed)
      .def("reset", &PySketch::Reset)
      .def("sum_squares", &PySketch::sum_squares)
      .def("group_squares", &PySketch::group_squares,
           "The per-group sums of squares add_plan added since the last reset (a list of "
           "float, one per group index up to the largest a plan named).")
      .def("add", &PySketch::Add, py::arg("address"), py::arg("dtype"), py::arg("n"),
           py::arg("offset"))
      .def("add_many", &PySketch::AddMany, py::arg("addresses"), py::arg("ns"), py::arg("offsets"),
           py::arg("dtype"))
      .def("add_plan", &PySketch::AddPlan, py::arg("plan"), py::arg("base_address"),
           py::arg("groups") = true)
      .def("copy_to", &PySketch::CopyTo, py::arg("address"))
      .def("copy_bins_to", &PySketch::CopyBinsTo, py::arg("address"))
      .def("values", &PySketch::values);

  py::class_<PyAgent>(m, "Agent", "One rank's agent (rankscope/agent.h).")
      .def(py::init(
               [](const std::string& collector, const std::string& job, uint32_t rank,
                  uint32_t world_size, uint32_t sketch_dim, uint64_t sketch_seed, uint32_t attempt,
                  const std::string& host, const std::string& framework_version,
                  const std::string& auth_token, size_t queue_capacity, size_t max_unacked,
                  double initial_backoff_s, double max_backoff_s, const std::string& tls_ca_file,
                  const std::string& tls_cert_file, const std::string& tls_key_file,
                  const std::string& tls_target_name, const std::string& group, int64_t global_rank,
                  const std::string& instance_id, const std::string& sketch_encoding,
                  const std::vector<std::string>& bucket_names, int tls_reload_interval_s,
                  const std::string& run_id) {
                 // Each keyword argument to its AgentOptions field, by name.
                 AgentOptions o;
                 o.sketch_encoding = SketchEncodingArg(sketch_encoding);
                 o.group = group;
                 if (global_rank >= 0) o.global_rank = static_cast<uint32_t>(global_rank);
                 o.instance_id = instance_id;
                 o.run_id = run_id;
                 o.bucket_names = bucket_names;
                 o.collector_address = collector;
                 o.job = job;
                 o.rank = rank;
                 o.world_size = world_size;
                 o.sketch_dim = sketch_dim;
                 o.sketch_seed = sketch_seed;
                 o.attempt = attempt;
                 o.host = host;
                 o.framework_version = framework_version;
                 o.auth_token = auth_token;
                 o.queue_capacity = queue_capacity;
                 o.max_unacked = max_unacked;
                 o.initial_backoff = absl::Seconds(initial_backoff_s);
                 o.max_backoff = absl::Seconds(max_backoff_s);
                 o.tls.ca_file = tls_ca_file;
                 o.tls.cert_file = tls_cert_file;
                 o.tls.key_file = tls_key_file;
                 o.tls.target_name = tls_target_name;
                 o.tls.reload_interval_s = tls_reload_interval_s;
                 return std::make_unique<PyAgent>(std::move(o));
               }),
           py::arg("collector"), py::arg("job"), py::arg("rank"), py::arg("world_size"),
           py::arg("sketch_dim") = kDefaultSketchDim, py::arg("sketch_seed") = kDefaultSketchSeed,
           py::arg("attempt") = 0, py::arg("host") = "", py::arg("framework_version") = "",
           py::arg("auth_token") = "", py::arg("queue_capacity") = 1024,
           py::arg("max_unacked") = 8192, py::arg("initial_backoff_s") = 0.1,
           py::arg("max_backoff_s") = 10.0, py::arg("tls_ca_file") = "",
           py::arg("tls_cert_file") = "", py::arg("tls_key_file") = "",
           py::arg("tls_target_name") = "", py::arg("group") = "", py::arg("global_rank") = -1,
           py::arg("instance_id") = "", py::arg("sketch_encoding") = "float32",
           py::arg("bucket_names") = std::vector<std::string>{},
           py::arg("tls_reload_interval_s") = 60, py::arg("run_id") = "")
      .def("instance_id", [](const PyAgent& a) { return a.options().instance_id; })
      .def("collector", [](const PyAgent& a) { return a.collector(); })
      .def("record_sketch", &PyAgent::RecordSketch, py::arg("step"), py::arg("loss"),
           py::arg("grad_norm"), py::arg("sketch"), py::arg("step_time_seconds") = py::none(),
           py::arg("local_batch_size") = 0, py::arg("reduced_grad_fingerprint") = py::none(),
           py::arg("param_fingerprint") = py::none(), py::arg("reduced_grad_norm") = py::none(),
           py::arg("loss_absent") = false, py::arg("bucket_norms") = std::vector<float>{},
           py::arg("reduced_sketch") = py::none(), py::arg("reduced_grad_mantissa_bits") = 0,
           py::arg("param_projections") = std::vector<double>{}, py::arg("param_rounding") = 0.0,
           py::arg("reduced_grad_projections") = std::vector<double>{},
           py::arg("reduced_grad_rounding") = 0.0, py::arg("reduced_grad_precision") = 0,
           py::arg("replica_set") = py::none())
      .def("record_raw", &PyAgent::RecordRaw, py::arg("step"), py::arg("loss"),
           py::arg("grad_norm"), py::arg("sketch_address"), py::arg("sketch_len"),
           py::arg("step_time_seconds") = py::none(), py::arg("local_batch_size") = 0,
           py::arg("reduced_grad_fingerprint") = py::none(),
           py::arg("param_fingerprint") = py::none(), py::arg("reduced_grad_norm") = py::none(),
           py::arg("loss_absent") = false, py::arg("bucket_norms") = std::vector<float>{},
           py::arg("reduced_sketch") = py::none(), py::arg("reduced_grad_mantissa_bits") = 0,
           py::arg("reduced_sketch_address") = 0,
           py::arg("param_projections") = std::vector<double>{}, py::arg("param_rounding") = 0.0,
           py::arg("reduced_grad_projections") = std::vector<double>{},
           py::arg("reduced_grad_rounding") = 0.0, py::arg("reduced_grad_precision") = 0,
           py::arg("replica_set") = py::none())
      .def("flush", &PyAgent::Flush, py::arg("timeout_seconds"))
      .def("close", &PyAgent::Close, py::arg("timeout_seconds"))
      .def("stats", &PyAgent::Stats)
      .def("control", &PyAgent::Control);

  m.def(
      "pick_collector",
      [](const std::string& collector, const std::string& job) {
        absl::StatusOr<std::vector<std::string>> shards = ParseCollectorList(collector);
        if (!shards.ok()) {
          throw py::value_error("collector: " + std::string(shards.status().message()));
        }
        return PickCollector(ExpandCollectorName(*std::move(shards)), job);
      },
      py::arg("collector"), py::arg("job"),
      "The collector of a list (a fleet) that `job`'s agents stream to "
      "(common/collector_shard.h).");
  m.def("set_control", &SetControl, py::arg("collector"), py::arg("job"),
        py::arg("enabled") = py::none(), py::arg("every") = py::none(),
        py::arg("sketch_dim") = py::none(), py::arg("lead_steps") = 5,
        py::arg("timeout_seconds") = 10.0, py::arg("tls_ca_file") = "",
        py::arg("tls_cert_file") = "", py::arg("tls_key_file") = "",
        py::arg("tls_target_name") = "", py::arg("auth_token") = "",
        "Query.SetControl (what `rankscope ctl` sends).");
}
