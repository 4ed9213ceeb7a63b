"""Sequential detection (collector/analysis/rank_cusum.h) on real 4-rank DDP runs: gloo ranks, the real
shim, the real collector, through bench/detection.py (its default seed, 3 runs per fault, the
first runs of the benchmark's own table in docs/PERFORMANCE.md).

Issue 18 asks: 10 % label noise on one rank is named within 20 steps of the onset in most runs; a
40 ms straggler is named; clean runs raise nothing. The training, and so every data signal, is
deterministic for a seed; step times are not: on this 2-core machine 4 ranks and the collector
share the CPUs, and the scheduler keeps a healthy rank a few milliseconds late (of its ~1 ms
compute) for 10 to 15 steps in a row. The slow statistic (rank_cusum.h, issue 36) counts a step
only when the rank is later than the step's median by more than max(5 ms, 1.5 times how late the
latest *other* rank usually is), so that is not named, while a 40 ms straggler is late on every
step and named 7 steps after its onset.

These tests are still marked `alone` (./run test runs them after the other Python tests, on CPUs
no other test shares), though under load they pass: replayed on the step times of 100 + 100
clean benchmark runs recorded at load averages of 20 to 55 the new statistic named nothing, and
this file passed 5 times of 5 with bench/detection.py's 4- and 8-rank runs beside it on the same
2 cores (load averages 23 to 150, 2026-11-27). Moving it into the side-by-side pass needs ./run's
`-m alone` pass removed (it would collect nothing); left to the merge (issue 36).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("rankscope._native")

pytestmark = pytest.mark.alone

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("RANKSCOPE_BUILD_DIR") or REPO / "build")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequential") / "detection.json"
    env = dict(os.environ, PYTHONPATH=str(BUILD_DIR / "python"))
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "detection.py"),
            "--build-dir",
            str(BUILD_DIR),
            "--world-sizes",
            "4",
            "--faults",
            "clean,noise10,straggler",
            "--runs-per-fault",
            "3",
            "--run-timeout",
            "120",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())["runs"]


def test_clean_runs_raise_nothing(runs):
    for run in runs:
        if run["fault"] == "clean":
            assert run["false_flags"] == [], run["job"]


def test_ten_percent_label_noise_is_named_drifting_within_20_steps_in_most_runs(runs):
    noisy = [r for r in runs if r["fault"] == "noise10"]
    assert len(noisy) == 3
    within = [r for r in noisy if r["detected"] and r["delay"] <= 20]
    assert len(within) >= 2, [(r["job"], r["delay"], r["how"]) for r in noisy]
    assert {r["how"] for r in within} == {"drifting"}
    assert all(r["false_flags"] == [] for r in noisy), [r["false_flags"] for r in noisy]


def test_a_40ms_straggler_is_named_slow(runs):
    slow = [r for r in runs if r["fault"] == "straggler"]
    assert len(slow) == 3
    for r in slow:
        assert r["detected"] and r["how"] == "slow", (r["job"], r["delay"], r["how"])
        # Late on every step: named 7 steps after the onset (rank_cusum.h); issue 36 asks for
        # within 10 on a loaded machine.
        assert r["delay"] <= 10, r["delay"]
