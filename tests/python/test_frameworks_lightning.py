"""The Lightning DDP strategy (2 gloo processes, CPU, gradient accumulation 2) reporting to a
real collector through rankscope.torch.attach(lightning_module) and through the zero-code launch
(rankscope.auto.install: the Trainer is attached when it is built).

The truth for each step comes from the micro-batches Lightning fed each rank, run through a
reference replica (same weights): the local gradient is the sum over micro-batches of the
gradients of loss / accumulate_grad_batches, the loss their mean; the collector's
statistics must equal it as the DDP truth tests require (shim_harness.check_exact_rows). The
replicas' reduced gradients and parameters must agree.
"""

import importlib.util
import os

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

import framework_harness  # noqa: E402
import shim_harness  # noqa: E402

if importlib.util.find_spec("lightning") is None:  # imported by the workers only
    if os.environ.get("RANKSCOPE_E2E_REQUIRED"):
        raise ImportError("lightning is not installed (CI installs every framework)")
    pytest.skip("lightning is not installed", allow_module_level=True)

WORLD = 2
STEPS = 3
SKETCH_DIM = 1024


@pytest.fixture(scope="module")
def run(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("pl")
    shim_harness.spawn(
        framework_harness.lightning_worker,
        WORLD,
        module_collector.address,
        "pl",
        str(out),
        STEPS,
        SKETCH_DIM,
        2,
        timeout=240,
    )
    return module_collector, out


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_lightning_ddp_statistics_equal_exact_values(run, mode):
    """explicit: rankscope.torch.attach(lightning_module); auto: the zero-code launch
    (rankscope.auto.install before the Trainer is built)."""
    collector, out = run
    _, fps = framework_harness.check_framework_job(
        collector, out, f"pl-{mode}", mode, WORLD, STEPS, SKETCH_DIM
    )
    framework_harness.check_ddp_replicas(fps, STEPS)
