#!/usr/bin/env python3
"""A per-node relay for the largest jobs, simulated against the flat collector (issue 35, item 4).

    .venv/bin/python bench/relay_sim.py --build-dir build [--ranks 4096] [--groups 128]
        [--steps 12] [--node-size 8] [--seed 42] [--collector-us-per-report US]
        [--serial-share S] [--cores 16] [--target-ranks 100000]

The relay (designed in docs/PERFORMANCE.md, "A per-node relay"): one per node, it takes the
node's `node_size` local agent streams and sends the collector one message per step and group:
every rank's scalars (loss, gradient norm, fingerprints, step time) as they are, plus two
vectors in place of node_size sketches: the node's sum of raw sketches (sum v_r, for the
consensus cosines) and its sum of unit sketches (sum v_r / |v_r|, for the mean pairwise cosine).
The collector adds the nodes' sums into the group's sums S and U, computes the step's mean
pairwise cosine from U at once, and sends S back; each relay then computes its ranks' consensus
cosines cos(v_r, S - v_r) (the collector's definition, collector/analysis/step_stats.h) and
forwards them with the next step, so a rank's cosine (and its outlier score) is stored one
step late.

What it measures, on the same data:
  1. the reports: `rankscope-loadgen --dump_reports` writes the exact reports a loadgen run with
     the same --seed, --threads and shape sends;
  2. the flat collector: a real rankscope-collector, fed by the real loadgen run with those
     flags; its stored grad_cosine (rank_steps) and grad_cosine_mean (step_stats) are read back
     from SQLite;
  3. the relay, simulated here in float32 as it would run (sums sent as float32 on the wire, the
     collector's sum in float64): its consensus cosines and mean pairwise cosines, against (2).
Then the bytes into the collector per rank-step (protobuf wire sizes of both messages), what
the relay costs per node-step (its arithmetic, timed here with numpy, and its gRPC messages at
the bare sink's measured cost per message), and whether one collector of --cores cores carries
--target-ranks ranks reporting once a second (from --collector-us-per-report, the collector's
CPU per report measured by bench/ingest_bench, and --serial-share, the instructions no thread
count divides, measured under callgrind): the relay is built only if it does not.
"""

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_load import CollectorProcess  # noqa: E402


def varint_len(n: int) -> int:
    n = max(n, 0)
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def report_bytes(k: int, step: int) -> int:
    """Wire size of one flat StepReport as loadgen sends it (proto/rankscope.proto field kinds):
    seq and step (varints), loss, grad_norm, reduced_grad_norm, step_time_seconds (doubles),
    the packed float sketch, two fingerprints (fixed64), local_batch_size and dropped_total."""
    size = 2 * (1 + varint_len(step))  # seq ~ step, step
    size += 4 * (1 + 8)  # four doubles
    size += 1 + varint_len(4 * k) + 4 * k  # packed repeated float sketch
    size += 2 * (1 + 8)  # reduced_grad_fingerprint, param_fingerprint (fixed64)
    size += 2 * 2  # local_batch_size, dropped_total (small varints)
    return size


def relay_message_bytes(k: int, step: int, node_size: int) -> int:
    """Wire size of one relay message: the node's two float32 sums and, per rank, its scalars
    (a report without its sketch) plus the consensus cosine of the previous step (a double)."""
    per_rank = report_bytes(k, step) - (1 + varint_len(4 * k) + 4 * k) + (1 + 8) + 2  # + rank
    per_rank += 1 + varint_len(per_rank)  # each rank's entry is a length-delimited submessage
    sums = 2 * (1 + varint_len(4 * k) + 4 * k)
    return sums + node_size * per_rank


def load_dump(path: Path, ranks: int, steps: int, k: int):
    """The dumped reports, as arrays indexed [step - 1, global rank]."""
    rec = np.dtype(
        [
            ("rank", "<u4"),
            ("step", "<u8"),
            ("loss", "<f8"),
            ("norm", "<f8"),
            ("k", "<u4"),
            ("sketch", "<f4", (k,)),
        ],
        align=False,
    )
    data = np.fromfile(path, dtype=rec)
    if len(data) != ranks * steps or np.any(data["k"] != k):
        raise RuntimeError(f"dump holds {len(data)} reports, expected {ranks * steps} of k={k}")
    sketches = np.empty((steps, ranks, k), dtype=np.float32)
    sketches[data["step"] - 1, data["rank"]] = data["sketch"]
    return sketches


def consensus(v: np.ndarray, total: np.ndarray) -> np.ndarray:
    """cos(v_r, total - v_r) per row of v (float64), 0 for a zero vector."""
    v = v.astype(np.float64)
    others = total.astype(np.float64)[None, :] - v
    num = np.einsum("ij,ij->i", v, others)
    den = np.linalg.norm(v, axis=1) * np.linalg.norm(others, axis=1)
    return np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)


def unit(v: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(v.astype(np.float64), axis=1, keepdims=True)
    return np.where(n > 0, v / np.where(n > 0, n, 1), 0).astype(np.float32)


def simulate_relay(group_sketches: np.ndarray, node_size: int):
    """One step of one group through relays: (consensus cosines per rank, mean pairwise cosine).
    Node sums are float32 (as sent); the collector adds them in float64 and sends S back as
    float32; each relay computes its ranks' cosines against it."""
    w, k = group_sketches.shape
    s_total = np.zeros(k, dtype=np.float64)
    u_total = np.zeros(k, dtype=np.float64)
    nodes = [group_sketches[i : i + node_size] for i in range(0, w, node_size)]
    for v in nodes:
        s_total += v.sum(axis=0, dtype=np.float32)
        u_total += unit(v).sum(axis=0, dtype=np.float32)
    s_back = s_total.astype(np.float32)
    cos = np.concatenate([consensus(v, s_back) for v in nodes])
    w_nz = np.count_nonzero(np.linalg.norm(group_sketches, axis=1))
    mean_pairwise = (float(u_total @ u_total) - w_nz) / (w * (w - 1))
    return cos, mean_pairwise


def run(cmd, **kw):
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


# Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
# runs, the table it prints; the measured pieces are functions of their own.
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build"))
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sketch-dim", type=int, default=1024)
    ap.add_argument("--node-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--threads", type=int, default=4, help="loadgen driver threads (fixes the data)"
    )
    ap.add_argument("--collector-us-per-report", type=float, default=0.0)
    ap.add_argument("--serial-share", type=float, default=0.0)
    ap.add_argument("--bare-us-per-message", type=float, default=11.4)
    ap.add_argument("--cores", type=int, default=16)
    ap.add_argument("--target-ranks", type=int, default=100_000)
    args = ap.parse_args()
    build = Path(args.build_dir).resolve()
    w = args.ranks // args.groups
    if args.ranks % args.groups or w % args.node_size:
        print(
            "relay_sim: --groups must divide --ranks, --node-size the group size", file=sys.stderr
        )
        return 2
    k = args.sketch_dim
    shape = [
        f"--ranks={args.ranks}",
        f"--groups={args.groups}",
        f"--steps={args.steps}",
        f"--sketch_dim={k}",
        f"--seed={args.seed}",
        f"--threads={args.threads}",
        "--job=relay",
    ]
    loadgen = build / "bin" / "rankscope-loadgen"
    with tempfile.TemporaryDirectory(prefix="relay_sim-") as tmp:
        work = Path(tmp)
        dump = work / "reports.bin"
        run([loadgen, *shape, f"--dump_reports={dump}"])
        sketches = load_dump(dump, args.ranks, args.steps, k)
        dump.unlink()

        # The flat collector, fed the same reports by the real loadgen.
        collector = CollectorProcess(build, work, ["--step_timeout=600s", "--hello_timeout=120s"])
        try:
            run(
                [
                    loadgen,
                    *shape,
                    f"--collector={collector.address}",
                    "--step_interval=0",
                    "--flush_timeout=300s",
                ],
                stdout=subprocess.DEVNULL,
            )
        finally:
            collector.stop()
        con = sqlite3.connect(f"file:{collector.db}?mode=ro", uri=True)
        stored_cos = np.full((args.steps, args.ranks), np.nan)
        for job, step, rank, cos in con.execute(
            "SELECT job, step, rank, grad_cosine FROM rank_steps"
        ):
            g = int(job.rsplit("/g", 1)[1]) if args.groups > 1 else 0
            stored_cos[step - 1, g * w + rank] = cos
        stored_mean = np.full((args.steps, args.groups), np.nan)
        for job, step, mean in con.execute("SELECT job, step, grad_cosine_mean FROM step_stats"):
            g = int(job.rsplit("/g", 1)[1]) if args.groups > 1 else 0
            stored_mean[step - 1, g] = mean
        con.close()
        if np.isnan(stored_cos).any() or np.isnan(stored_mean).any():
            print("relay_sim: the flat collector did not store every rank-step", file=sys.stderr)
            return 1

    # The relay, step by step and group by group, against the flat collector's values.
    relay_cos = np.empty_like(stored_cos)
    relay_mean = np.empty_like(stored_mean)
    reference_cos = np.empty_like(stored_cos)
    for t in range(args.steps):
        for g in range(args.groups):
            v = sketches[t, g * w : (g + 1) * w]
            relay_cos[t, g * w : (g + 1) * w], relay_mean[t, g] = simulate_relay(v, args.node_size)
            reference_cos[t, g * w : (g + 1) * w] = consensus(v, v.sum(axis=0, dtype=np.float64))
    d_cos = np.abs(relay_cos - stored_cos)
    d_ref = np.abs(reference_cos - stored_cos)
    d_mean = np.abs(relay_mean - stored_mean)
    print(
        f"\nexactness, {args.ranks} ranks in {args.groups} groups of {w}, {args.steps} steps, "
        f"k={k}, nodes of {args.node_size} (seed {args.seed}):"
    )
    print(
        f"  consensus cosine, relay vs flat collector: max |diff| {d_cos.max():.2e}, "
        f"mean {d_cos.mean():.2e} over {d_cos.size} rank-steps (values {stored_cos.min():.3f}"
        f"..{stored_cos.max():.3f}); stored one step late"
    )
    print(f"  consensus cosine, float64 reference vs flat collector: max |diff| {d_ref.max():.2e}")
    print(
        f"  mean pairwise cosine, relay vs flat collector: max |diff| {d_mean.max():.2e} over "
        f"{d_mean.size} group-steps (same step)"
    )
    pairs_seen = (args.node_size - 1) / (w - 1)
    print(
        f"  duplicate ranks (pairwise sketch comparison): only within a node, "
        f"{100 * pairs_seen:.1f}% of a group's pairs"
    )

    step = args.steps
    flat = report_bytes(k, step)
    relay = relay_message_bytes(k, step, args.node_size) / args.node_size
    print("\nbytes into the collector per rank-step (protobuf payload):")
    print(f"  flat  {flat} B;  relay {relay:.0f} B (x{flat / relay:.2f} fewer)")
    print(
        f"  at {args.target_ranks} ranks, one step a second: flat "
        f"{args.target_ranks * flat * 8 / 1e9:.2f} Gbit/s, relay "
        f"{args.target_ranks * relay * 8 / 1e9:.2f} Gbit/s (+ S back: "
        f"{args.target_ranks / args.node_size * 4 * k * 8 / 1e9:.2f} Gbit/s out)"
    )

    # The relay's own cost per node-step: the arithmetic (timed) and its messages.
    v = sketches[0, : args.node_size]
    reps = 2000
    t0 = time.perf_counter()
    for _ in range(reps):
        s = v.sum(axis=0, dtype=np.float32)
        u = unit(v).sum(axis=0, dtype=np.float32)
        c = consensus(v, s)
    arith_us = (time.perf_counter() - t0) / reps * 1e6
    del u, c
    msgs = args.node_size + 2  # node_size reports in, one message out, S back
    print("\nrelay cost per node-step:")
    print(
        f"  arithmetic {arith_us:.0f} us (numpy; 2 sums and {args.node_size} cosines of k={k}), "
        f"messages {msgs} x {args.bare_us_per_message} us = {msgs * args.bare_us_per_message:.0f}"
        f" us: {(arith_us + msgs * args.bare_us_per_message) / 1e4:.3f}% of a core at one step "
        f"a second"
    )

    if args.collector_us_per_report > 0 and args.serial_share > 0:
        c = args.collector_us_per_report * 1e-6
        s = args.serial_share
        speedup = 1 / (s + (1 - s) / args.cores)
        capacity = speedup / c
        print(
            f"\none collector of {args.cores} cores: {args.collector_us_per_report} us CPU per "
            f"report, serial share {100 * s:.1f}%: speed-up 1 / ({s:.3f} + {1 - s:.3f} / "
            f"{args.cores}) = {speedup:.2f}, capacity {capacity:,.0f} reports/s"
        )
        verdict = capacity >= args.target_ranks
        print(
            f"  {args.target_ranks:,} ranks once a second: "
            + (
                "carried by one collector; the relay is not built"
                if verdict
                else "NOT carried by one collector: build the relay"
            )
        )
    ok = d_cos.max() < 1e-5 and d_mean.max() < 1e-5
    print(f"\nrelay exact to 1e-5 against the flat collector: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
