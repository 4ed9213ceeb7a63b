// The agent's wire conversion: hello, report and control.
#include "wire.h"

#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace rankscope::internal {
namespace {

TEST(WireTest, HelloCarriesTheOptions) {
  AgentOptions o;
  o.job = "exp-42";
  o.rank = 3;
  o.world_size = 8;
  o.sketch_dim = 64;
  o.sketch_seed = 7;
  o.attempt = 2;
  o.host = "node-1";
  o.framework_version = "torch 1.13.1";
  o.auth_token = "secret";
  const v1::AgentMessage msg = HelloMessage(o);
  ASSERT_TRUE(msg.has_hello());
  const v1::Hello& h = msg.hello();
  EXPECT_EQ(h.job(), "exp-42");
  EXPECT_EQ(h.rank(), 3u);
  EXPECT_EQ(h.world_size(), 8u);
  EXPECT_EQ(h.sketch_dim(), 64u);
  EXPECT_EQ(h.sketch_seed(), 7u);
  EXPECT_EQ(h.attempt(), 2u);
  EXPECT_EQ(h.host(), "node-1");
  EXPECT_EQ(h.agent_version(), kAgentVersion);
  EXPECT_EQ(h.framework_version(), "torch 1.13.1");
  EXPECT_EQ(h.auth_token(), "secret");
  EXPECT_FALSE(h.has_control());

  AgentControl control;
  control.generation = 77;
  control.apply_at_step = 120;
  control.enabled = false;
  control.every = 4;
  control.sketch_dim = 512;
  const v1::Hello with = HelloMessage(o, control).hello();
  ASSERT_TRUE(with.has_control());
  EXPECT_EQ(with.control().generation(), 77u);
  EXPECT_EQ(with.control().apply_at_step(), 120u);
  EXPECT_FALSE(with.control().enabled());
  EXPECT_EQ(with.control().every(), 4u);
  EXPECT_EQ(with.control().sketch_dim(), 512u);
}

TEST(WireTest, PackedEncodingsCarryBytesAndScaleAndTheHelloStatesThem) {
  AgentOptions options;
  options.job = "exp-42";
  EXPECT_EQ(HelloMessage(options).hello().sketch_encoding(), v1::SKETCH_ENCODING_FLOAT32);
  // The hash block of this agent's sketch, so a job of mixed versions is refused.
  EXPECT_EQ(HelloMessage(options).hello().sketch_block(), kSketchBlock);
  EXPECT_EQ(kSketchBlock, 32u);
  QueuedReport q;
  q.step = 3;
  q.sketch = {1.0f, -2.0f, 3.5f, 0.0f};
  for (SketchEncoding e : {SketchEncoding::kFloat16, SketchEncoding::kInt8}) {
    options.sketch_encoding = e;
    EXPECT_EQ(static_cast<int>(HelloMessage(options).hello().sketch_encoding()),
              static_cast<int>(e));
    MessagePtr msg = ReportMessage(q, 1, 0, e);
    const v1::StepReport& r = msg->report();
    EXPECT_EQ(r.sketch_size(), 0);
    const PackedSketch expected = PackSketch(q.sketch, e);
    EXPECT_EQ(r.sketch_packed(), expected.bins);
    EXPECT_EQ(r.sketch_scale(), expected.scale);
    EXPECT_EQ(r.sketch_packed().size(), q.sketch.size() * SketchBytesPerBin(e));
  }
  // float32 stays `repeated float sketch`, as old agents sent it.
  MessagePtr f32 = ReportMessage(q, 1, 0, SketchEncoding::kFloat32);
  EXPECT_EQ(f32->report().sketch_size(), 4);
  EXPECT_TRUE(f32->report().sketch_packed().empty());
}

TEST(WireTest, ReportCarriesEveryFieldAndOnlyTheOptionalOnesGiven) {
  QueuedReport q;
  q.step = 12;
  q.loss = 1.5;
  q.grad_norm = 2.5;
  q.sketch = {1.0f, -2.0f, 3.5f};
  q.recorded_unix_nanos = 123456789;
  q.local_batch_size = 32;
  MessagePtr bare = ReportMessage(q, 9, 4);
  ASSERT_TRUE(bare->has_report());
  const v1::StepReport& r = bare->report();
  EXPECT_EQ(r.seq(), 9u);
  EXPECT_EQ(r.step(), 12u);
  EXPECT_EQ(r.loss(), 1.5);
  EXPECT_EQ(r.grad_norm(), 2.5);
  EXPECT_EQ(std::vector<float>(r.sketch().begin(), r.sketch().end()), q.sketch);
  EXPECT_EQ(r.recorded_unix_nanos(), 123456789);
  EXPECT_EQ(r.dropped_total(), 4u);
  EXPECT_EQ(r.local_batch_size(), 32u);
  EXPECT_FALSE(r.has_reduced_grad_fingerprint());
  EXPECT_FALSE(r.has_param_fingerprint());
  EXPECT_FALSE(r.has_reduced_grad_norm());
  EXPECT_FALSE(r.has_step_time_seconds());
  EXPECT_FALSE(r.has_param_summary());
  EXPECT_FALSE(r.has_reduced_grad_summary());
  EXPECT_FALSE(r.has_replica_set());  // absent: the one set of the whole group

  q.reduced_grad_fingerprint = 0xfedcba9876543210ull;
  q.param_fingerprint = 0;
  q.replica_set = 0;  // set 0 is a set (HSDP's shard index 0), not "absent"
  q.reduced_grad_norm = 0.25;
  q.step_time_seconds = 0.125;
  MessagePtr full = ReportMessage(q, 10, 0);
  EXPECT_EQ(full->report().reduced_grad_fingerprint(), 0xfedcba9876543210ull);
  EXPECT_TRUE(full->report().has_param_fingerprint());
  EXPECT_EQ(full->report().param_fingerprint(), 0u);
  EXPECT_TRUE(full->report().has_replica_set());
  EXPECT_EQ(full->report().replica_set(), 0u);
  EXPECT_EQ(full->report().reduced_grad_norm(), 0.25);
  EXPECT_EQ(full->report().step_time_seconds(), 0.125);
  EXPECT_FALSE(full->report().has_param_summary());

  // The tolerance replica check's summaries.
  q.param_projections = {1.0, -2.0, 3.0, -4.0};
  q.param_rounding = 1e-7;
  q.reduced_grad_projections = {0.5, 0.25, -0.125, 8.0};
  q.reduced_grad_rounding = 2e-7;
  q.reduced_grad_precision = 24;
  MessagePtr summarized = ReportMessage(q, 11, 0);
  const v1::ReplicaSummary& ps = summarized->report().param_summary();
  EXPECT_EQ(std::vector<double>(ps.projections().begin(), ps.projections().end()),
            q.param_projections);
  EXPECT_EQ(ps.rounding(), 1e-7);
  EXPECT_EQ(ps.precision(), 0u);
  const v1::ReplicaSummary& gs = summarized->report().reduced_grad_summary();
  EXPECT_EQ(std::vector<double>(gs.projections().begin(), gs.projections().end()),
            q.reduced_grad_projections);
  EXPECT_EQ(gs.rounding(), 2e-7);
  EXPECT_EQ(gs.precision(), 24u);
}

TEST(WireTest, ControlIsAdoptedOnlyWhenNewer) {
  v1::Control c;
  c.set_generation(2);
  c.set_apply_at_step(100);
  c.set_enabled(false);
  c.set_every(0);
  c.set_sketch_dim(256);
  std::optional<AgentControl> first = NewerControl(c, std::nullopt);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->generation, 2u);
  EXPECT_EQ(first->apply_at_step, 100u);
  EXPECT_FALSE(first->enabled);
  EXPECT_EQ(first->every, 1u);  // 0 read as 1
  EXPECT_EQ(first->sketch_dim, 256u);

  EXPECT_FALSE(NewerControl(c, first).has_value());  // same generation
  c.set_generation(1);
  EXPECT_FALSE(NewerControl(c, first).has_value());  // older
  c.set_generation(3);
  c.set_every(4);
  std::optional<AgentControl> next = NewerControl(c, first);
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->generation, 3u);
  EXPECT_EQ(next->every, 4u);
}

}  // namespace
}  // namespace rankscope::internal
