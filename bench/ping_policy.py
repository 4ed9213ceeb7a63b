#!/usr/bin/env python3
"""Mixed versions: agents (30 s keepalive pings) against a collector with gRPC's old ping policy.

    .venv/bin/python bench/ping_policy.py --build-dir build [--ranks 2] [--steps 3]
        [--gap 150] [--policy old|new]

A real rankscope-collector whose keepalive flags are set to gRPC's defaults, the policy of a
collector older than them (--policy old: --grpc_keepalive_time=0, i.e. no server pings,
--grpc_agent_min_ping_interval=5m --grpc_agent_pings_without_calls=false
--grpc_agent_max_ping_strikes=2; the collector's own pings would keep the agents' from being
sent, gRPC pings only a connection that received nothing for 30 s), and one loadgen whose
ranks report one step every --gap seconds: between two steps the streams are idle (no data either
way), the agents ping every 30 s, and the old policy answers the third bad ping with GOAWAY
"too_many_pings". Prints the agents' reconnects, the reports recorded, acked and stored, and
whether every step was stored exactly once (rank_steps has one row per (job, group, rank, step)).
Minutes of wall time, almost no CPU: run by hand (docs/reliability.md "Keepalive").
"""

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_load import CollectorProcess  # noqa: E402

OLD_POLICY = [
    "--grpc_keepalive_time=0",  # no server pings either (gRPC's default: 2 h)
    "--grpc_agent_min_ping_interval=5m",
    "--grpc_agent_pings_without_calls=false",
    "--grpc_agent_max_ping_strikes=2",
]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--build-dir", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gap", type=float, default=150.0, help="seconds between two steps")
    ap.add_argument("--policy", choices=["old", "new"], default="old")
    a = ap.parse_args()
    build = Path(a.build_dir).resolve()
    job = "ping-policy"
    with tempfile.TemporaryDirectory(prefix="rankscope-ping-") as tmp:
        c = CollectorProcess(build, Path(tmp), OLD_POLICY if a.policy == "old" else [])
        summary = Path(tmp) / "summary.json"
        t0 = time.monotonic()
        try:
            lg = subprocess.run(
                [
                    str(build / "bin" / "rankscope-loadgen"),
                    f"--collector={c.address}",
                    f"--job={job}",
                    f"--ranks={a.ranks}",
                    f"--steps={a.steps}",
                    f"--step_interval={a.gap}s",
                    "--sketch_dim=64",
                    "--step_time=0",
                    "--wait_connected",
                    "--flush_timeout=120s",
                    f"--summary_json={summary}",
                ],
                capture_output=True,
                text=True,
            )
            wall = time.monotonic() - t0
            con = sqlite3.connect(f"file:{c.db}?mode=ro", uri=True, timeout=10)
            rows, distinct = con.execute(
                "SELECT COUNT(*), COUNT(DISTINCT rank || ':' || step) FROM rank_steps"
            ).fetchone()
            con.close()
        finally:
            c.stop()
        stats = json.loads(summary.read_text()) if summary.exists() else {}
        total = stats.get("total", stats)
        out = {
            "policy": a.policy,
            "collector_flags": OLD_POLICY if a.policy == "old" else [],
            "ranks": a.ranks,
            "steps": a.steps,
            "gap_s": a.gap,
            "wall_s": round(wall, 1),
            "loadgen_rc": lg.returncode,
            "recorded": total.get("recorded"),
            "acked": total.get("acked"),
            "dropped": total.get("dropped"),
            "reconnects": total.get("reconnects"),
            "rows": rows,
            "distinct_rank_steps": distinct,
            "agent_stderr": [line for line in lg.stderr.splitlines() if "rankscope:" in line],
            "collector_log_goaway": [
                line
                for line in c.log_path.read_text().splitlines()
                if "ping" in line.lower() or "goaway" in line.lower()
            ][:5],
        }
    print(json.dumps(out, indent=2))
    ok = (
        lg.returncode == 0
        and out["recorded"] == out["acked"] == rows == distinct == a.ranks * a.steps
    )
    print("OK: every step stored once" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
