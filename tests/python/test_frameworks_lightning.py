"""The Lightning DDP strategy (2 gloo processes, CPU, gradient
accumulation 2) reporting through rankscope.torch.attach(lightning_module) to a real collector.

The truth for each step comes from the micro-batches Lightning fed each rank, run through a
reference replica (same weights): the local gradient is the sum over micro-batches of the
gradients of loss / gradient_accumulation_steps, the loss their mean; the collector's
statistics must equal it as the DDP truth tests require (shim_harness.check_exact_rows). The
replicas' reduced gradients and parameters must agree.
"""

import json
import os

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

import framework_harness  # noqa: E402
import shim_harness  # noqa: E402

try:
    import lightning.pytorch  # noqa: F401
except ImportError:
    if os.environ.get("RANKSCOPE_E2E_REQUIRED"):
        raise
    pytest.skip("lightning is not installed", allow_module_level=True)

WORLD = 2
STEPS = 3
SKETCH_DIM = 1024


def load(path):
    return json.loads(path.read_text())


def test_lightning_ddp_statistics_equal_exact_values(collector, tmp_path):
    shim_harness.spawn(
        framework_harness.lightning_worker,
        WORLD,
        collector.address,
        "pl",
        str(tmp_path),
        STEPS,
        SKETCH_DIM,
        2,
        timeout=240,
    )
    expected = {int(k): v for k, v in load(tmp_path / "pl.expected.json").items()}
    assert sorted(expected) == list(range(STEPS))
    rows = collector.step_rows("pl")
    rank_rows = collector.rank_rows("pl")
    assert len(rank_rows) == WORLD * STEPS
    shim_harness.check_exact_rows(rows, rank_rows, expected, WORLD, SKETCH_DIM)
    for rank in range(WORLD):
        stats = load(tmp_path / f"pl.rank{rank}.json")["stats"]
        assert stats["recorded"] == STEPS and stats["acked"] == STEPS, stats
        assert stats.get("shim_hook_errors", 0) == 0
        assert stats.get("shim_backward_restarts", 0) == 0
    fps = collector.query(
        "SELECT step, rank, reduced_grad_fingerprint, param_fingerprint FROM rank_steps "
        "WHERE job = 'pl' ORDER BY step, rank"
    )
    for step in range(STEPS):
        grad = {r[2] for r in fps if r[0] == step}
        assert len(grad) == 1 and None not in grad, fps
    first = {r[3] for r in fps if r[0] == 0}
    assert len(first) == 1 and None not in first, fps
