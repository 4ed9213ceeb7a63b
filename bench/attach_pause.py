#!/usr/bin/env python3
"""What `rankscope attach --pid` costs a running job, over many attaches.

    PYTHONPATH=build/python .venv/bin/python bench/attach_pause.py --build-dir build [--runs 50]

Each run starts a 2-rank gloo DDP job that never imports rankscope (tests/python/
attach_target.py), alternately compute-bound (no pause between steps) and data-loading-bound
(50 ms of "data loading" per step), waits until it trained 5 steps, attaches both ranks with the
real CLI (against a real collector), lets it train 10 more steps and checks that every rank
exited cleanly (exit code 0) and that the collector stored every step from the agreed one.

Per rank it records the pause the CLI reports (the time gdb held the process stopped, measured
from before gdb attached, plus the payload's time on the main thread), and per job the stall
the job itself saw: the longest iteration from the attach on, minus the median iteration before
it (rank 0's own wall clock per iteration). Prints p50/p90/max of both, per kind of job, and
fails (exit 1) on any crash, hang (a run over --run-timeout seconds is killed and counted) or
incomplete step.
"""

import argparse
import json
import os
import re
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "tests" / "python" / "attach_target.py"
PY = sys.executable  # the project's environment, with torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(what)


def percentiles(xs):
    xs = sorted(xs)
    if not xs:
        return "n/a"
    q = lambda p: xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]  # noqa: E731
    return f"p50 {q(0.5):.3f} s  p90 {q(0.9):.3f} s  max {xs[-1]:.3f} s  (n={len(xs)})"


# Long: one measured run as it happens (set-up, the loop, what it records), its phases commented in
# order; split, its processes and figures would be handed between helpers.
def one_run(i, kind, cli, collector_addr, db, work, run_timeout):
    d = work / f"run{i}"
    d.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["PYTHONPATH"] = str(TARGET.parent)
    pace = "0" if kind == "compute" else "0.05"
    procs = [
        subprocess.Popen(
            [
                PY,
                str(TARGET),
                "--rank",
                str(r),
                "--world",
                "2",
                "--port",
                str(port),
                "--dir",
                str(d),
                "--pace",
                pace,
            ],
            stdout=open(d / f"rank{r}.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in range(2)
    ]
    result = {"kind": kind, "ok": False}
    try:

        def progress():
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a rank exited early ({p.returncode})")
            try:
                return int((d / "progress").read_text()) >= 5
            except (OSError, ValueError):
                return False

        wait(progress, run_timeout, "5 steps")
        job = f"pause-{i}"
        attached_at = int((d / "progress").read_text()) + 1  # the first step attach can touch
        out = subprocess.run(
            [
                cli,
                "attach",
                f"--job={job}",
                f"--collector={collector_addr}",
                *[str(p.pid) for p in procs],
            ],
            capture_output=True,
            text=True,
            timeout=run_timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"attach failed: {out.stdout}{out.stderr}")
        result["pauses"] = [float(x) for x in re.findall(r"pause ([\d.]+) s", out.stdout)]
        result["stopped"] = [float(x) for x in re.findall(r"stopped ([\d.]+) s", out.stdout)]
        first = int(re.findall(r"reporting from step (\d+)", out.stdout)[0])
        (d / "stop").write_text("10")
        for p in procs:
            p.wait(timeout=run_timeout)
        codes = [p.returncode for p in procs]
        if codes != [0, 0]:
            raise RuntimeError(f"exit codes {codes}")
        times = json.loads((d / "times.json").read_text())
        before = times[:attached_at] or times
        result["stall"] = max(
            0.0, max(times[attached_at : first + 1] or [0.0]) - statistics.median(before)
        )
        last = json.loads((d / "final.0").read_text())["steps"] - 1
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        steps = [
            r[0]
            for r in con.execute(
                "SELECT step FROM step_stats WHERE job = ? AND ranks = 2 ORDER BY step", (job,)
            )
        ]
        con.close()
        if steps != list(range(first, last + 1)):
            raise RuntimeError(f"steps stored {steps[:3]}..{steps[-3:]} expected {first}..{last}")
        result["ok"] = True
    except Exception as e:
        result["error"] = repr(e)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=str(REPO / "build"))
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--run-timeout", type=float, default=120.0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    build = Path(args.build_dir).resolve()
    cli = str(build / "bin" / "rankscope")
    work = Path(tempfile.mkdtemp(prefix="rankscope-attach-bench-"))
    grpc = free_port()
    db = work / "rankscope.db"
    collector = subprocess.Popen(
        [
            str(build / "bin" / "rankscope-collector"),
            f"--grpc_address=127.0.0.1:{grpc}",
            "--metrics_address=",
            "--http_address=",
            f"--db_path={db}",
            "--step_timeout=10s",
        ],
        stdout=open(work / "collector.log", "w"),
        stderr=subprocess.STDOUT,
    )
    results = []
    try:
        wait(lambda: "serving gRPC" in (work / "collector.log").read_text(), 30, "collector")
        for i in range(args.runs):
            kind = "compute" if i % 2 == 0 else "data"
            r = one_run(i, kind, cli, f"127.0.0.1:{grpc}", db, work, args.run_timeout)
            results.append(r)
            status = "ok" if r["ok"] else f"FAILED {r.get('error')}"
            print(
                f"[{i + 1}/{args.runs}] {kind:7s} pauses {r.get('pauses')} "
                f"stall {r.get('stall', float('nan')):.3f} s {status}",
                flush=True,
            )
    finally:
        collector.terminate()
        collector.wait(30)
    print()
    for kind in ("compute", "data"):
        rs = [r for r in results if r["kind"] == kind and r["ok"]]
        print(f"{kind}-bound jobs ({len(rs)} ok):")
        print(
            f"  pause per rank (stopped + main thread): "
            f"{percentiles([p for r in rs for p in r['pauses']])}"
        )
        print(
            f"  of which stopped by ptrace:            "
            f"{percentiles([p for r in rs for p in r['stopped']])}"
        )
        print(f"  longest iteration minus median:        {percentiles([r['stall'] for r in rs])}")
    failed = [r for r in results if not r["ok"]]
    print(
        f"\n{len(results) - len(failed)} of {len(results)} runs attached, reported every step "
        f"and exited cleanly"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
