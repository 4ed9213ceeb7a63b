"""DeepSpeed ZeRO 0-3 (2 gloo processes on DeepSpeed's CPU accelerator) reporting through
rankscope.torch.attach(engine) to a real collector.

For every step the collector's statistics must equal the exact values each rank computes from a
reference replica (framework_harness.reference_step: the step's local gradient is the sum over
micro-batches of the gradients of loss / gradient_accumulation_steps, the loss their mean),
checked as the DDP truth tests check them (shim_harness.check_exact_rows): loss and grad-norm
dispersion and each rank's norm to float tolerance, direction consistency equal to the cosine of
ideal sketches of the exact gradients. ZeRO-2/3 reduce every micro-batch; the accumulation
scenarios hold the norm to the same exactness. Stages 0-2 fingerprint the (replicated)
parameters, which must agree across ranks; stage 3 has no replicas and sends none. ZeRO-0's
reduced gradient goes through the aggregation check every step: clean steps pass, and a
perturbation of 2e-4 of its norm added on every rank after DeepSpeed's all-reduce
(framework_harness.DEEPSPEED_CORRUPT) is flagged at its step. The
"auto-" scenario is attached by the zero-code launch (rankscope.auto.install) when the engine is
built.
"""

import importlib.util
import os

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

import framework_harness  # noqa: E402
import shim_harness  # noqa: E402

if importlib.util.find_spec("deepspeed") is None:  # imported by the workers only
    if os.environ.get("RANKSCOPE_E2E_REQUIRED"):
        raise ImportError("deepspeed is not installed (CI installs every framework)")
    pytest.skip("deepspeed is not installed", allow_module_level=True)

WORLD = 2
STEPS = 3
SKETCH_DIM = 1024
SCENARIOS = list(framework_harness.DEEPSPEED_SCENARIOS)


@pytest.fixture(scope="module")
def run(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    shim_harness.spawn(
        framework_harness.deepspeed_worker,
        WORLD,
        module_collector.address,
        "ds",
        str(out),
        STEPS,
        SKETCH_DIM,
        SCENARIOS,
        timeout=240,
    )
    return module_collector, out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_collector_statistics_equal_exact_values(run, scenario):
    collector, out = run
    stage, _ = framework_harness.DEEPSPEED_SCENARIOS[scenario]
    _, fps = framework_harness.check_framework_job(
        collector,
        out,
        f"ds-{scenario}",
        scenario,
        WORLD,
        STEPS,
        SKETCH_DIM,
        ("shim_unknown_parameters", "shim_steps_without_gradients"),
    )
    # Rows: (step, rank, reduced_grad_fingerprint, param_fingerprint).
    assert all(r[2] is None for r in fps), "the reduced gradient is partitioned: not compared"
    first = [r[3] for r in fps if r[0] == 0]
    if stage < 3:
        # The first reported step fingerprints the parameters: replicas agree.
        assert len(first) == WORLD and first[0] is not None and len(set(first)) == 1, fps
    else:
        assert all(r[3] is None for r in fps), "ZeRO-3 parameters are shards: not compared"
    # The aggregation check (rankscope.frameworks.deepspeed): ZeRO-0's reduced gradient is whole
    # before the step, checked every step; the other stages partition it and send none.
    rows = collector.query(
        "SELECT step, integrity_error_ratio, integrity_relative_error, integrity_fault, "
        "integrity_rank FROM step_stats WHERE job = ? ORDER BY step",
        (f"ds-{scenario}",),
    )
    assert [r[0] for r in rows] == list(range(STEPS)), rows
    if stage > 0:
        assert all(r[1] is None for r in rows), rows
        return
    framework_harness.check_corrupted_sum(rows, scenario, framework_harness.DEEPSPEED_CORRUPT)


def test_unsupported_version_is_refused_and_training_goes_on(run):
    _, out = run
    for rank in range(WORLD):
        r = framework_harness.load(out / f"refusal.rank{rank}.json")
        assert r["monitor"] is False
        assert len(r["messages"]) == 1 and "DeepSpeed 0.99.0 is not supported" in r["messages"][0]
        assert r["steps"] == 1
