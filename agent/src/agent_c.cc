// C API over the agent and the sketch (agent_c.h). No exceptions cross it; errors are codes.
#include "rankscope/agent_c.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "rankscope/agent.h"
#include "rankscope/sketch.h"

struct rankscope_agent {
  std::unique_ptr<rankscope::Agent> agent;
};

struct rankscope_sketch {
  rankscope::CountSketch sketch;
};

namespace {

int Fail(const absl::Status& status, char* err, size_t err_len) {
  if (status.ok()) return 0;
  if (err != nullptr && err_len > 0) {
    const std::string msg(status.message());
    const size_t n = std::min(msg.size(), err_len - 1);
    std::memcpy(err, msg.data(), n);
    err[n] = '\0';
  }
  return static_cast<int>(status.code());
}

absl::Duration Seconds(double s) { return absl::Seconds(std::max(0.0, s)); }

}  // namespace

extern "C" {

void rankscope_agent_options_init(rankscope_agent_options* options) {
  const rankscope::AgentOptions d;
  std::memset(options, 0, sizeof(*options));
  options->collector_address = "127.0.0.1:50051";
  options->world_size = d.world_size;
  options->sketch_dim = d.sketch_dim;
  options->sketch_seed = d.sketch_seed;
  options->queue_capacity = d.queue_capacity;
  options->max_unacked = d.max_unacked;
}

int rankscope_agent_create(const rankscope_agent_options* options, rankscope_agent** out, char* err,
                           size_t err_len) {
  if (options == nullptr || out == nullptr) {
    return Fail(absl::InvalidArgumentError("options and out must not be NULL"), err, err_len);
  }
  rankscope::AgentOptions o;
  if (options->collector_address != nullptr) o.collector_address = options->collector_address;
  if (options->job != nullptr) o.job = options->job;
  o.rank = options->rank;
  o.world_size = options->world_size;
  o.sketch_dim = options->sketch_dim;
  o.sketch_seed = options->sketch_seed;
  o.attempt = options->attempt;
  if (options->host != nullptr) o.host = options->host;
  if (options->framework_version != nullptr) o.framework_version = options->framework_version;
  if (options->auth_token != nullptr) o.auth_token = options->auth_token;
  if (options->queue_capacity != 0) o.queue_capacity = options->queue_capacity;
  if (options->max_unacked != 0) o.max_unacked = options->max_unacked;
  if (options->tls_ca_file != nullptr) o.tls.ca_file = options->tls_ca_file;
  if (options->tls_cert_file != nullptr) o.tls.cert_file = options->tls_cert_file;
  if (options->tls_key_file != nullptr) o.tls.key_file = options->tls_key_file;
  if (options->tls_target_name != nullptr) o.tls.target_name = options->tls_target_name;
  auto agent = rankscope::Agent::Create(std::move(o));
  if (!agent.ok()) return Fail(agent.status(), err, err_len);
  *out = new rankscope_agent{std::move(*agent)};
  return 0;
}

int rankscope_agent_record(rankscope_agent* agent, uint64_t step, double loss, double grad_norm,
                           const float* sketch, size_t sketch_len) {
  return rankscope_agent_record_ext(agent, step, loss, grad_norm, sketch, sketch_len, 0, 0, 0, 0,
                                    -1.0, -1.0, 0);
}

int rankscope_agent_record_ext(rankscope_agent* agent, uint64_t step, double loss, double grad_norm,
                               const float* sketch, size_t sketch_len,
                               int has_reduced_grad_fingerprint, uint64_t reduced_grad_fingerprint,
                               int has_param_fingerprint, uint64_t param_fingerprint,
                               double reduced_grad_norm, double step_time_seconds,
                               uint32_t local_batch_size) {
  rankscope::StepReport r;
  r.step = step;
  r.loss = loss;
  r.grad_norm = grad_norm;
  r.sketch = absl::MakeConstSpan(sketch, sketch_len);
  if (has_reduced_grad_fingerprint) r.reduced_grad_fingerprint = reduced_grad_fingerprint;
  if (has_param_fingerprint) r.param_fingerprint = param_fingerprint;
  if (reduced_grad_norm >= 0) r.reduced_grad_norm = reduced_grad_norm;
  if (step_time_seconds >= 0) r.step_time_seconds = step_time_seconds;
  r.local_batch_size = local_batch_size;
  return static_cast<int>(agent->agent->Record(r).code());
}

int rankscope_agent_flush(rankscope_agent* agent, double timeout_seconds, char* err,
                          size_t err_len) {
  return Fail(agent->agent->Flush(Seconds(timeout_seconds)), err, err_len);
}

int rankscope_agent_close(rankscope_agent* agent, double timeout_seconds, char* err,
                          size_t err_len) {
  return Fail(agent->agent->Close(Seconds(timeout_seconds)), err, err_len);
}

void rankscope_agent_stats_get(const rankscope_agent* agent, rankscope_agent_stats* out) {
  const rankscope::AgentStats s = agent->agent->stats();
  out->recorded = s.recorded;
  out->sent = s.sent;
  out->acked = s.acked;
  out->rejected = s.rejected;
  out->dropped = s.dropped;
  out->invalid = s.invalid;
  out->reconnects = s.reconnects;
  out->connected = s.connected ? 1 : 0;
  out->queued = s.queued;
  out->unacked = s.unacked;
}

size_t rankscope_agent_last_error(const rankscope_agent* agent, char* buf, size_t buf_len) {
  const std::string error = agent->agent->stats().last_error;
  if (buf != nullptr && buf_len > 0) {
    const size_t n = std::min(error.size(), buf_len - 1);
    std::memcpy(buf, error.data(), n);
    buf[n] = '\0';
  }
  return error.size();
}

int rankscope_agent_control(const rankscope_agent* agent, uint64_t* generation,
                            uint64_t* apply_at_step, int* enabled, uint32_t* every,
                            uint32_t* sketch_dim) {
  const auto c = agent->agent->control();
  if (!c) return 0;
  *generation = c->generation;
  *apply_at_step = c->apply_at_step;
  *enabled = c->enabled ? 1 : 0;
  *every = c->every;
  *sketch_dim = c->sketch_dim;
  return 1;
}

void rankscope_agent_destroy(rankscope_agent* agent) { delete agent; }

rankscope_sketch* rankscope_sketch_create(uint32_t dim, uint64_t seed) {
  if (dim == 0 || dim > rankscope::kMaxSketchDim) return nullptr;
  return new rankscope_sketch{rankscope::CountSketch(dim, seed)};
}

void rankscope_sketch_reset(rankscope_sketch* sketch) { sketch->sketch.Reset(); }

int rankscope_sketch_add(rankscope_sketch* sketch, const void* data, int dtype, size_t n,
                         uint64_t offset) {
  if (dtype < RANKSCOPE_DTYPE_FLOAT32 || dtype > RANKSCOPE_DTYPE_FLOAT16) {
    return static_cast<int>(absl::StatusCode::kInvalidArgument);
  }
  sketch->sketch.Add(data, static_cast<rankscope::ScalarType>(dtype), n, offset);
  return 0;
}

void rankscope_sketch_values(const rankscope_sketch* sketch, float* out) {
  sketch->sketch.CopyTo(absl::MakeSpan(out, sketch->sketch.dim()));
}

double rankscope_sketch_sum_squares(const rankscope_sketch* sketch) {
  return sketch->sketch.sum_squares();
}

uint32_t rankscope_sketch_dim(const rankscope_sketch* sketch) { return sketch->sketch.dim(); }

void rankscope_sketch_destroy(rankscope_sketch* sketch) { delete sketch; }

}  // extern "C"
