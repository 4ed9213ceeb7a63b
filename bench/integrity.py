#!/usr/bin/env python3
"""Aggregation integrity (docs/DESIGN.md "Aggregation integrity"): false alarms over many clean
steps, and what the extra sketch of the reduced gradient costs.

    PYTHONPATH=build/python .venv/bin/python bench/integrity.py [--steps 10000] [--world 4]

Part 1, clean steps: `--world` gloo ranks train the test suite's small transformer LM through the
real shim (``attach(integrity_every=1)``: every step is checked, by rank step % world) with one
real `rankscope-collector`, in every combination of gradient dtype (float32; bfloat16 and float16,
all-reduced in float32 by a comm hook rankscope chains to, then rounded back, as DDP's
half-precision paths do) and sketch encoding (float32, float16, int8), `--steps` steps in all,
split evenly. Read back from SQLite: steps checked, steps flagged (must be 0), and the largest
error ratio ||s - m|| / tolerance and relative error ||s - m|| / ||s|| per combination.

``--device-path``: the same through the shim's device path on the CPU (``Monitor._bypass_native``:
the local and the reduced sketches are torch-op DeviceSketches, read back through
rankscope._deferred, as a GPU's are; the Triton kernels need a GPU), and part 2 times the reduced
sketch's device path against the local DeviceSketch of the same bucket.

Part 2, cost: the reduced-gradient sketch is the local sketch's C++ kernel run once more over
the reduced buffer, on one rank per checked step. Timed here on a flat float32 bucket of
`--cost-numel` elements (rankscope._integrity.ReducedSketch.add, as the all-reduce callback calls
it) against the local sketch of the same bucket (BucketSketcher's kernel) and against a
forward+backward of a model of that size (the step it is amortized over).
"""

import argparse
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))

DTYPES = ("float32", "bfloat16", "float16")
ENCODINGS = ("float32", "float16", "int8")


def wide_hook(state, bucket):
    """All-reduce in float32 (for half-precision buckets), rounded back to the bucket's dtype."""
    import torch.distributed as dist

    buf = bucket.buffer()
    wide = buf if buf.dtype == torch.float32 else buf.to(torch.float32)
    wide.div_(dist.get_world_size())
    fut = dist.all_reduce(wide, async_op=True).get_future()

    def narrow(f):
        out = f.value()[0]
        if out is not buf:
            buf.copy_(out)
        return buf

    return fut.then(narrow)


def clean_worker(rank, world, collector, steps_per_combo, device_path=False):
    import torch.nn as nn

    import rankscope.torch as rst
    from shim_harness import TinyLM, batch, lm_loss

    for dtype in DTYPES:
        for encoding in ENCODINGS:
            torch.manual_seed(7)
            model = TinyLM().to(getattr(torch, dtype))
            ddp = nn.parallel.DistributedDataParallel(model)
            mon = rst.attach(
                ddp,
                collector=collector,
                job=f"clean-{dtype}-{encoding}",
                sketch_dim=1024,
                sketch_encoding=encoding,
                comm_hook=wide_hook,
                integrity_every=1,
                param_check_every=0,
            )
            mon._bypass_native = device_path
            sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
            for step in range(steps_per_combo):
                sgd.zero_grad(set_to_none=True)
                loss = lm_loss(ddp, *batch(rank, step))
                loss.backward()
                sgd.step()
                mon.step(loss)
            assert mon.flush(120.0), "reports not acknowledged"
            mon.close()


def start_collector(binary: Path, tmp: Path):
    db, log_path = tmp / "rankscope.db", tmp / "collector.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                str(binary),
                "--grpc_address=127.0.0.1:0",
                "--metrics_address=",
                "--http_address=",
                f"--db_path={db}",
                "--step_timeout=60s",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while True:
        m = re.search(r"serving gRPC on [0-9.]+:(\d+)", log_path.read_text())
        if m:
            return proc, f"127.0.0.1:{m.group(1)}", db
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"collector did not start:\n{log_path.read_text()}")
        time.sleep(0.05)


def clean_steps(args) -> dict:
    import shim_harness

    per_combo = args.steps // (len(DTYPES) * len(ENCODINGS))
    with tempfile.TemporaryDirectory(dir=args.keep) as tmp:
        print(f"collector database under {tmp}", flush=True)
        proc, address, db = start_collector(
            Path(args.build) / "bin" / "rankscope-collector", Path(tmp)
        )
        try:
            t0 = time.monotonic()
            shim_harness.spawn(
                clean_worker, args.world, address, per_combo, args.device_path, timeout=3600.0
            )
            elapsed = time.monotonic() - t0
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
            out = {}
            for dtype in DTYPES:
                for encoding in ENCODINGS:
                    rows = con.execute(
                        "SELECT integrity_error_ratio, integrity_relative_error, integrity_fault "
                        "FROM step_stats WHERE job = ?",
                        (f"clean-{dtype}-{encoding}",),
                    ).fetchall()
                    checked = [r for r in rows if r[0] is not None]
                    out[f"{dtype}/{encoding}"] = {
                        "steps": len(rows),
                        "checked": len(checked),
                        "flagged": sum(1 for r in checked if r[2]),
                        "max_ratio": max((r[0] for r in checked), default=None),
                        "max_relative_error": max((r[1] for r in checked), default=None),
                    }
            con.close()
        finally:
            proc.terminate()
            proc.wait(30)
    return {
        "per_combination": out,
        "seconds": elapsed,
        "world": args.world,
        "device_path": args.device_path,
    }


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def cost(args) -> dict:
    from rankscope import _native
    from rankscope._device_sketch import DeviceSketch
    from rankscope._integrity import ReducedSketch
    from rankscope.fingerprint import SegmentLayout

    n = args.cost_numel
    buf = torch.randn(n)
    layout = SegmentLayout(n, [0], [n], [0])
    counters = {"integrity_checks_sent": 0, "integrity_errors": 0, "integrity_skipped_buckets": 0}
    reduced = ReducedSketch(1024, _native.DEFAULT_SKETCH_SEED, 0, 4, 1, counters)
    reduced.bypass_native = args.device_path
    reduced.begin_step(0)
    local = _native.Sketch(1024, _native.DEFAULT_SKETCH_SEED, 1)
    device_local = DeviceSketch(1024, _native.DEFAULT_SKETCH_SEED, buf.device)

    def add_reduced():
        reduced.reset()
        reduced.add(buf, layout)

    def add_local():
        if args.device_path:
            device_local.reset()
            device_local.add_segments(buf, layout)
            return
        local.reset()
        local.add(buf.data_ptr(), _native.DTYPE_FLOAT32, n, 0)

    # A forward + backward of a linear stack holding n parameters, the step it is amortized over.
    d = 1024
    layers = max(1, n // (d * d))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(layers)])
    x = torch.randn(args.batch, d)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    reduced_ms = median_ms(add_reduced, args.reps)
    local_ms = median_ms(add_local, args.reps)
    step_ms = median_ms(step, max(3, args.reps // 4))
    return {
        "numel": n,
        "reduced_sketch_ms": reduced_ms,
        "local_sketch_ms": local_ms,
        "reduced_over_local": reduced_ms / local_ms,
        "model_params": layers * d * d,
        "fwd_bwd_ms": step_ms,
        "checking_rank_share_of_step": reduced_ms / step_ms,
        "threads": torch.get_num_threads(),
        "device_path": args.device_path,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--steps", type=int, default=10000, help="clean steps in all (default %(default)s)"
    )
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--build", default=os.environ.get("RANKSCOPE_BUILD_DIR", str(REPO / "build")))
    p.add_argument("--cost-numel", type=int, default=16 * 2**20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip-clean", action="store_true")
    p.add_argument(
        "--device-path",
        action="store_true",
        help="the shim's device path (torch ops on the CPU, deferred reports)",
    )
    p.add_argument("--keep", help="make the collector's database in this directory (default: /tmp)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    results = {"cost": cost(args)}
    print(json.dumps(results["cost"], indent=1), flush=True)
    if not args.skip_clean:
        results["clean"] = clean_steps(args)
        print(json.dumps(results["clean"], indent=1), flush=True)
        flagged = sum(c["flagged"] for c in results["clean"]["per_combination"].values())
        print(f"false alarms: {flagged}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
