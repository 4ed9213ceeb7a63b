#include "wire.h"

#include <unistd.h>

#include <algorithm>
#include <memory>

#include "rankscope/sketch.h"

namespace rankscope::internal {

v1::AgentMessage HelloMessage(const AgentOptions& options,
                              const std::optional<AgentControl>& control) {
  v1::AgentMessage msg;
  v1::Hello* h = msg.mutable_hello();
  h->set_job(options.job);
  h->set_rank(options.rank);
  h->set_world_size(options.world_size);
  h->set_sketch_dim(options.sketch_dim);
  h->set_sketch_seed(options.sketch_seed);
  h->set_attempt(options.attempt);
  h->set_host(options.host);
  h->set_agent_version(kAgentVersion);
  h->set_framework_version(options.framework_version);
  h->set_auth_token(options.auth_token);
  h->set_group(options.group);
  if (options.global_rank) h->set_global_rank(*options.global_rank);
  h->set_instance_id(options.instance_id);
  h->set_run_id(options.run_id);
  h->set_pid(static_cast<uint32_t>(getpid()));
  h->set_sketch_encoding(static_cast<v1::SketchEncoding>(options.sketch_encoding));
  h->set_sketch_block(kSketchBlock);  // the hash this agent's CountSketch uses
  for (const std::string& name : options.bucket_names) h->add_bucket_names(name);
  if (control) {
    v1::Control* c = h->mutable_control();
    c->set_generation(control->generation);
    c->set_apply_at_step(control->apply_at_step);
    c->set_enabled(control->enabled);
    c->set_every(control->every);
    c->set_sketch_dim(control->sketch_dim);
  }
  return msg;
}

MessagePtr ReportMessage(const QueuedReport& q, uint64_t seq, uint64_t dropped_total,
                         SketchEncoding encoding) {
  auto msg = std::make_shared<v1::AgentMessage>();
  v1::StepReport* r = msg->mutable_report();
  r->set_seq(seq);
  r->set_step(q.step);
  r->set_loss(q.loss);
  r->set_grad_norm(q.grad_norm);
  if (encoding == SketchEncoding::kFloat32) {
    r->mutable_sketch()->Add(q.sketch.begin(), q.sketch.end());
  } else {
    PackedSketch packed = PackSketch(q.sketch, encoding);
    r->set_sketch_packed(std::move(packed.bins));
    r->set_sketch_scale(packed.scale);
  }
  r->set_recorded_unix_nanos(q.recorded_unix_nanos);
  r->set_dropped_total(dropped_total);
  if (q.reduced_grad_fingerprint) r->set_reduced_grad_fingerprint(*q.reduced_grad_fingerprint);
  if (q.param_fingerprint) r->set_param_fingerprint(*q.param_fingerprint);
  if (q.replica_set) r->set_replica_set(*q.replica_set);
  if (q.reduced_grad_norm) r->set_reduced_grad_norm(*q.reduced_grad_norm);
  if (q.step_time_seconds) r->set_step_time_seconds(*q.step_time_seconds);
  r->set_local_batch_size(q.local_batch_size);
  r->set_loss_absent(q.loss_absent);
  r->mutable_bucket_norms()->Add(q.bucket_norms.begin(), q.bucket_norms.end());
  if (!q.reduced_sketch.empty()) {
    r->mutable_reduced_sketch()->Add(q.reduced_sketch.begin(), q.reduced_sketch.end());
    r->set_reduced_grad_mantissa_bits(q.reduced_grad_mantissa_bits);
  }
  if (!q.param_projections.empty()) {
    v1::ReplicaSummary* summary = r->mutable_param_summary();
    summary->mutable_projections()->Add(q.param_projections.begin(), q.param_projections.end());
    summary->set_rounding(q.param_rounding);
  }
  if (!q.reduced_grad_projections.empty()) {
    v1::ReplicaSummary* summary = r->mutable_reduced_grad_summary();
    summary->mutable_projections()->Add(q.reduced_grad_projections.begin(),
                                        q.reduced_grad_projections.end());
    summary->set_rounding(q.reduced_grad_rounding);
    summary->set_precision(q.reduced_grad_precision);
  }
  return msg;
}

std::optional<AgentControl> NewerControl(const v1::Control& c,
                                         const std::optional<AgentControl>& current) {
  if (current && c.generation() <= current->generation) return std::nullopt;
  AgentControl ctl;
  ctl.generation = c.generation();
  ctl.apply_at_step = c.apply_at_step();
  ctl.enabled = c.enabled();
  ctl.every = std::max<uint32_t>(c.every(), 1);
  ctl.sketch_dim = c.sketch_dim();
  return ctl;
}

}  // namespace rankscope::internal
