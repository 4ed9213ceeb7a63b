"""Crash consistency of the store's maintenance (issue 34, item 4): the real collector SIGKILLed in
the middle of a downsampling fold, a pruning (drop-steps) transaction, an incremental vacuum and
a schema migration, each stopped deterministically at a named point by the testing-only
RANKSCOPE_TEST_CRASH_AT (common/crash_point.h): no sleep-and-kill.

After every kill: ``PRAGMA integrity_check`` is ok, every acknowledged report is still stored (or
was pruned by a committed action, as retention meant to), the interrupted action left nothing
half done, and the next start resumes the interrupted work to its end.

One job of 8 simulated ranks (tools/loadgen, the real agent library; it exits 0 only when every
report is acked) runs 120 steps; with the collector stopped, the wall times of steps 0..99 are
moved 100 days back, so that the default retention downsamples their rank rows (7 d), then
drops the steps (90 d), then vacuums the freed pages: each restart with a crash point gets one
action further than the one before.
"""

import os
import signal
import sqlite3
import subprocess
from pathlib import Path


from conftest import COLLECTOR_BIN, Collector, age_steps, filled_store, free_port, wait_until

FIXTURE_V4 = Path(__file__).resolve().parents[1] / "collector" / "testdata" / "schema_v4.sql"
JOB = "crash-maint"
STEPS, RANKS, OLD = 120, 8, 100  # steps < OLD are 100 days old


def crash_at(db_path: Path, point: str, log_dir: Path) -> str:
    """Runs the collector on ``db_path`` with RANKSCOPE_TEST_CRASH_AT=``point``; returns its log
    once it has SIGKILLed itself there."""
    log = log_dir / f"crash-{point}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(COLLECTOR_BIN),
                f"--grpc_address=127.0.0.1:{free_port()}",
                "--metrics_address=127.0.0.1:0",
                "--http_address=127.0.0.1:0",
                f"--db_path={db_path}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, RANKSCOPE_TEST_CRASH_AT=point),
        )
        try:
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert rc == -signal.SIGKILL, f"exit {rc}, not SIGKILLed at {point}:\n{text}"
    assert f"RANKSCOPE_TEST_CRASH_AT={point}: SIGKILL" in text, text
    return text


def read(db_path: Path, sql: str, params=()) -> list:
    con = sqlite3.connect(str(db_path))
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def integrity_ok(db_path: Path) -> None:
    assert read(db_path, "PRAGMA integrity_check") == [("ok",)]


RANK_ROWS = "SELECT step, rank, loss, grad_norm, grad_cosine FROM rank_steps WHERE job = ? "
STEP_ROWS = "SELECT step, ranks, loss_mean, grad_norm_mean FROM step_stats WHERE job = ? "


def test_sigkill_inside_each_maintenance_step_loses_nothing_and_resumes(tmp_path):
    c = filled_store(tmp_path, JOB, RANKS, STEPS)
    db = c.db_path
    ranks_before = read(db, RANK_ROWS + "ORDER BY step, rank", (JOB,))
    steps_before = read(db, STEP_ROWS + "ORDER BY step", (JOB,))
    assert len(ranks_before) == STEPS * RANKS and len(steps_before) == STEPS
    young_ranks = [r for r in ranks_before if r[0] >= OLD]
    young_steps = [r for r in steps_before if r[0] >= OLD]
    age_steps(db, JOB, OLD, 100 * 86400)

    # 1. Inside the downsampling fold: rolled back whole (rows kept, no window, no progress).
    crash_at(db, "store_downsample_fold", tmp_path)
    integrity_ok(db)
    assert read(db, RANK_ROWS + "ORDER BY step, rank", (JOB,)) == ranks_before
    assert read(db, "SELECT count(*) FROM rank_windows WHERE job = ?", (JOB,)) == [(0,)]
    assert read(db, "SELECT next_step FROM downsampled WHERE job = ?", (JOB,)) == []

    # 2. The fold resumes and commits; the next action, dropping the steps, is killed inside.
    crash_at(db, "store_drop_steps", tmp_path)
    integrity_ok(db)
    assert read(db, "SELECT next_step FROM downsampled WHERE job = ?", (JOB,)) == [(OLD,)]
    windows = read(db, "SELECT sum(rows) FROM rank_windows WHERE job = ?", (JOB,))
    assert windows == [(OLD * RANKS,)], windows  # every old rank row is in a window
    assert read(db, STEP_ROWS + "ORDER BY step", (JOB,)) == steps_before  # drop rolled back
    assert read(db, RANK_ROWS + "AND step >= ? ORDER BY step, rank", (JOB, OLD)) == young_ranks

    # 3. The drop resumes and commits; the vacuum of the freed pages is killed inside.
    crash_at(db, "store_incremental_vacuum", tmp_path)
    integrity_ok(db)
    assert read(db, STEP_ROWS + "ORDER BY step", (JOB,)) == young_steps
    assert read(db, RANK_ROWS + "ORDER BY step, rank", (JOB,)) == young_ranks
    assert read(db, "PRAGMA freelist_count")[0][0] > 0  # the vacuum did not commit

    # 4. A normal start finishes the vacuum; nothing acknowledged and young is missing.
    c.start()
    try:
        wait_until(
            lambda: c.query("PRAGMA freelist_count") == [(0,)], 60, "the vacuum to resume and end"
        )
        assert c.query(STEP_ROWS + "ORDER BY step", (JOB,)) == young_steps
        assert c.query(RANK_ROWS + "ORDER BY step, rank", (JOB,)) == young_ranks
    finally:
        assert c.stop() == 0
    integrity_ok(db)

    # 5. A schema migration (a schema-4 file) killed before its commit: still schema 4 with its
    # rows; the next start migrates it.
    old_db = tmp_path / "v4.db"
    con = sqlite3.connect(str(old_db))
    con.executescript(FIXTURE_V4.read_text())
    con.commit()
    con.close()
    v4_ranks = read(old_db, RANK_ROWS + "ORDER BY step, rank", ("v4-job",))
    assert v4_ranks and read(old_db, "PRAGMA user_version") == [(4,)]
    crash_at(old_db, "store_schema_migration", tmp_path)
    integrity_ok(old_db)
    assert read(old_db, "PRAGMA user_version") == [(4,)]
    assert read(old_db, RANK_ROWS + "ORDER BY step, rank", ("v4-job",)) == v4_ranks
    migrated = Collector(tmp_path, db_path=old_db).start()
    try:
        assert migrated.query("PRAGMA user_version")[0][0] > 4
        assert migrated.query(RANK_ROWS + "ORDER BY step, rank", ("v4-job",)) == v4_ranks
    finally:
        assert migrated.stop() == 0
    integrity_ok(old_db)
