"""Megatron-core's DistributedDataParallel (2 gloo processes, CPU, all-reduce mode, overlapped
or not, and the distributed optimizer's reduce-scatter, 2 micro-batches a step) reporting to a
real collector through rankscope.torch.attach(model).

Megatron allocates its gradient buffers on torch.cuda.current_device() and reads
torch.cuda.current_stream(): the rank processes point both at the CPU
(framework_harness.megatron_on_cpu); the rest is Megatron's. The truth for each step comes from
the same micro-batches run through a reference replica (same weights): the local gradient is the
sum of the gradients of loss / micro-batches, the loss their mean; the collector's statistics must
equal it as the DDP truth tests require (shim_harness.check_exact_rows). In all-reduce mode
every rank holds the parameters whole: their fingerprints must agree, and the aggregation check
reads the all-reduced gradient (framework_harness.MEGATRON_CORRUPT perturbs one step's, flagged at
that step; the other steps are clean).
"""

import os

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

import framework_harness  # noqa: E402
import shim_harness  # noqa: E402
from rankscope._attach_agreement import LEAD  # noqa: E402

try:
    from megatron.core import package_info
except ImportError:
    if os.environ.get("RANKSCOPE_E2E_REQUIRED"):
        raise
    pytest.skip("megatron-core is not installed", allow_module_level=True)

WORLD = 2
STEPS = LEAD + 2  # the zero-code launch reports from step LEAD (the ranks' agreed start)
SKETCH_DIM = 1024


@pytest.fixture(scope="module")
def run(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    shim_harness.spawn(
        framework_harness.megatron_worker,
        WORLD,
        module_collector.address,
        "mg",
        str(out),
        STEPS,
        SKETCH_DIM,
        [*framework_harness.MEGATRON_SCENARIOS, *framework_harness.MEGATRON_AUTO_SCENARIOS],
        timeout=240,
    )
    return module_collector, out


@pytest.mark.parametrize("scenario", ["allreduce-accum", "overlap-accum", "distopt-accum"])
def test_megatron_ddp_statistics_equal_exact_values(run, scenario):
    """all-reduce mode (overlapped or not): every rank holds the parameters whole, their
    fingerprints agree, and every step's all-reduced gradient is checked against the mean of the
    local sketches; distributed optimizer (reduce-scatter into shards): no fingerprint, no check."""
    collector, out = run
    infos, fps = framework_harness.check_framework_job(
        collector, out, f"mg-{scenario}", scenario, WORLD, STEPS, SKETCH_DIM
    )
    rows = collector.query(
        "SELECT step, integrity_error_ratio, integrity_relative_error, integrity_fault, "
        "integrity_rank FROM step_stats WHERE job = ? ORDER BY step",
        (f"mg-{scenario}",),
    )
    assert [r[0] for r in rows] == list(range(STEPS)), rows
    if scenario == "distopt-accum":
        assert all(r[2] is None and r[3] is None for r in fps), fps
        assert all(r[1] is None for r in rows), rows
        for info in infos:
            assert "reduce-scatters" in info["integrity_unsupported"], info
            assert info["stats"].get("shim_integrity_checks_sent", 0) == 0, info
        return
    first = {r[3] for r in fps if r[0] == 0}
    assert len(first) == 1 and None not in first, fps
    # Step s is checked by rank s % WORLD (integrity_every=1).
    sent = [info["stats"].get("shim_integrity_checks_sent", 0) for info in infos]
    assert sent == [len(range(rank, STEPS, WORLD)) for rank in range(WORLD)], sent
    framework_harness.check_corrupted_sum(rows, scenario, framework_harness.MEGATRON_CORRUPT)


def test_megatron_version_outside_the_tested_ones_is_refused_and_trains(run):
    """One RuntimeWarning naming the version and mode; nothing reported; training ran. An fp16
    model (loss-scaled gradients in Megatron's buffers) is refused the same way."""
    collector, out = run
    for rank in range(WORLD):
        info = framework_harness.load(out / f"refused.rank{rank}.json")
        assert len(info["messages"]) == 2, info
        assert "megatron-core 0.99.0" in info["messages"][0], info
        assert "mode all-reduce" in info["messages"][0], info
        assert info["stats"] == {"unwatched": info["messages"][0]}, info
        fp16 = info["messages"][1]
        assert f"megatron-core {package_info.__version__}" in fp16, fp16
        assert "mode fp16 all-reduce" in fp16 and "loss scale" in fp16, fp16
    assert collector.rank_rows("mg-refused") == []
    assert collector.rank_rows("mg-refused-fp16") == []
    assert package_info.__version__.startswith("0.19.")


@pytest.mark.parametrize("scenario", ["auto-bf16", "auto-bf16-distopt"])
def test_zero_code_launch_with_megatron_mixed_precision_optimizers_is_exact(run, scenario):
    """The zero-code launch on a bf16 model stepped by Float16OptimizerWithFloat16Params or the
    DistributedOptimizer: the step boundary is the step of the torch.optim optimizer of Megatron's
    float32 main parameters (whole or this rank's shard), the local gradient the bf16 buffer's;
    every step from the agreed first one equals the bf16 reference's exact values."""
    collector, out = run
    expected = framework_harness.load(out / f"{scenario}.expected.json")
    expected = {int(k): v for k, v in expected.items() if int(k) >= LEAD}
    # A process's second attached model gets a group of its own (the job's "/<group>").
    group = framework_harness.load(out / f"{scenario}.rank0.json")["group"]
    job = f"mg-{scenario}" + (f"/{group}" if group else "")
    shim_harness.check_exact_rows(
        collector.step_rows(job), collector.rank_rows(job), expected, WORLD, 256
    )
    wrapper = "DistributedOptimizer" if "distopt" in scenario else "Float16OptimizerWithFloat16"
    for rank in range(WORLD):
        info = framework_harness.load(out / f"{scenario}.rank{rank}.json")
        assert info["state"] == "reporting" and info["messages"] == [], info
        assert info["step_boundary"].startswith(wrapper), info
        assert info["stats"]["recorded"] == STEPS - LEAD, info
        assert info["stats"].get("shim_hook_errors", 0) == 0, info


def test_zero_code_launch_refuses_a_megatron_optimizer_with_a_loss_scale(run):
    """bf16 with a loss scale (Megatron's ConstantGradScaler): the buffers hold scaled
    gradients; one warning naming megatron-core's version and the optimizer, nothing reported,
    training went on."""
    collector, out = run
    for rank in range(WORLD):
        info = framework_harness.load(out / f"auto-bf16-scaled.rank{rank}.json")
        assert info["state"] == "failed", info
        (message,) = info["messages"]
        assert f"megatron-core {package_info.__version__}" in message, message
        assert "Float16OptimizerWithFloat16Params with a loss scale" in message, message
    assert collector.rank_rows("mg-auto-bf16-scaled") == []


def test_zero_code_launch_refuses_a_distributed_optimizer_of_fp32_parameters(run):
    """DistributedOptimizer of float32 parameters steps shard views of them, no main parameters:
    no optimizer is found for the step boundary; the attachment fails naming megatron-core's
    version, nothing is reported, training went on."""
    collector, out = run
    for rank in range(WORLD):
        info = framework_harness.load(out / f"auto-fp32-distopt.rank{rank}.json")
        assert info["state"] == "failed", info
        assert f"megatron-core {package_info.__version__}: no torch.optim" in info["error"], info
        assert "main parameters" in info["error"], info
    group = framework_harness.load(out / "auto-fp32-distopt.rank0.json")["group"]
    assert collector.rank_rows("mg-auto-fp32-distopt" + (f"/{group}" if group else "")) == []


def test_attach_stops_watching_at_a_megatron_optimizer_with_a_loss_scale(run):
    """rst.attach(model) cannot see the optimizer's loss scale at attach: at the model's first
    reduction it finds the Megatron optimizer stepping its main parameters with a grad scaler,
    warns once (version, mode, optimizer) and reports nothing; training went on."""
    collector, out = run
    for rank in range(WORLD):
        info = framework_harness.load(out / f"scaled-attach.rank{rank}.json")
        (message,) = info["messages"]
        assert f"megatron-core {package_info.__version__}" in message, message
        assert "mode all-reduce with Float16OptimizerWithFloat16Params" in message, message
        assert info["stats"]["recorded"] == 0, info
    assert collector.rank_rows("mg-scaled-attach") == []
