"""`rankscope attach --pid` into a live Hugging Face Trainer job (tests/python/hf_attach_target.py:
2 gloo ranks on the CPU, accelerate's DDP backend, 2 micro-batches a step) that never imported
rankscope, against a real collector.

The live attachment takes the DDP model the Trainer built (comm hook), the step from the
optimizer that accelerate's AcceleratedOptimizer wraps, and the step's loss as the sum of the
backward losses (the Trainer divides each micro-batch's loss by the accumulation steps). Every
reported step must equal the job's exact truth: each rank's loss and gradient norm, and direction
consistency within the sketch's error of the exact cosine.
"""

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

from conftest import CLI_BIN, free_port, wait_until  # noqa: E402

if importlib.util.find_spec("transformers") is None:  # imported by the workers only
    if os.environ.get("RANKSCOPE_E2E_REQUIRED"):
        raise ImportError("transformers is not installed (CI installs every framework)")
    pytest.skip("transformers is not installed", allow_module_level=True)

TARGET = Path(__file__).resolve().parent / "hf_attach_target.py"
WORLD = 2


# backend -> (the target's flags, the path each rank's attach prints)
BACKENDS = {
    "ddp": ((), "path: comm hook"),
    "fsdp2": (("--fsdp2",), "path: FSDP2 FSDP: reduce-scatter inputs"),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_attach_to_a_running_trainer_reports_every_step_exactly(
    module_collector, tmp_path, backend
):
    """``fsdp2``: accelerate's FSDP2 backend (fully_shard of the whole model, each micro-batch
    reduced): its root is found on the heap, both ranks start at one step agreed on the
    collectives of the model's mesh, numbered by AdamW's count (the Trainer's global step)."""
    if not CLI_BIN.exists():
        pytest.skip(f"{CLI_BIN} not built")
    flags, path = BACKENDS[backend]
    job = f"hf-live-{backend}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["PYTHONPATH"] = str(TARGET.parent)
    port = free_port()
    procs = []
    for r in range(WORLD):
        log = open(tmp_path / f"rank{r}.log", "w")
        cmd = [sys.executable, str(TARGET), "--rank", str(r), "--world", str(WORLD)]
        cmd += ["--port", str(port), "--dir", str(tmp_path), *flags]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))

    def progress(step):
        for r, p in enumerate(procs):
            if p.poll() is not None:
                raise AssertionError(
                    f"rank {r} exited: {(tmp_path / f'rank{r}.log').read_text()[-2000:]}"
                )
        try:
            return int((tmp_path / "progress").read_text()) >= step
        except (OSError, ValueError):
            return False

    try:
        wait_until(lambda: progress(2), 120, "the Trainer to reach step 2")
        out = subprocess.run(
            [
                str(CLI_BIN),
                "attach",
                f"--job={job}",
                f"--collector={module_collector.address}",
                *[str(p.pid) for p in procs],
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        starts = [int(s) for s in re.findall(r"reporting from step (\d+)", out.stdout)]
        assert len(starts) == WORLD and len(set(starts)) == 1, out.stdout
        assert out.stdout.count(path) == WORLD, out.stdout
        first = starts[0]
        wait_until(lambda: progress(first + 4), 120, "four reported steps")
        (tmp_path / "stop").write_text("2")
        deadline = time.monotonic() + 120
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]

    expected = {int(k): v for k, v in json.loads((tmp_path / "expected.json").read_text()).items()}
    rows = module_collector.step_rows(job)
    last = max(expected)
    assert sorted(rows) == list(range(first, last + 1)), "every step from the first reported"
    ranks = {}
    for step, rank, loss, gn, _ in module_collector.rank_rows(job):
        ranks.setdefault(step, {})[rank] = (loss, gn)
    for step in range(first, last + 1):
        r, e = rows[step], expected[step]
        assert r["ranks"] == WORLD and r["missing_ranks"] == "", (step, r)
        assert [ranks[step][k][0] for k in range(WORLD)] == pytest.approx(e["losses"], rel=1e-6)
        assert [ranks[step][k][1] for k in range(WORLD)] == pytest.approx(e["norms"], rel=1e-6)
        assert r["loss_mean"] == pytest.approx(statistics.fmean(e["losses"]), rel=1e-6)
        assert abs(r["grad_cosine_mean"] - e["cosine"]) < 4 * (2 / 4096) ** 0.5
