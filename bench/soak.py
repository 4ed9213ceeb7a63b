#!/usr/bin/env python3
"""Soak benchmark of the storage lifecycle: days of a large job in minutes.

Starts a real rankscope-collector whose clock runs --time-scale times faster than real time
(--time_scale: receive and completion stamps, step timeouts and retention ages are in that
clock, exported latencies stay real), with short retention (--retention-rank-steps,
--retention-steps), and drives it with tools/loadgen (--ranks real agents of one job, a step
every --step-interval real seconds) for --minutes. Every --sample seconds it records the
database file (+ WAL) size, the collector's rankscope_store_db_bytes, its RSS, the rows pruned
and downsampled so far, and the p99 of the ingest latency, of the SQLite commit and of a pruning
transaction over the interval (from the collector's histograms; PromQL's histogram_quantile).
At the end it counts the rows of each table, prints a summary (bytes per rank-step, the plateau
of the file, RSS growth) and writes every sample to --csv.

    .venv/bin/python bench/soak.py --build build                    # 1,024 ranks, 4 minutes
    .venv/bin/python bench/soak.py --build build --ranks 64 --minutes 1   # a quick look

Bounded: loadgen runs --minutes, the collector is stopped after it; nothing waits longer.
"""

import argparse
import csv
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    return total if found else 0.0


def histogram(text: str, name: str):
    """[(upper bound, cumulative count)] of a histogram without labels."""
    out = []
    for line in text.splitlines():
        m = re.match(rf'^{name}_bucket\{{le="([^"]+)"\}} (\S+)$', line)
        if m:
            out.append((float(m.group(1)), float(m.group(2))))
    return sorted(out)


def quantile(after, before, q: float) -> float:
    """histogram_quantile over the delta of two cumulative histograms (seconds)."""
    prev = dict(before)
    delta = [(b, c - prev.get(b, 0.0)) for b, c in after]
    if not delta or delta[-1][1] <= 0:
        return float("nan")
    rank = q * delta[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in delta:
        if count >= rank:
            if bound == float("inf"):
                return lo_bound
            span = count - lo_count
            return lo_bound + (bound - lo_bound) * ((rank - lo_count) / span if span else 1)
        lo_bound, lo_count = bound, count
    return float("nan")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def file_bytes(path: Path) -> int:
    total = 0
    for p in (path, Path(str(path) + "-wal")):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


# Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
# runs, the table it prints; the measured pieces are functions of their own.
def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--build", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build"))
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument(
        "--time-scale",
        type=float,
        default=2880.0,
        help="collector clock seconds per real second (2880: a day in 30 s)",
    )
    p.add_argument("--step-interval", type=float, default=0.2, help="real seconds per step")
    p.add_argument("--retention-rank-steps", default="1d")
    p.add_argument("--retention-steps", default="3d")
    p.add_argument("--max-db-bytes", type=int, default=0)
    p.add_argument("--sample", type=float, default=5.0, help="real seconds between samples")
    p.add_argument("--csv", default="soak.csv")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = p.parse_args(argv)

    bindir = Path(args.build).resolve() / "bin"
    work = Path(args.dir or tempfile.mkdtemp(prefix="rankscope-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    db = work / "soak.db"
    log = open(work / "collector.log", "w+")
    collector_cmd = [
        str(bindir / "rankscope-collector"),
        "--grpc_address=127.0.0.1:0",
        "--metrics_address=127.0.0.1:0",
        "--http_address=",
        f"--db_path={db}",
        f"--time_scale={args.time_scale}",
        f"--retention_rank_steps={args.retention_rank_steps}",
        f"--retention_steps={args.retention_steps}",
        f"--max_db_bytes={args.max_db_bytes}",
        # Scaled: a step times out after 1 h of the collector's clock.
        "--step_timeout=1h",
        "--retention_check_interval=2s",
    ]
    print("collector:", " ".join(collector_cmd), flush=True)
    coll = subprocess.Popen(collector_cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    ports = None
    while time.time() < deadline and ports is None:
        m = re.search(
            r"serving gRPC on [0-9.]+:(\d+)\D.*metrics on :(\d+)",
            (work / "collector.log").read_text(),
        )
        ports = m and (int(m.group(1)), int(m.group(2)))
        if coll.poll() is not None:
            print((work / "collector.log").read_text(), file=sys.stderr)
            return 1
        time.sleep(0.1)
    if ports is None:
        print("the collector did not start", file=sys.stderr)
        coll.kill()
        return 1
    grpc_port, metrics_port = ports
    seconds = int(args.minutes * 60)
    load_cmd = [
        str(bindir / "rankscope-loadgen"),
        f"--collector=127.0.0.1:{grpc_port}",
        "--job=soak",
        f"--ranks={args.ranks}",
        f"--duration={seconds}s",
        f"--step_interval={int(args.step_interval * 1000)}ms",
        "--outlier_rank=7",
        "--outlier_from_step=1000",
        "--flush_timeout=60s",
    ]
    print("loadgen:  ", " ".join(load_cmd), flush=True)
    load_out = open(work / "loadgen.log", "w+")
    load = subprocess.Popen(load_cmd, stdout=load_out, stderr=subprocess.STDOUT)

    samples = []
    start = time.time()
    prev_text = scrape(metrics_port)
    header = (
        "t_s",
        "sim_days",
        "file_mb",
        "db_bytes_mb",
        "rss_mb",
        "received",
        "pruned_rank_rows",
        "downsampled_rows",
        "pruned_steps",
        "ingest_p99_ms",
        "commit_p99_ms",
        "prune_p99_ms",
        "prunes",
    )
    print(" ".join(f"{h:>14}" for h in header), flush=True)
    while True:
        done = load.poll() is not None
        time.sleep(0 if done else args.sample)
        text = scrape(metrics_port)
        t = time.time() - start
        row = {
            "t_s": round(t, 1),
            "sim_days": round(t * args.time_scale / 86400, 2),
            "file_mb": round(file_bytes(db) / 1e6, 2),
            "db_bytes_mb": round(metric(text, "rankscope_store_db_bytes") / 1e6, 2),
            "rss_mb": round(rss_bytes(coll.pid) / 1e6, 1),
            "received": int(metric(text, "rankscope_reports_received_total")),
            "pruned_rank_rows": int(
                metric(text, "rankscope_store_pruned_rows_total", table="rank_steps")
            ),
            "downsampled_rows": int(metric(text, "rankscope_store_downsampled_rows_total")),
            "pruned_steps": int(
                metric(text, "rankscope_store_pruned_rows_total", table="step_stats")
            ),
            "ingest_p99_ms": round(
                1e3
                * quantile(
                    histogram(text, "rankscope_ingest_latency_seconds"),
                    histogram(prev_text, "rankscope_ingest_latency_seconds"),
                    0.99,
                ),
                1,
            ),
            "commit_p99_ms": round(
                1e3
                * quantile(
                    histogram(text, "rankscope_store_commit_seconds"),
                    histogram(prev_text, "rankscope_store_commit_seconds"),
                    0.99,
                ),
                1,
            ),
            "prune_p99_ms": round(
                1e3
                * quantile(
                    histogram(text, "rankscope_store_prune_seconds"),
                    histogram(prev_text, "rankscope_store_prune_seconds"),
                    0.99,
                ),
                1,
            ),
            "prunes": int(
                metric(text, "rankscope_store_prune_seconds_count")
                - metric(prev_text, "rankscope_store_prune_seconds_count")
            ),
        }
        prev_text = text
        samples.append(row)
        print(" ".join(f"{row[h]:>14}" for h in header), flush=True)
        if done:
            break
    load_out.seek(0)
    print("loadgen:", load_out.read().strip().splitlines()[-1], flush=True)
    coll.send_signal(signal.SIGTERM)
    try:
        coll.wait(60)
    except subprocess.TimeoutExpired:
        coll.kill()
        coll.wait()

    con = sqlite3.connect(str(db))
    counts = {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
        for t in ("rank_steps", "step_stats", "rank_windows")
    }
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    pages = con.execute("PRAGMA page_count").fetchone()[0]
    free = con.execute("PRAGMA freelist_count").fetchone()[0]
    # Bytes per rank-step: the rank_steps table's own pages (dbstat when compiled in, else the
    # whole file's live pages over the rank rows, an upper bound).
    try:
        rank_bytes = con.execute(
            "SELECT sum(pgsize) FROM dbstat WHERE name = 'rank_steps'"
        ).fetchone()[0]
        how = "rank_steps pages (dbstat)"
    except sqlite3.OperationalError:
        rank_bytes = (pages - free) * page_size
        how = "all live pages (no dbstat)"
    con.close()

    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(samples)
    half = samples[len(samples) // 2 :]
    first_half = samples[: len(samples) // 2] or samples
    print(f"\nrows at the end: {counts}; file {pages * page_size / 1e6:.1f} MB ({free} free pages)")
    if counts["rank_steps"]:
        print(f"bytes per rank-step: {rank_bytes / counts['rank_steps']:.0f} ({how})")
    print(
        f"file (+WAL) MB: max of the first half {max(s['file_mb'] for s in first_half)}, "
        f"of the second half {max(s['file_mb'] for s in half)}, at the end "
        f"{samples[-1]['file_mb']}"
    )
    print(
        f"RSS MB: first sample {samples[0]['rss_mb']}, max of the first half "
        f"{max(s['rss_mb'] for s in first_half)}, max of the second half "
        f"{max(s['rss_mb'] for s in half)}"
    )
    lat = [s["ingest_p99_ms"] for s in samples if s["ingest_p99_ms"] == s["ingest_p99_ms"]]
    if lat:
        print(
            f"ingest p99 per interval, ms: min {min(lat)}, median {sorted(lat)[len(lat) // 2]}, "
            f"max {max(lat)}"
        )
    print(f"samples in {args.csv}; collector log and database in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
