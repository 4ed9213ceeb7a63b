"""Sequential detection (collector/analysis/rank_cusum.h) on real 4-rank DDP runs: gloo ranks, the real
shim, the real collector, through bench/detection.py (its default seed, 3 runs per fault, the
first runs of the benchmark's own table in docs/PERFORMANCE.md).

Issue 18 asks: 10 % label noise on one rank is named within 20 steps of the onset in most runs; a
40 ms straggler is named; clean runs raise nothing. The training, and so every data signal, is
deterministic for a seed; step times are not: on this 2-core machine 4 ranks and the collector
share the CPUs, and a healthy rank can be the latest, by a few hundred microseconds of its ~1 ms
compute, on most of 15 steps. The slow statistic's slowdown floor (rank_cusum.h: late by no more
than max(1 ms, 5 % of the median) is not late) is what keeps that from being named; without it
a replay of this fixture's runs under load named a healthy rank slow (run noise10 #1).

The floor does not cover a machine oversubscribed by other tests: with a second test file's ranks
on the same 2 cores (./run test's side-by-side pass), a clean run's healthy rank was really late,
past the floor, for long enough to be named slow (CI, clean run 0 at seed 17, rank 2 at step 36).
That is a true statement about the run, not a false alarm of the statistic, so these tests are
marked `alone`: ./run test runs them after the other Python tests, on CPUs no other test shares.
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
        # Slowest on every step: the fixed delay of rank_cusum.h (11 steps at W = 4), give or
        # take what the rank had accumulated before the onset.
        assert r["delay"] <= 12, r["delay"]
