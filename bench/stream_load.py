#!/usr/bin/env python3
"""Concurrent agent streams against one collector: memory per stream and delivery, measured.

    .venv/bin/python bench/stream_load.py --build-dir build [--streams 500,1000,2000]
        [--duration 20] [--step-interval 1.0] [--sketch-dim 1024] [--groups 1,128]

For each stream count N, a fresh rankscope-collector (temp database, loopback ports) and one
rankscope-loadgen process simulating one job of N ranks, each rank a real rankscope::Agent with
its own gRPC channel and TCP connection (loadgen raises its RLIMIT_NOFILE to the hard limit).
The loadgen waits until all N streams are open (--wait_connected), then every rank sends one
report every --step-interval seconds for --duration seconds, waits until every report is acked,
and holds the N streams open for a few more seconds (--hold). With --groups G,... each N runs
once per G, side by side: the N ranks form G data-parallel groups of N/G (loadgen --groups).

Measured on the collector process (VmRSS from /proc/PID/status, sampled every 0.25 s):
  idle       before any agent connects;
  connected  when the loadgen says all N streams are open (before the first report);
  peak       the largest sample while reports flow and during the hold;
  held       during the hold: all N streams open, every report stored;
and rankscope_streams_open from /metrics during the hold (must equal N), the reports acked (the
loadgen's count) and the rows in rank_steps (SQLite). Prints one line per N and a table with
(connected - idle) / N and (peak - idle) / N, the memory each stream costs the collector.
"""

import argparse
import os
import queue
import re
import resource
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", body, re.M)
    return float(m.group(1)) if m else float("nan")


def histogram_quantile(port: int, name: str, q: float) -> float:
    """The q-quantile of a Prometheus histogram (the upper bound of the bucket that holds it)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    buckets = []
    for m in re.finditer(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', body, re.M):
        buckets.append((float(m.group(1)), float(m.group(2))))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= q * total:
            return le
    return float("inf")


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class CollectorProcess:
    def __init__(self, build: Path, work: Path, extra_args=()):
        self.db = work / "rankscope.db"
        self.log_path = work / "collector.log"
        self._log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            [
                str(build / "bin" / "rankscope-collector"),
                "--grpc_address=127.0.0.1:0",
                "--metrics_address=127.0.0.1:0",
                "--http_address=",
                f"--db_path={self.db}",
                *extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

        def ports():
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited: {self.log_path.read_text()}")
            m = re.search(
                r"serving gRPC on [0-9.]+:(\d+) .*metrics on :(\d+)/metrics",
                self.log_path.read_text(),
            )
            return m and (int(m.group(1)), int(m.group(2)))

        self.grpc_port, self.metrics_port = wait_for(ports, 30, "the collector to serve")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def rss_kib(self) -> int:
        return rss_kib(self.proc.pid)

    def rows(self, job: str) -> int:
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
        try:
            # A job of several data-parallel groups is stored per group, as JOB/GROUP.
            return con.execute(
                "SELECT COUNT(*) FROM rank_steps WHERE job = ? OR job LIKE ?", (job, f"{job}/%")
            ).fetchone()[0]
        finally:
            con.close()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        return rc


# Long: one measured run as it happens (set-up, the loop, what it records), its phases commented in
# order; split, its processes and figures would be handed between helpers.
def run_streams(
    build: Path,
    n: int,
    duration: float,
    step_interval: float,
    sketch_dim: int,
    hold: float = 3.0,
    collector_args=(),
    groups: int = 1,
    silent_rank: int = -1,
    flush_timeout: float = 120.0,
    procs: int = 1,
) -> dict:
    """One measurement: a fresh collector, N streams (one job of `groups` data-parallel groups).
    Returns the figures (KiB, counts, seconds)."""
    job = f"load-{n}"
    with tempfile.TemporaryDirectory(prefix="rankscope-load-") as tmp:
        # --max_streams (default 10,000) above N: past it a stream is refused, and its agent
        # retries until one closes.
        c = CollectorProcess(
            build, Path(tmp), [f"--max_streams={max(10000, n + 256)}", *collector_args]
        )
        try:
            time.sleep(0.5)
            idle = c.rss_kib()
            collector_cpu0 = cpu_seconds(c.proc.pid)
            children_cpu0 = children_cpu_seconds()
            # P processes of n / P consecutive ranks each (whole groups when P divides the
            # groups): one process cannot hold every stream past its file-descriptor limit.
            per = n // procs
            base = [
                str(build / "bin" / "rankscope-loadgen"),
                f"--collector={c.address}",
                f"--job={job}",
                f"--ranks={n}",
                f"--duration={duration}s",
                f"--step_interval={step_interval}s",
                f"--sketch_dim={sketch_dim}",
                "--queue_capacity=16",
                "--step_time=0",
                "--wait_connected",
                f"--hold={hold}s",
                f"--flush_timeout={flush_timeout:.0f}s",
                f"--groups={groups}",
                *(
                    [f"--silent_rank={silent_rank}", "--silent_in_every_group"]
                    if silent_rank >= 0
                    else []
                ),
            ]
            if procs > 1:
                base.append("--go_on_stdin")
            # Started one after another, each once the one before has all its streams open: a
            # reconnect storm of every agent at once (connects timing out in the collector's
            # accept queue at a high load average) is not what is measured here.
            lgs = []

            def start_next():
                k = len(lgs)
                lg = subprocess.Popen(
                    base + ([f"--rank={k * per}", f"--rank_count={per}"] if procs > 1 else []),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                lgs.append(lg)
                for target, args in (
                    (drain, (lg.stdout, outs[k], k)),
                    (drain, (lg.stderr, errs[k], None)),
                ):
                    t = threading.Thread(target=target, args=args, daemon=True)
                    readers.append(t)
                    t.start()

            samples = []
            figures = {"n": n, "idle_kib": idle, "procs": procs}
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    try:
                        samples.append(c.rss_kib())
                        times.append(time.monotonic())
                    except (OSError, RuntimeError):
                        return
                    time.sleep(0.25)

            # Every pipe is drained by its own thread: a loadgen blocked writing to a full
            # stderr pipe would stop (an agent prints a line when its collector is slow).
            events = queue.Queue()
            outs = [[] for _ in range(procs)]
            errs = [[] for _ in range(procs)]

            def drain(stream, into, key):
                for line in stream:
                    into.append(line)
                    if key is not None:
                        events.put((key, line))
                events.put((key, None))

            readers = []
            start_next()

            def go():  # --go_on_stdin: every process goes on together
                if procs > 1:
                    for lg in lgs:
                        try:
                            lg.stdin.write("go\n")
                            lg.stdin.flush()
                        except OSError:
                            pass

            times = []
            sampler = None
            t_reports = t_hold = None
            connected, holding, ended = set(), set(), 0
            while ended < len(lgs):
                key, line = events.get()
                if key is None:
                    continue
                if line is None:
                    ended += 1
                    if t_hold is None:  # one ended early (a failure): let the others end too
                        for lg in lgs:
                            try:
                                lg.stdin.close()
                            except OSError:
                                pass
                    continue
                if "agents connected" in line:
                    connected.add(key)
                    if len(lgs) < procs:
                        start_next()
                    elif len(connected) == procs:
                        t_reports = time.monotonic()
                        figures["connected_kib"] = c.rss_kib()
                        figures["connected_load"] = os.getloadavg()[0]
                        sampler = threading.Thread(target=sample, daemon=True)
                        sampler.start()
                        go()
                elif "holding" in line:
                    holding.add(key)
                    if len(holding) == procs:
                        t_hold = time.monotonic()
                        figures["streams_open"] = metric(c.metrics_port, "rankscope_streams_open")
                        figures["ingest_p50_s"] = histogram_quantile(
                            c.metrics_port, "rankscope_ingest_latency_seconds", 0.5
                        )
                        figures["ingest_p99_s"] = histogram_quantile(
                            c.metrics_port, "rankscope_ingest_latency_seconds", 0.99
                        )
                        figures["held_kib"] = c.rss_kib()
                        figures["held_load"] = os.getloadavg()[0]
                        go()
            rcs = [lg.wait() for lg in lgs]
            figures["loadgen_cpu_s"] = children_cpu_seconds() - children_cpu0
            figures["collector_cpu_s"] = cpu_seconds(c.proc.pid) - collector_cpu0
            stop.set()
            if sampler is not None:
                sampler.join()
            for r in readers:
                r.join()
            lines = [line for out in outs for line in out]
            if any(rcs) or t_hold is None:
                err = "".join(line for e in errs for line in e)
                raise RuntimeError(f"loadgen failed ({rcs}): {''.join(lines)}{err[-2000:]}")
            figures["recorded"] = figures["acked"] = 0
            for m in re.finditer(r"recorded=(\d+) acked=(\d+)", "".join(lines)):
                figures["recorded"] += int(m.group(1))
                figures["acked"] += int(m.group(2))
            figures["peak_kib"] = max(samples + [figures["held_kib"]])
            # Growth over the run: the largest sample of the first and of the second half of
            # the reports phase (equal when memory is flat once reports flow).
            mid = t_reports + (t_hold - t_reports) / 2
            first = [r for t, r in zip(times, samples) if t <= mid] or [figures["connected_kib"]]
            second = [r for t, r in zip(times, samples) if mid < t <= t_hold] or first
            figures["first_half_kib"], figures["second_half_kib"] = max(first), max(second)
            figures["rows"] = wait_for(
                lambda: (lambda r: r if r == figures["acked"] else 0)(c.rows(job)),
                60,
                f"{figures['acked']} rows of {job}",
            )
        finally:
            c.stop()
    figures["groups"] = groups
    figures["reports_per_s"] = figures["acked"] / duration
    figures["kib_per_stream_connected"] = (figures["connected_kib"] - idle) / n
    figures["kib_per_stream_peak"] = (figures["peak_kib"] - idle) / n
    return figures


# Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
# runs, the table it prints; the measured pieces are functions of their own.
def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--build-dir", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build"))
    ap.add_argument("--streams", default="500,1000,2000")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of reports")
    ap.add_argument(
        "--step-interval", type=float, default=1.0, help="seconds between one rank's reports"
    )
    ap.add_argument("--sketch-dim", type=int, default=1024)
    ap.add_argument(
        "--groups",
        default="1",
        help="comma-separated group counts: each N is run once per count, side by "
        "side (e.g. 1,128: one group of N ranks, then 128 groups of N/128)",
    )
    ap.add_argument(
        "--silent-rank",
        type=int,
        default=-1,
        help="memory per open step: each case runs again with this rank of every group silent "
        "(loadgen --silent_in_every_group) and --step_timeout above the run, so every step "
        "of every group stays open; (peak RSS silent - peak RSS normal) / open steps",
    )
    ap.add_argument(
        "--loadgen-procs",
        type=int,
        default=1,
        help="loadgen processes sharing each job's ranks (must divide every N; they start "
        "reporting together and close together): one process holds at most its file-descriptor "
        "limit of streams",
    )
    ap.add_argument(
        "--analysis-threads",
        default="",
        help="comma-separated collector --analysis_threads values: each case is run once per "
        "value, side by side (empty: the collector's default)",
    )
    ap.add_argument(
        "--flush-timeout",
        type=float,
        default=120.0,
        help="seconds the loadgen waits for all streams to connect, and for every ack",
    )
    args = ap.parse_args()
    build = Path(args.build_dir).resolve()
    print(
        f"# {os.cpu_count()} CPUs; one report per rank every {args.step_interval} s for "
        f"{args.duration} s; sketch_dim {args.sketch_dim}; fresh collector per N"
    )
    rows = []
    threads = [int(t) for t in args.analysis_threads.split(",") if t] or [None]
    cases = [
        (int(n), int(g), t)
        for n in args.streams.split(",")
        for g in args.groups.split(",")
        for t in threads
    ]
    for n, g, _ in cases:
        if n % g or n % args.loadgen_procs:
            print(f"--groups {g} and --loadgen-procs must divide --streams {n}", file=sys.stderr)
            return 2
    for n, g, t in cases:
        threads_args = [] if t is None else [f"--analysis_threads={t}"]
        print(
            f"# N={n} groups={g} analysis_threads={t}: load average {os.getloadavg()}", flush=True
        )
        f = run_streams(
            build,
            n,
            args.duration,
            args.step_interval,
            args.sketch_dim,
            collector_args=threads_args,
            groups=g,
            flush_timeout=args.flush_timeout,
            procs=args.loadgen_procs,
        )
        f["analysis_threads"] = t
        print(
            f"N={n} groups={g} analysis_threads={t} (load {f['connected_load']:.1f} at start, "
            f"{f['held_load']:.1f} at the end): ingest p50 {f['ingest_p50_s'] * 1e3:.1f} ms, p99 "
            f"{f['ingest_p99_s'] * 1e3:.1f} ms (histogram bucket bounds); idle {f['idle_kib'] / 1024:.1f} MiB, connected {f['connected_kib'] / 1024:.1f}"
            f" MiB, peak {f['peak_kib'] / 1024:.1f} MiB, held {f['held_kib'] / 1024:.1f} MiB; "
            f"streams_open {f['streams_open']:.0f}; recorded {f['recorded']}, acked "
            f"{f['acked']}, stored {f['rows']}; reports phase max RSS first half "
            f"{f['first_half_kib'] / 1024:.1f} MiB, second half "
            f"{f['second_half_kib'] / 1024:.1f} MiB; CPU collector {f['collector_cpu_s']:.1f} s,"
            f" loadgen {f['loadgen_cpu_s']:.1f} s",
            flush=True,
        )
        if f["streams_open"] != n or f["rows"] != f["recorded"]:
            print(f"FAIL: N={n}: {f}", file=sys.stderr)
            return 1
        rows.append(f)
        if args.silent_rank >= 0 and t == threads[0]:  # once per N and groups
            timeout = args.duration + 60
            o = run_streams(
                build,
                n,
                args.duration,
                args.step_interval,
                args.sketch_dim,
                collector_args=[f"--step_timeout={timeout:.0f}s", *threads_args],
                groups=g,
                silent_rank=args.silent_rank,
                flush_timeout=args.flush_timeout,
                procs=args.loadgen_procs,
            )
            steps = o["recorded"] // (n - g)  # steps each reporting rank recorded
            open_steps = g * steps
            per_step = (o["peak_kib"] - f["peak_kib"]) / open_steps
            print(
                f"N={n} groups={g}, rank {args.silent_rank} of every group silent: "
                f"{open_steps} steps open at once ({g} groups x {steps}), peak "
                f"{o['peak_kib'] / 1024:.1f} MiB vs {f['peak_kib'] / 1024:.1f} MiB: "
                f"{per_step:.0f} KiB per open step of {n // g - 1} reports "
                f"({per_step / (n // g - 1):.1f} KiB per held report); stored {o['rows']} / "
                f"{o['recorded']}",
                flush=True,
            )
            if o["rows"] != o["recorded"]:
                print(f"FAIL: N={n} silent: {o}", file=sys.stderr)
                return 1
    print()
    print(
        "| streams | groups | analysis threads | idle RSS | connected RSS | peak RSS | KiB/stream connected |"
        " KiB/stream peak | reports stored | reports/s | ingest p50 | ingest p99 | collector CPU |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in rows:
        print(
            f"| {f['n']} | {f['groups']} | {f['analysis_threads'] or 'default'} | "
            f"{f['idle_kib'] / 1024:.1f} MiB | "
            f"{f['connected_kib'] / 1024:.1f} MiB | {f['peak_kib'] / 1024:.1f} MiB | "
            f"{f['kib_per_stream_connected']:.0f} | {f['kib_per_stream_peak']:.0f} | "
            f"{f['rows']} / {f['recorded']} | {f['reports_per_s']:.0f} | "
            f"{f['ingest_p50_s'] * 1e3:.1f} ms | {f['ingest_p99_s'] * 1e3:.1f} ms | "
            f"{f['collector_cpu_s']:.1f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
