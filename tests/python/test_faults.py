"""Faults with real processes (issue 6): a real rankscope-collector binary on a real SQLite file,
real rankscope-loadgen processes (each rank a real rankscope::Agent), real signals, a real TCP
black hole, real file-size limits and a real unprivileged user.

Each test counts what the agents recorded and dropped (loadgen --summary_json) and what SQLite
holds after a clean shutdown: stored == recorded - dropped, every (job, step, rank) once. Every wait
polls an observable condition against a generous deadline that only fails the test; nothing is
timed. Figures from one run are in docs/reliability_cases.md.
"""

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from conftest import BUILD_DIR, Collector, free_port, wait_until

LOADGEN_BIN = BUILD_DIR / "bin" / "rankscope-loadgen"
DEADLINE = 60.0  # generous: the box is shared; only a broken collector comes near it


class Loadgen:
    """A rankscope-loadgen process: ``ranks`` simulated ranks (or one, ``rank=``) of ``job``,
    with --progress lines on its log and a JSON summary at the end."""

    def __init__(
        self,
        tmp_path: Path,
        address: str,
        job: str,
        ranks: int,
        steps: int,
        name: str = "loadgen",
        **flags,
    ):
        if not LOADGEN_BIN.exists():
            pytest.skip(f"{LOADGEN_BIN} not built")
        self.summary_path = tmp_path / f"{name}.summary.json"
        self.log_path = tmp_path / f"{name}.log"
        self._log = open(self.log_path, "w")
        args = {
            "collector": address,
            "job": job,
            "ranks": ranks,
            "steps": steps,
            "step_interval": "10ms",
            "sketch_dim": 256,
            "step_time": 0,
            "max_backoff": "200ms",
            "flush_timeout": "50s",
            "progress": "true",
            "progress_interval": "100ms",
            "summary_json": self.summary_path,
        }
        args.update(flags)
        self.proc = subprocess.Popen(
            [str(LOADGEN_BIN), *(f"--{k}={v}" for k, v in args.items())],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def progress(self) -> dict:
        """The newest progress line's counters (all zero before the first line)."""
        lines = re.findall(r"loadgen: progress (.*)", self.log())
        if not lines:
            return {"step": 0, "recorded": 0, "acked": 0, "dropped": 0, "queued": 0, "unacked": 0}
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", lines[-1])}

    def recording_done(self) -> bool:
        return "loadgen: recording done" in self.log()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024

    def wait(self, timeout: float = DEADLINE) -> dict:
        """Waits for the exit; returns the summary. Fails on a non-zero exit."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"loadgen did not finish in {timeout:.0f} s:\n{self.log()}"
            ) from None
        finally:
            self._log.close()
        assert rc == 0, f"loadgen exited with {rc}:\n{self.log()}"
        return json.loads(self.summary_path.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def stored_by_rank(c: Collector, job: str) -> dict:
    return dict(
        c.query("SELECT rank, COUNT(*) FROM rank_steps WHERE job = ? GROUP BY rank", (job,))
    )


def assert_exactly_once(c: Collector, job: str, summary: dict) -> None:
    """After a clean shutdown: per rank, stored == recorded - dropped, steps distinct."""
    stored = stored_by_rank(c, job)
    for a in summary["agents"]:
        expect = a["recorded"] - a["dropped"]
        assert stored.get(a["rank"], 0) == expect, (a, stored)
        assert a["acked"] == expect, a
        assert a["rejected"] == 0 and a["invalid"] == 0, a
    # The primary key makes a duplicate row impossible; check the keys anyway.
    dup = c.query(
        "SELECT step, rank, COUNT(*) FROM rank_steps WHERE job = ? "
        "GROUP BY step, rank HAVING COUNT(*) > 1",
        (job,),
    )
    assert dup == []


@pytest.fixture
def procs():
    """Processes a test started; killed at the end whatever happened."""
    started = []
    yield started
    for p in started:
        if isinstance(p, Path):
            os.chmod(p, 0o755)
            shutil.rmtree(p, ignore_errors=True)
        elif isinstance(p, Loadgen):
            p.kill()
        elif isinstance(p, Collector) and p.proc is not None:
            p.kill()


def test_collector_sigkilled_under_load_and_restarted_loses_nothing(tmp_path, procs):
    c = Collector(tmp_path, step_timeout="2s").start()
    procs.append(c)
    job = "faults-sigkill"
    lg = Loadgen(tmp_path, c.address, job, ranks=8, steps=400, step_interval="5ms")
    procs.append(lg)
    # Under load: kill once reports are being stored.
    wait_until(lambda: sum(stored_by_rank(c, job).values()) >= 400, DEADLINE, "rows stored")
    c.kill()
    at_kill = lg.progress()
    # The job goes on while no collector runs; then a collector comes back on the same port/DB.
    wait_until(
        lambda: lg.progress()["recorded"] >= at_kill["recorded"] + 400 or lg.recording_done(),
        DEADLINE,
        "reports recorded while the collector is down",
    )
    c.restart()
    summary = lg.wait()
    dup_metric = c.metric("rankscope_reports_duplicate_total")
    received = c.metric("rankscope_reports_received_total")
    assert c.stop() == 0
    total = summary["total"]
    assert summary["flushed"] and total["dropped"] == 0, summary["total"]
    assert total["recorded"] == 8 * 400
    assert_exactly_once(c, job, summary)
    # Accounting is sane: the restarted collector saw no more reports than were sent, and every
    # duplicate it counted was a resend (sent - recorded; in practice dozens: what was in flight
    # at the kill).
    resends = total["sent"] - total["recorded"]
    assert resends >= 0
    assert received <= total["sent"]
    assert dup_metric <= resends
    print(
        f"\nsigkill: recorded={total['recorded']} stored={total['recorded']} "
        f"dropped=0 resent={resends} duplicates_seen={dup_metric:.0f} "
        f"received_after_restart={received:.0f}"
    )


def test_collector_down_when_the_job_starts_loses_nothing(tmp_path, procs):
    port = free_port()
    job = "faults-late-collector"
    lg = Loadgen(tmp_path, f"127.0.0.1:{port}", job, ranks=4, steps=300)
    procs.append(lg)
    wait_until(
        lambda: lg.progress()["recorded"] >= 400, DEADLINE, "reports recorded with no collector"
    )
    assert lg.progress()["acked"] == 0
    c = Collector(tmp_path, step_timeout="2s")
    c.port = port
    c.start()
    procs.append(c)
    summary = lg.wait()
    assert c.stop() == 0
    assert summary["flushed"] and summary["total"]["dropped"] == 0
    assert summary["total"]["recorded"] == 4 * 300
    assert_exactly_once(c, job, summary)
    print(f"\nlate collector: recorded={summary['total']['recorded']} stored=all dropped=0")


class BlackHole:
    """A TCP listener that accepts connections and never reads nor writes: a collector that is
    up but stuck. close() drops every connection and frees the port."""

    def __init__(self, port: int):
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(64)
        self.conns = []
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        self.listener.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
                self.conns.append(conn)
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self):
        self._stop = True
        self._thread.join()
        for conn in self.conns:
            # SO_LINGER {on, 0 s}: close() sends RST, so the agents see the connection die at once.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
        self.listener.close()


def test_stuck_collector_bounds_memory_never_slows_record_and_drops_are_reported(tmp_path, procs):
    port = free_port()
    hole = BlackHole(port)
    job = "faults-black-hole"
    ranks, steps = 4, 3000
    # 1 KiB sketches: an unbounded agent would grow by ~1 KiB per report (12 MiB over the run),
    # a bounded one holds at most its ring (queue_capacity) and a few writes in flight.
    lg = Loadgen(
        tmp_path,
        f"127.0.0.1:{port}",
        job,
        ranks=ranks,
        steps=steps,
        step_interval="1ms",
        sketch_dim=1024,
        max_inflight=0,
        queue_capacity=256,
        max_backoff="100ms",
    )
    procs.append(lg)
    try:
        wait_until(
            lambda: lg.progress()["recorded"] >= ranks * 500,
            DEADLINE,
            "reports recorded against the black hole",
        )
        rss_early = lg.rss_bytes()
        early = lg.progress()
        wait_until(lg.recording_done, DEADLINE, "every Record() to return")
        rss_late = lg.rss_bytes()
        late = lg.progress()
        assert len(hole.conns) >= 1, "the agents never connected to the black hole"
    finally:
        hole.close()
    # Record() never blocked: every step of every rank was recorded while nothing was acked.
    assert f"recorded={ranks * steps} in" in lg.log()
    assert late["acked"] == 0
    assert late["dropped"] > 0
    assert late["queued"] <= ranks * 256
    # Memory is bounded: growing by what the dropped reports would have taken is what a leak
    # looks like; the agents stayed far below it.
    grew = rss_late - rss_early
    dropped_bytes = (late["dropped"] - early["dropped"]) * 1024 * 4
    assert grew < 8 << 20 and grew < dropped_bytes / 4, (grew, dropped_bytes)

    # A real collector takes over the port: what the agents still hold is stored, and the drops
    # reach it (they ride on every report) and its metrics.
    c = Collector(tmp_path, step_timeout="2s")
    c.port = port
    c.start()
    procs.append(c)
    summary = lg.wait()
    dropped_total = sum(a["dropped"] for a in summary["agents"])
    assert dropped_total > 0
    assert summary["total"]["recorded"] == ranks * steps
    wait_until(
        lambda: c.metric("rankscope_agent_dropped_reports_total", train_job=job) == dropped_total,
        DEADLINE,
        "the agents' drop count in /metrics",
    )
    assert c.stop() == 0
    assert_exactly_once(c, job, summary)
    print(
        f"\nblack hole: recorded={summary['total']['recorded']} dropped={dropped_total} "
        f"stored={summary['total']['recorded'] - dropped_total} rss_early={rss_early >> 20} MiB "
        f"rss_late={rss_late >> 20} MiB (grew {grew >> 10} KiB while "
        f"{late['dropped'] - early['dropped']} reports were dropped)"
    )


def _set_fsize(pid: int, limit: str) -> None:
    subprocess.run(["prlimit", f"--pid={pid}", f"--fsize={limit}"], check=True)


def test_disk_full_is_reported_nothing_unstored_is_acked_and_all_is_stored_after(tmp_path, procs):
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) not installed")
    c = Collector(tmp_path, step_timeout="2s").start()
    procs.append(c)
    job = "faults-disk-full"
    lg = Loadgen(tmp_path, c.address, job, ranks=4, steps=400)
    procs.append(lg)
    wait_until(lambda: sum(stored_by_rank(c, job).values()) >= 100, DEADLINE, "rows stored")
    # "Disk full": every write the collector makes to a file past 4 KiB fails (EFBIG; SIGXFSZ is
    # ignored). Its log stays below that; SQLite's WAL frames do not.
    _set_fsize(c.proc.pid, "4096:unlimited")
    wait_until(
        lambda: c.metric("rankscope_store_healthy") == 0,
        DEADLINE,
        "rankscope_store_healthy to drop to 0",
    )
    stored_at_failure = sum(stored_by_rank(c, job).values())
    before = lg.progress()
    # While the store fails: /metrics is served, errors are counted, the job goes on, and
    # nothing is acked beyond what SQLite holds.
    wait_until(
        lambda: lg.progress()["recorded"] >= before["recorded"] + 200,
        DEADLINE,
        "the job to go on while the disk is full",
    )
    wait_until(
        lambda: c.metric("rankscope_store_errors_total") >= 2, DEADLINE, "failed commits counted"
    )
    during = lg.progress()
    stored_during = sum(stored_by_rank(c, job).values())
    assert stored_during == stored_at_failure  # nothing committed
    assert during["acked"] <= stored_during  # acks only for what is stored
    assert during["unacked"] + during["queued"] > 0
    assert c.metric("rankscope_store_healthy") == 0
    assert c.proc.poll() is None
    assert "SQLite write failed" in c.log() and "nothing is acked" in c.log(), c.log()

    _set_fsize(c.proc.pid, "unlimited:unlimited")  # the disk recovers
    summary = lg.wait()
    assert c.metric("rankscope_store_healthy") == 1
    errors = c.metric("rankscope_store_errors_total")
    assert c.stop() == 0
    assert "SQLite writes recovered" in c.log()
    assert summary["flushed"] and summary["total"]["dropped"] == 0
    assert_exactly_once(c, job, summary)
    print(
        f"\ndisk full: recorded={summary['total']['recorded']} stored=all dropped=0 "
        f"stored_when_full={stored_at_failure} failed_commits={errors:.0f} "
        f"acked_during<=stored_during: {during['acked']}<={stored_during}"
    )


def test_unwritable_database_is_refused_clearly_and_stored_once_fixed(tmp_path, procs):
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux) to run the collector as nobody")
    # Root ignores file modes: the collector runs as nobody on a database nobody owns.
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    # pytest's tmp dirs are root-only (0700): nobody's database lives in its own dir in /tmp.
    db_dir = Path(tempfile.mkdtemp(prefix="rankscope-nobody-"))
    procs.append(db_dir)
    os.chmod(db_dir, 0o755)
    os.chown(db_dir, 65534, 65534)
    c = Collector(tmp_path, step_timeout="2s", db_path=db_dir / "rankscope.db", prefix=nobody)
    c.start()
    procs.append(c)
    job = "faults-readonly"
    lg = Loadgen(tmp_path, c.address, job, ranks=2, steps=1000)
    procs.append(lg)
    wait_until(lambda: sum(stored_by_rank(c, job).values()) >= 50, DEADLINE, "rows stored")
    assert c.stop() == 0
    # An operator (or a broken volume) makes the database read-only while the job runs.
    os.chmod(c.db_path, 0o444)
    os.chmod(db_dir, 0o555)
    out = subprocess.run(
        [
            *nobody,
            str(Path(BUILD_DIR) / "bin" / "rankscope-collector"),
            f"--grpc_address=127.0.0.1:{c.port}",
            "--metrics_address=",
            "--http_address=",
            f"--db_path={c.db_path}",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert out.returncode == 1, out
    message = out.stderr.strip().splitlines()[-1]
    assert str(c.db_path) in message and "PERMISSION_DENIED" in message, message
    # The job goes on; the agents hold what no collector acked.
    wait_until(
        lambda: lg.progress()["acked"] < lg.progress()["recorded"],
        DEADLINE,
        "reports held by the agents",
    )
    os.chmod(db_dir, 0o755)
    os.chmod(c.db_path, 0o644)
    c.start()
    summary = lg.wait()
    assert c.stop() == 0
    assert summary["flushed"] and summary["total"]["dropped"] == 0
    assert_exactly_once(c, job, summary)
    print(
        f"\nunwritable db: exit 1 with: {message}\n"
        f"recorded={summary['total']['recorded']} stored=all dropped=0"
    )


def test_killed_rank_is_named_missing_and_its_steps_close_by_timeout(tmp_path, procs):
    # A timeout well above the ranks' skew on a loaded box: only the killed rank goes missing.
    c = Collector(tmp_path, step_timeout="3s").start()
    procs.append(c)
    job = "faults-killed-rank"
    world, victim = 4, 2
    ranks = [
        Loadgen(
            tmp_path,
            c.address,
            job,
            ranks=world,
            steps=300,
            rank=r,
            name=f"rank{r}",
            step_interval="20ms",
        )
        for r in range(world)
    ]
    procs.extend(ranks)
    wait_until(
        lambda: (
            len(c.query("SELECT step FROM step_stats WHERE job = ? AND ranks = ?", (job, world)))
            >= 10
        ),
        DEADLINE,
        "complete steps stored",
    )
    ranks[victim].proc.send_signal(signal.SIGKILL)
    ranks[victim].kill()
    survivors = [lg.wait() for i, lg in enumerate(ranks) if i != victim]
    wait_until(
        lambda: c.metric("rankscope_rank_missing", train_job=job, rank=victim) == 1,
        DEADLINE,
        "the killed rank named missing in /metrics",
    )
    timed_out = c.metric("rankscope_steps_timed_out_total", train_job=job)
    assert c.stop() == 0
    last_victim_step = c.query(
        "SELECT MAX(step) FROM rank_steps WHERE job = ? AND rank = ?", (job, victim)
    )[0][0]
    rows = c.query(
        "SELECT step, ranks, missing_ranks, timed_out FROM step_stats WHERE job = ? ORDER BY step",
        (job,),
    )
    after = [r for r in rows if r[0] > last_victim_step]
    assert after, rows[-5:]
    for step, n, missing, out in after:
        assert (n, missing, out) == (world - 1, str(victim), 1), (step, n, missing, out)
    # Every report of the survivors is stored.
    stored = stored_by_rank(c, job)
    for s in survivors:
        for a in s["agents"]:
            assert stored[a["rank"]] == a["recorded"] - a["dropped"] and a["dropped"] == 0
    print(
        f"\nkilled rank: {len(after)}+ steps closed by timeout with missing_ranks={victim}, "
        f"rankscope_steps_timed_out_total={timed_out:.0f}"
    )
