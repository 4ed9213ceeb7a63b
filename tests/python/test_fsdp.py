"""FSDP2 and FSDP1 (gloo on CPU) reporting through rankscope.torch to a real collector.

For every step the collector's statistics must equal the exact values the test computes from each
rank's full local gradient and loss on a reference replica of the unwrapped module
(fsdp_harness.exact_worker; the same checks as DDP's truth tests, shim_harness.check_exact_rows):
loss and grad-norm dispersion and each rank's norm to float tolerance, direction consistency equal
to that of ideal sketches of the exact gradients and within the sketch's error of the exact cosine.
Under gradient accumulation each micro-batch is reduced (FSDP's default), and the step's local
gradient is the micro-batches' sum.
"""

import json

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")
torch = pytest.importorskip("torch")

import fsdp_harness  # noqa: E402
import shim_harness  # noqa: E402

STEPS = 3
SKETCH_DIM = 1024


def _has_fsdp2_path():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return False
    import inspect

    return "_prepare_reduce_scatter_inputs" in inspect.getsource(FSDPParamGroup.__init__)


needs_fsdp2 = pytest.mark.skipif(
    not _has_fsdp2_path(), reason=f"torch {torch.__version__} has no FSDP2 path rankscope reads"
)


def load(path):
    return json.loads(path.read_text())


def run_exact(collector, tmp_path, job, scenario, world=2, steps=STEPS):
    shim_harness.spawn(
        fsdp_harness.exact_worker,
        world,
        collector.address,
        job,
        str(tmp_path),
        steps,
        SKETCH_DIM,
        scenario,
        timeout=120,
    )
    expected = {int(k): v for k, v in load(tmp_path / "expected.json").items()}
    stats = [load(tmp_path / f"rank{r}.json")["stats"] for r in range(world)]
    return expected, stats


def check(collector, job, expected, stats, world, reported_steps):
    rows = collector.step_rows(job)
    rank_rows = collector.rank_rows(job)
    expected = {s: e for s, e in expected.items() if s in reported_steps}
    shim_harness.check_exact_rows(rows, rank_rows, expected, world, SKETCH_DIM)
    for s in stats:
        assert s["recorded"] == len(reported_steps) and s["acked"] == len(reported_steps), s
        assert s.get("shim_hook_errors", 0) == 0 and s.get("shim_unknown_parameters", 0) == 0


@needs_fsdp2
@pytest.mark.parametrize("mode", ["shard", "replicate"])
def test_fsdp2_reports_exact_local_values(module_collector, tmp_path, mode):
    job = f"fsdp2-{mode}"
    expected, stats = run_exact(
        module_collector, tmp_path, job, {"framework": "fsdp2", "mode": mode}
    )
    check(module_collector, job, expected, stats, 2, range(STEPS))


@needs_fsdp2
def test_fsdp2_hsdp_reports_exact_local_values_of_all_four_ranks(module_collector, tmp_path):
    job = "fsdp2-hsdp"
    expected, stats = run_exact(
        module_collector, tmp_path, job, {"framework": "fsdp2", "mode": "hsdp"}, world=4, steps=2
    )
    check(module_collector, job, expected, stats, 4, range(2))


@needs_fsdp2
def test_fsdp2_micro_batches_sum_to_the_steps_exact_local_gradient(module_collector, tmp_path):
    """Each of 3 micro-batches is reduced; kept from the start, every step's norm is the exact
    norm of the micro-batches' sum and its sketch the sketch of that sum."""
    job = "fsdp2-accum"
    scenario = {"framework": "fsdp2", "mode": "shard", "accum": 3, "keep": True}
    expected, stats = run_exact(module_collector, tmp_path, job, scenario)
    check(module_collector, job, expected, stats, 2, range(STEPS))


@needs_fsdp2
def test_fsdp2_micro_batches_by_default_skip_only_the_first_step(module_collector, tmp_path):
    """By default the running sum is kept from the step after the first one that reduced a
    parameter twice: that step is not reported (counted), the next ones are, exactly."""
    job = "fsdp2-accum-auto"
    scenario = {"framework": "fsdp2", "mode": "shard", "accum": 2}
    expected, stats = run_exact(module_collector, tmp_path, job, scenario)
    check(module_collector, job, expected, stats, 2, range(1, STEPS))
    assert all(s["shim_accumulation_unseen"] == 1 for s in stats)


def test_fsdp1_reports_exact_local_values(module_collector, tmp_path):
    job = "fsdp1-full"
    expected, stats = run_exact(
        module_collector, tmp_path, job, {"framework": "fsdp1", "mode": "FULL_SHARD"}
    )
    check(module_collector, job, expected, stats, 2, range(STEPS))


def test_fsdp1_micro_batches_kept_are_exact(module_collector, tmp_path):
    job = "fsdp1-accum"
    scenario = {"framework": "fsdp1", "mode": "SHARD_GRAD_OP", "accum": 2, "keep": True}
    expected, stats = run_exact(module_collector, tmp_path, job, scenario)
    check(module_collector, job, expected, stats, 2, range(STEPS))


@pytest.mark.parametrize(
    "framework,mode",
    [("fsdp1", "FULL_SHARD"), ("fsdp1", "NO_SHARD")]
    + ([("fsdp2", "shard"), ("fsdp2", "replicate")] if _has_fsdp2_path() else []),
)
def test_training_is_bit_identical_with_and_without_rankscope(tmp_path, framework, mode):
    shim_harness.spawn(
        fsdp_harness.identical_worker, 2, str(tmp_path), 3, framework, mode, timeout=120
    )
    for r in range(2):
        out = load(tmp_path / f"rank{r}.json")
        assert out["same"] == [True, True, True], out
        assert out["errors"] == 0 and out["buckets"] > 0, out  # rankscope did see gradients


def test_fsdp1_hybrid_shard_is_refused_with_one_message_and_training_goes_on(tmp_path):
    shim_harness.spawn(fsdp_harness.refusal_worker, 2, str(tmp_path), timeout=120)
    for r in range(2):
        out = load(tmp_path / f"rank{r}.json")
        assert len(out["messages"]) == 1, out
        msg = out["messages"][0]
        assert "HYBRID_SHARD" in msg and f"torch {torch.__version__}" in msg, msg
        assert "unwatched" in msg
        assert out["steps"] == 2 and "unwatched" in out["stats"]


def test_compiled_ddp_model_reports_exact_local_values(module_collector, tmp_path):
    """torch.compile of a DDP model (the default ddp_optimizer mode keeps DDP's C++ reducer and
    its bucket hooks): the same exact values as eager DDP."""
    job = "compiled-ddp"
    expected, stats = run_exact(
        module_collector, tmp_path, job, {"framework": "compile", "mode": "ddp_optimizer"}
    )
    check(module_collector, job, expected, stats, 2, range(STEPS))
