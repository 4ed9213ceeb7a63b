#!/usr/bin/env python3
"""What the tolerance replica check's float summary costs (rankscope.replica_summary), beside the
exact fingerprint it goes with.

    PYTHONPATH=build/python .venv/bin/python bench/replica_summary.py [--sizes 1e6,1e7] [--repeats 5]

For each size n (float32 values, one process, the CPU):
  fingerprint     the parameter fingerprint's C++ kernel (rankscope.fingerprint.fold_cpu): what
                  the exact check computes;
  summary         rankscope.replica_summary.summarize over the same values as 8 tensors (the
                  parameter check's summary under replica_check="tolerance");
  bucket-summary  rankscope.replica_summary.partial_segments over the same values as one DDP
                  bucket of 64 segments (what each reduced bucket costs every step under the
                  tolerance check).
Prints median milliseconds and ns per value; ``--json`` writes them to a file.
"""

import argparse
import json
import statistics
import time

import torch

from rankscope import fingerprint as fp
from rankscope import replica_summary as rs


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = []
    for n in (int(float(s)) for s in args.sizes.split(",")):
        x = torch.randn(n) * 0.05
        parts = list(x.chunk(8))
        offsets = [0]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + p.numel())
        segments = 64
        per = n // segments
        layout = fp.SegmentLayout(
            n,
            [i * per for i in range(segments)],
            [per] * segments,
            [i * per for i in range(segments)],
        )
        row = {"n": n}
        row["fingerprint_ms"] = 1e3 * timed(lambda: fp.fold_cpu(x, 0), args.repeats)
        row["summary_ms"] = 1e3 * timed(lambda: rs.summarize(parts, offsets), args.repeats)
        row["bucket_summary_ms"] = 1e3 * timed(
            lambda: rs.partial_segments(x, layout).finish(), args.repeats
        )
        for k in ("fingerprint", "summary", "bucket_summary"):
            row[f"{k}_ns_per_value"] = row[f"{k}_ms"] * 1e6 / n
        rows.append(row)
        print(
            f"n={n:>11,}  fingerprint {row['fingerprint_ms']:8.2f} ms  summary "
            f"{row['summary_ms']:8.2f} ms ({row['summary_ns_per_value']:.1f} ns/value)  "
            f"bucket summary {row['bucket_summary_ms']:8.2f} ms "
            f"({row['bucket_summary_ns_per_value']:.1f} ns/value)",
            flush=True,
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
