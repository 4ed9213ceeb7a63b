#!/usr/bin/env python3
"""The collector's RSS after a burst of connections is gone: kept at the peak, or given back.

    .venv/bin/python bench/burst_rss.py --build-dir build [--connections 4000] [--rounds 2]

The smaller reproduction of bench/net_faults.py's half-open phase (which needs root and network
namespaces): a real rankscope-collector on loopback, run twice, with --memory_trim_interval=0
(malloc keeps what it frees, the behaviour before common/memory_trimmer.h) and with the default
trimmer. Each round opens N TCP connections that send the HTTP/2 preface and SETTINGS (as a
half-open peer did before it froze), waits until the collector has answered all of them, then
closes them all, as the collector's keepalive closes half-open ones (the transport and its
buffers are freed either way). RSS (VmRSS) is read before, at the peak, right after the close and
--settle seconds later.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_load import CollectorProcess, rss_kib  # noqa: E402

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def burst(c: CollectorProcess, n: int) -> dict:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", c.grpc_port))
        s.sendall(PREFACE)
        socks.append(s)
    # The collector answered every preface (its SETTINGS frame): it holds every transport.
    for s in socks:
        s.settimeout(30)
        if not s.recv(9):
            raise RuntimeError("the collector closed a connection during the burst")
    peak = rss_kib(c.proc.pid)
    for s in socks:
        s.close()
    return {"peak_mib": round(peak / 1024, 1)}


def run(build: Path, n: int, rounds: int, settle: float, trim: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="rankscope-burst-") as tmp:
        args = [] if trim else ["--memory_trim_interval=0"]
        c = CollectorProcess(build, Path(tmp), args)
        try:
            time.sleep(1)
            out = {"trim": trim, "before_mib": round(c.rss_kib() / 1024, 1), "rounds": []}
            for _ in range(rounds):
                r = burst(c, n)
                time.sleep(1)
                r["closed_mib"] = round(c.rss_kib() / 1024, 1)
                time.sleep(settle)
                r["settled_mib"] = round(c.rss_kib() / 1024, 1)
                out["rounds"].append(r)
            out["collector_log_trim"] = [
                line for line in c.log_path.read_text().splitlines() if "gave" in line
            ]
        finally:
            c.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--build-dir", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build"))
    ap.add_argument("--connections", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settle", type=float, default=12.0, help="seconds after each close")
    a = ap.parse_args()
    build = Path(a.build_dir).resolve()
    print(f"# load average {os.getloadavg()}", flush=True)
    results = [run(build, a.connections, a.rounds, a.settle, trim) for trim in (False, True)]
    print(json.dumps({"connections": a.connections, "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
