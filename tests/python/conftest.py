"""Fixtures for the Python suites: a real rankscope-collector on free ports with a temp database.

The build directory is $RANKSCOPE_BUILD_DIR (default <repo>/build); its python/ folder must be on
PYTHONPATH (./run test does both). Every wait here polls a condition against a deadline.

With RANKSCOPE_TEST_INSTALLED=1 the suites test the installed wheel instead (./run test's wheel
stage): the package is the one this Python imports from its site-packages (no PYTHONPATH; the
session fails if it is imported from anywhere else), and the collector and the CLI are the
wheel's console scripts beside this interpreter (<env>/bin/rankscope-collector, <env>/bin/rankscope),
which exec the binaries in site-packages/rankscope/_bin. RANKSCOPE_BUILD_DIR is not read then.
"""

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# Assertions in the shared DDP harness report their operands like a test's own.
pytest.register_assert_rewrite("shim_harness")

REPO = Path(__file__).resolve().parents[2]
INSTALLED = os.environ.get("RANKSCOPE_TEST_INSTALLED") == "1"
BUILD_DIR = Path(os.environ.get("RANKSCOPE_BUILD_DIR") or REPO / "build")
if not BUILD_DIR.is_absolute():
    BUILD_DIR = (REPO / BUILD_DIR).resolve()
if INSTALLED:
    # The console scripts pip put beside this interpreter (not sys.executable's resolved path:
    # a virtual environment's python is a link to the base interpreter).
    SCRIPTS_DIR = Path(sys.executable).parent
    COLLECTOR_BIN = SCRIPTS_DIR / "rankscope-collector"
    CLI_BIN = SCRIPTS_DIR / "rankscope"
    PYTHON_DIR = None
else:
    COLLECTOR_BIN = BUILD_DIR / "bin" / "rankscope-collector"
    CLI_BIN = BUILD_DIR / "bin" / "rankscope"
    PYTHON_DIR = BUILD_DIR / "python"


def child_pythonpath(*dirs, autostart: bool = False) -> str:
    """A child process's PYTHONPATH: the folder of the rankscope package under test (the build's
    python/; none when testing the installed wheel), with ``autostart`` the folder of the
    package's sitecustomize.py (RANKSCOPE_AUTO=1; the wheel's rankscope/_autostart), then
    ``dirs``."""
    paths = []
    if PYTHON_DIR is not None:
        paths.append(str(PYTHON_DIR))
    if autostart and INSTALLED:
        import rankscope

        paths.append(str(Path(rankscope.__file__).parent / "_autostart"))
    paths += [str(d) for d in dirs]
    return ":".join(paths)


# Child processes (DDP workers spawned by torch.multiprocessing) import rankscope and the
# harness from these folders.
for _p in ([] if PYTHON_DIR is None else [str(PYTHON_DIR)]) + [str(Path(__file__).parent)]:
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "alone: the test measures step times, so ./run test runs it after the side-by-side pass, "
        "with no other test's processes sharing the CPUs (tests/python/test_sequential.py)",
    )


def pytest_sessionstart(session):
    """Testing the installed wheel: fails the session unless rankscope comes from this Python's
    site-packages. (A hook, not at import: the attach tests' jobs import this file through
    shim_harness and must not import rankscope.)"""
    if not INSTALLED:
        return
    import sysconfig

    import rankscope

    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    if Path(rankscope.__file__).resolve().parent.parent not in site:
        raise pytest.UsageError(
            f"RANKSCOPE_TEST_INSTALLED=1 but rankscope was imported from {rankscope.__file__}, "
            f"not from this Python's site-packages ({', '.join(map(str, sorted(site)))})"
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metric(text: str, name: str, **labels):
    """Sum of the values of the series of ``name`` whose labels include ``labels``, in a
    Prometheus text exposition; None when none matches."""
    total = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(4))
    return total


def wait_until(condition, timeout: float, what: str, interval: float = 0.05):
    """Polls ``condition()`` until it returns a truthy value (returned) or ``timeout`` seconds
    pass (AssertionError naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Collector:
    """A rankscope-collector process. ``start`` binds gRPC on ``port`` (0: a free one, learned
    from the collector's start-up line); ``restart`` reuses the same port and database."""

    def __init__(
        self,
        tmp_dir: Path,
        step_timeout: str = "5s",
        db_path: Path = None,
        prefix=(),
        extra_args=(),
        host: str = "127.0.0.1",
    ):
        """``prefix``: a command the collector runs under (e.g. setpriv to drop root, ip netns
        exec); ``extra_args``: more collector flags; ``host``: the address it serves gRPC, /metrics
        and the web view on (one of its network namespace's)."""
        if not COLLECTOR_BIN.exists():
            pytest.skip(f"{COLLECTOR_BIN} not built (set RANKSCOPE_BUILD_DIR)")
        self.tmp_dir = Path(tmp_dir)
        self.db_path = Path(db_path) if db_path else self.tmp_dir / "rankscope.db"
        self.step_timeout = step_timeout
        self.prefix = list(prefix)
        self.extra_args = list(extra_args)
        self.host = host
        self.port = 0
        self.metrics_port = 0
        self.http_port = 0  # the web view and JSON API
        self.proc = None
        self._log_index = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "Collector":
        assert self.proc is None
        port = self.port or free_port()
        self._log_index += 1
        log_path = self.tmp_dir / f"collector.{self._log_index}.log"
        self._log = open(log_path, "w+")
        self.proc = subprocess.Popen(
            [
                *self.prefix,
                str(COLLECTOR_BIN),
                f"--grpc_address={self.host}:{port}",
                f"--metrics_address={self.host}:0",
                f"--http_address={self.host}:0",
                f"--db_path={self.db_path}",
                f"--step_timeout={self.step_timeout}",
                *self.extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = log_path

        def serving():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"collector exited with {self.proc.returncode}: {log_path.read_text()}"
                )
            m = re.search(
                r"serving gRPC on [0-9.]+:(\d+)\D.*metrics on :(\d+)\D.*"
                r"web view on :(\d+)",
                log_path.read_text(),
            )
            return m and (int(m.group(1)), int(m.group(2)), int(m.group(3)))

        self.port, self.metrics_port, self.http_port = wait_until(
            serving, timeout, "the collector to serve"
        )
        return self

    def log(self) -> str:
        """The current run's log (stdout and stderr)."""
        return self.log_path.read_text()

    def scrape(self) -> str:
        """The collector's /metrics text (raises if it is not served)."""
        with urllib.request.urlopen(
            f"http://{self.host}:{self.metrics_port}/metrics", timeout=10
        ) as r:
            return r.read().decode()

    def metric(self, name: str, **labels) -> float:
        """The value of the series ``name{labels}`` (labels a subset match; summed over the
        series that match), or None when no series matches."""
        return parse_metric(self.scrape(), name, **labels)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (open steps are closed and committed), then SIGKILL past ``timeout``."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.proc = None
        self._log.close()
        return rc

    def kill(self) -> None:
        """SIGKILL: no flush, no goodbye."""
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self._log.close()

    def restart(self) -> "Collector":
        return self.start()

    def query(self, sql: str, params=()) -> list:
        """Rows of a read-only query on the collector's SQLite file (WAL lets us read beside
        the writer). An empty list while the file or schema does not exist yet."""
        if not self.db_path.exists():
            return []
        con = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute(sql, params).fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return []
            raise
        finally:
            con.close()

    def step_rows(self, job: str) -> dict:
        """step -> dict of step_stats columns."""
        cols = (
            "step",
            "ranks",
            "loss_mean",
            "loss_std",
            "loss_range",
            "grad_norm_mean",
            "grad_norm_std",
            "grad_norm_cv",
            "grad_cosine_mean",
            "missing_ranks",
            "timed_out",
        )
        rows = self.query(
            f"SELECT {', '.join(cols)} FROM step_stats WHERE job = ? ORDER BY step", (job,)
        )
        return {r[0]: dict(zip(cols, r)) for r in rows}

    def rank_rows(self, job: str) -> list:
        return self.query(
            "SELECT step, rank, loss, grad_norm, grad_cosine FROM rank_steps "
            "WHERE job = ? ORDER BY step, rank",
            (job,),
        )

    def ctl(self, verb: str, job: str, *flags: str) -> str:
        """`rankscope ctl VERB --job=J FLAGS...` (the real CLI). Returns its stdout."""
        if not CLI_BIN.exists():
            pytest.skip(f"{CLI_BIN} not built")
        out = subprocess.run(
            [str(CLI_BIN), f"--collector={self.address}", f"--job={job}", *flags, "ctl", verb],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, f"rankscope ctl {verb}: {out.stdout}{out.stderr}"
        return out.stdout


@pytest.fixture
def collector(tmp_path):
    c = Collector(tmp_path).start()
    yield c
    if c.proc is not None:
        c.stop()


@pytest.fixture(scope="module")
def module_collector(tmp_path_factory):
    c = Collector(tmp_path_factory.mktemp("collector")).start()
    yield c
    if c.proc is not None:
        c.stop()


# ---- a store filled by a real job (tools/loadgen), its early steps aged ----------------------

LOADGEN = BUILD_DIR / "bin" / "rankscope-loadgen"


def run_loadgen(collector: "Collector", job: str, ranks: int, steps: int, *flags: str) -> None:
    """tools/loadgen's ``ranks`` simulated ranks (the real agent library) report ``steps`` steps
    of ``job`` to ``collector`` with no pause between steps, plus loadgen ``flags``; returns once
    every report is acked, i.e. committed (loadgen exits 0 only then). Skips the test when
    loadgen is not built."""
    if not LOADGEN.exists():
        pytest.skip(f"{LOADGEN} not built")
    run = subprocess.run(
        [
            str(LOADGEN),
            f"--collector={collector.address}",
            f"--job={job}",
            f"--ranks={ranks}",
            f"--steps={steps}",
            "--step_interval=0",
            *flags,
            "--flush_timeout=30s",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr  # every report acked


def filled_store(tmp_dir: Path, job: str, ranks: int, steps: int, *flags: str) -> "Collector":
    """A stopped collector whose store holds steps 0..``steps``-1 of ``job`` (``run_loadgen`` with
    ``flags``). ``restart()`` serves the same database. Skips the test when loadgen is not
    built."""
    if not LOADGEN.exists():
        pytest.skip(f"{LOADGEN} not built")
    c = Collector(tmp_dir).start()
    try:
        run_loadgen(c, job, ranks, steps, "--start_step=0", *flags)
    finally:
        stopped = c.stop()
    assert stopped == 0, "the collector did not exit cleanly"
    return c


def age_steps(db_path: Path, job: str, before_step: int, seconds: int) -> None:
    """Moves the stored wall times of ``job``'s steps < ``before_step`` (rank_steps.received_at,
    step_stats.completed_at) ``seconds`` into the past, as waiting that long would have: what
    the retention reads. The collector must be stopped."""
    con = sqlite3.connect(str(db_path))
    try:
        con.execute(
            "UPDATE rank_steps SET received_at = received_at - ? WHERE job = ? AND step < ?",
            (seconds, job, before_step),
        )
        con.execute(
            "UPDATE step_stats SET completed_at = completed_at - ? WHERE job = ? AND step < ?",
            (seconds, job, before_step),
        )
        con.commit()
    finally:
        con.close()
