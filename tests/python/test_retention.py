"""Storage lifecycle end to end: a real collector prunes a real job's old per-rank rows into
rank_windows, and `rankscope export` / `report` (from the collector and from the file) read the
downsampled range and say so.

A job of 8 simulated ranks (tools/loadgen, the real agent library) runs 40 steps, rank 5 an
outlier from step 25. With the collector stopped, the stored wall times of steps 0..19 are moved
30 days back (what a month of waiting would do); the collector restarts with its default
--retention_rank_steps=7d, and its store thread downsamples those steps. The expected windows are
computed here from the rows as they were before the pruning.
"""

import csv
import io
import json
import math
import sqlite3

import pytest

from conftest import age_steps, filled_store, wait_until
from test_cli import cli

JOB = "retention-a"
STEPS, RANKS, OUTLIER, OLD = 40, 8, 5, 20  # steps < OLD are a month old
THRESHOLD = 6.0  # rank_diagnostics.h's outlier threshold


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    c = filled_store(
        tmp_path_factory.mktemp("retention"),
        JOB,
        RANKS,
        STEPS,
        f"--outlier_rank={OUTLIER}",
        "--outlier_from_step=25",
        "--outlier_loss_shift=5",
    )
    try:
        con = sqlite3.connect(str(c.db_path))
        cols = (
            "step",
            "rank",
            "loss",
            "grad_norm",
            "grad_cosine",
            "outlier_score",
            "nonfinite",
            "replica_ok",
        )
        before = [
            dict(zip(cols, r))
            for r in con.execute(
                f"SELECT {', '.join(cols)} FROM rank_steps WHERE job = ? ORDER BY step, rank",
                (JOB,),
            )
        ]
        lists = {
            s: ",".join(x for x in (o, d, dr, sl) if x)
            for s, o, d, dr, sl in con.execute(
                "SELECT step, outlier_ranks, replica_divergent_ranks, drifting_ranks, slow_ranks "
                "FROM step_stats WHERE job = ?",
                (JOB,),
            )
        }
        con.close()
        age_steps(c.db_path, JOB, OLD, 30 * 86400)  # a month
        c.restart()
        # The store thread's first retention check runs at start; wait for its outcome.
        wait_until(
            lambda: c.query("SELECT next_step FROM downsampled WHERE job = ?", (JOB,)) == [(OLD,)],
            30,
            "steps < 20 to be downsampled",
        )
        yield c, before, lists
    finally:
        if c.proc is not None:
            c.stop()


def flagged(row, lists) -> bool:
    named = lists.get(row["step"], "")
    return (
        row["nonfinite"] != 0
        or (row["outlier_score"] or 0) >= THRESHOLD
        or row["replica_ok"] == 0
        or str(row["rank"]) in named.split(",")
    )


def expected_windows(before):
    """(first_step, rank) -> {metric: (min, mean, max)} over the pruned steps' rows."""
    out = {}
    for rank in range(RANKS):
        rows = [r for r in before if r["rank"] == rank and r["step"] < OLD]
        out[(0, rank)] = {
            m: (min(v), sum(v) / len(v), max(v))
            for m in ("loss", "grad_norm", "grad_cosine", "outlier_score")
            for v in [[r[m] for r in rows if r[m] is not None]]
        }
        out[(0, rank)]["rows"] = len(rows)
    return out


def check_window(row: dict, want: dict) -> None:
    assert int(row["rows"]) == want["rows"]
    for m in ("loss", "grad_norm", "grad_cosine", "outlier_score"):
        lo, mean, hi = want[m]
        assert float(row[f"{m}_min"]) == lo, m
        assert float(row[f"{m}_max"]) == hi, m
        # SQLite and Python add the same values in possibly different orders.
        assert math.isclose(float(row[f"{m}_mean"]), mean, rel_tol=1e-12, abs_tol=1e-15), m


def test_export_windows_csv_from_the_collector_and_the_file(pruned):
    c, before, _ = pruned
    want = expected_windows(before)
    for source in ([], [f"--db={c.db_path}"]):
        out = cli("export", f"--job={JOB}", "--format=csv", "--table=windows", *source, collector=c)
        rows = list(csv.DictReader(io.StringIO(out.stdout)))
        assert {(int(r["first_step"]), int(r["rank"])) for r in rows} == set(want)
        for r in rows:
            assert int(r["last_step"]) == 99
            check_window(r, want[(int(r["first_step"]), int(r["rank"]))])
        assert f"rows of steps before {OLD} were pruned" in out.stderr, out.stderr


def test_export_ranks_keeps_only_flagged_rows_of_the_pruned_range(pruned):
    c, before, lists = pruned
    out = cli(
        "export", f"--job={JOB}", "--format=csv", "--table=ranks", f"--db={c.db_path}", collector=c
    )
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    old = sorted((int(r["step"]), int(r["rank"])) for r in rows if int(r["step"]) < OLD)
    assert old == sorted(
        (r["step"], r["rank"]) for r in before if r["step"] < OLD and flagged(r, lists)
    )
    recent = [r for r in rows if int(r["step"]) >= OLD]
    assert len(recent) == (STEPS - OLD) * RANKS  # untouched
    assert "downsampled rank windows cover them" in out.stderr


def test_export_json_says_what_was_downsampled(pruned):
    c, before, _ = pruned
    want = expected_windows(before)
    for source in ([], [f"--db={c.db_path}"]):
        data = json.loads(
            cli("export", f"--job={JOB}", "--format=json", *source, collector=c).stdout
        )
        assert int(data["downsampled_before_step"]) == OLD
        assert len(data["steps"]) == STEPS  # step_stats live until --retention_steps
        windows = data["rank_windows"]
        assert len(windows) == RANKS
        for w in windows:
            check_window(w, want[(int(w.get("first_step", 0)), int(w.get("rank", 0)))])
    # A range entirely after the pruned steps has no windows.
    data = json.loads(
        cli("export", f"--job={JOB}", "--format=json", f"--first_step={OLD}", collector=c).stdout
    )
    assert data.get("rank_windows", []) == []


def test_report_draws_the_downsampled_range_from_the_collector_and_the_file(pruned, tmp_path):
    c, _, _ = pruned
    for i, source in enumerate(([], [f"--db={c.db_path}"])):
        png = tmp_path / f"report{i}.png"
        out = cli("report", f"--job={JOB}", "-o", str(png), *source, collector=c, timeout=120)
        assert f"steps < {OLD} from {RANKS} downsampled rank windows" in out.stdout, out.stdout
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
