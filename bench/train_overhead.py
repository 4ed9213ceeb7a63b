#!/usr/bin/env python3
"""What rankscope costs a training step, against the in-band alternative, measured in one run.

    PYTHONPATH=build/python .venv/bin/python bench/train_overhead.py --build-dir build

Four DDP ranks (gloo, CPU) each hold one replica per variant of the same model
(examples/train_ddp.py's character transformer) and train them in turn, one step of each
variant after the other in a rotating order, so that every variant sees the same machine noise:

  plain      DDP, nothing else;
  plain-2    the same again: the difference between plain and plain-2 is the noise floor;
  rankscope  rankscope.torch attached (comm hook sketches the local gradient with the C++
             kernel, mon.step hands loss, norm and sketch to the agent; a real collector runs);
  dormant    rankscope.torch attached dormant (hook only chains to the all-reduce);
  in-band    what a user would write by hand: the same sketch in a comm hook, then every step an
             all_gather of (loss, grad norm, sketch) and the metrics computed on rank 0.

A step is forward + backward (with DDP's all-reduce) + optimizer step + the variant's reporting.
Prints the median step time of each variant (rank 0's clock; the ranks run in lockstep), the
overhead ratios against plain, and rankscope's overhead as a fraction of in-band's.
"""

import argparse
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import train_ddp  # noqa: E402

VARIANTS = ("plain", "plain-2", "rankscope", "dormant", "in-band")


class InBand:
    """The hand-written in-band alternative: same sketch (rankscope's C++ kernel), same flat
    offsets, then a blocking all_gather and rank-0 statistics every step."""

    def __init__(self, ddp, dim):
        from rankscope import _native

        self._native = _native
        self.dim = dim
        self.sketch = _native.Sketch(dim, _native.DEFAULT_SKETCH_SEED)
        self.offsets, total = {}, 0
        for p in ddp.module.parameters():
            self.offsets[id(p)] = total
            total += p.numel()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.buf = torch.empty(dim + 2)
        self.gathered = [torch.empty(dim + 2) for _ in range(self.world)]
        self.last_metrics = None
        ddp.register_comm_hook(self, InBand.hook)

    @staticmethod
    def hook(state, bucket):
        state.add_bucket(bucket)
        return default_hooks.allreduce_hook(None, bucket)

    def add_bucket(self, bucket):
        state = self
        addrs, ns, offs = [], [], []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            addrs.append(g.data_ptr())
            ns.append(g.numel())
            offs.append(state.offsets[id(p)])
        state.sketch.add_many(addrs, ns, offs, state._native.DTYPE_FLOAT32)

    def step(self, loss):
        self.buf[0] = loss.detach()
        self.buf[1] = math.sqrt(self.sketch.sum_squares())
        self.sketch.copy_to(self.buf[2:].data_ptr())
        self.sketch.reset()
        dist.all_gather(self.gathered, self.buf)
        if self.rank == 0:
            m = torch.stack(self.gathered).double()
            losses, norms, sk = m[:, 0], m[:, 1], m[:, 2:]
            u = sk / sk.norm(dim=1, keepdim=True).clamp_min(1e-30)
            w = self.world
            cos = (float(u.sum(0).square().sum()) - w) / (w * (w - 1))
            self.last_metrics = (
                float(losses.std(unbiased=False)),
                float(norms.std(unbiased=False) / norms.mean()),
                cos,
            )


def timed(fn, acc):
    """fn, adding the seconds each call takes to acc[0]."""

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t0

    return wrapper


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, collector, out_path):
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size
    )
    import rankscope.torch as rst

    data = train_ddp.CharWindows(train_ddp.TEXT, args.ctx)
    g = torch.Generator().manual_seed(rank)
    batches = [
        data[i] for i in torch.randint(0, len(data), (args.batch_size * 64,), generator=g).tolist()
    ]
    xs = torch.stack([b[0] for b in batches]).split(args.batch_size)
    ys = torch.stack([b[1] for b in batches]).split(args.batch_size)

    variants, monitors = {}, []
    own = {name: [0.0] for name in VARIANTS}  # seconds spent in the variant's own code
    for name in VARIANTS:
        torch.manual_seed(0)
        model = train_ddp.CharTransformer(
            len(data.vocab), args.ctx, d=args.d_model, layers=args.layers, dropout=0.0
        )
        ddp = nn.parallel.DistributedDataParallel(model)
        report = None
        if name in ("rankscope", "dormant"):
            mon = rst.attach(
                ddp,
                collector=collector,
                job=f"bench-{name}",
                sketch_dim=args.sketch_dim,
                dormant=(name == "dormant"),
            )
            mon._add_bucket = timed(mon._add_bucket, own[name])
            report = timed(mon.step, own[name])
            monitors.append(mon)
        elif name == "in-band":
            inband = InBand(ddp, args.sketch_dim)
            inband.add_bucket = timed(inband.add_bucket, own[name])
            report = timed(inband.step, own[name])
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        variants[name] = (ddp, opt, report)

    times = {name: [] for name in VARIANTS}
    own_times = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    for it in range(args.warmup + args.steps):
        x, y = xs[it % len(xs)], ys[it % len(ys)]
        rot = it % len(order)
        for name in order[rot:] + order[:rot]:
            ddp, opt, report = variants[name]
            dist.barrier()  # every variant's step starts together on all ranks
            own[name][0] = 0.0
            t0 = time.perf_counter()
            logits = ddp(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if report is not None:
                report(loss)
            dt = time.perf_counter() - t0
            if it >= args.warmup:
                times[name].append(dt)
                own_times[name].append(own[name][0])
        if rank == 0 and (it + 1) % 20 == 0:
            print(
                f"\r  {it + 1}/{args.warmup + args.steps} rounds",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if rank == 0:
        print(file=sys.stderr)
        nparams = sum(p.numel() for p in variants["plain"][0].parameters())
        with open(out_path, "w") as f:
            json.dump({"times": times, "own": own_times, "params": nparams}, f)
    for mon in monitors:
        mon.close(timeout=5)
    dist.barrier()
    dist.destroy_process_group()


def start_collector(build_dir: Path, tmp: Path):
    binary = build_dir / "bin" / "rankscope-collector"
    log = tmp / "collector.log"
    proc = subprocess.Popen(
        [
            str(binary),
            "--grpc_address=127.0.0.1:0",
            "--metrics_address=127.0.0.1:0",
            "--http_address=",
            f"--db_path={tmp / 'bench.db'}",
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"serving gRPC on [0-9.]+:(\d+)", log.read_text())
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"bench: collector did not start: {log.read_text()}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build"))
    p.add_argument("--steps", type=int, default=120, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ctx", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sketch-dim", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proc, collector = start_collector(Path(args.build_dir), tmp)
        try:
            out = tmp / "times.txt"
            mp.start_processes(
                worker,
                args=(args, free_port(), collector, str(out)),
                nprocs=args.world_size,
                join=True,
                start_method="spawn",
            )
            result = json.loads(out.read_text())
        finally:
            proc.terminate()
            proc.wait(20)

    times, own = result["times"], result["own"]
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["plain"]
    print(
        f"model: {result['params']:,} parameters, {args.world_size} ranks (gloo, CPU, "
        f"{args.threads} thread each), batch {args.batch_size}x{args.ctx}, "
        f"sketch_dim {args.sketch_dim}; {args.steps} timed steps per variant, interleaved"
    )
    print("end to end (rank 0's step time; on a shared machine the spread is the noise):")
    print(
        f"  {'variant':<10} {'median ms':>10} {'p25 ms':>8} {'p75 ms':>8} {'vs plain':>9} "
        f"{'paired diff':>12}"
    )
    for k in VARIANTS:
        q = statistics.quantiles(times[k], n=4)
        paired = statistics.median(a - b for a, b in zip(times[k], times["plain"]))
        print(
            f"  {k:<10} {med[k] * 1e3:>10.2f} {q[0] * 1e3:>8.2f} {q[2] * 1e3:>8.2f} "
            f"{(med[k] / base - 1) * 100:>+8.2f}% {paired / base * 100:>+11.2f}%"
        )
    print(
        "time in the variant's own code per step (hook work + step call), median, "
        "as a share of plain's median step:"
    )
    own_med = {k: statistics.median(own[k]) for k in ("rankscope", "dormant", "in-band")}
    for k, v in own_med.items():
        print(f"  {k:<10} {v * 1e3:>8.3f} ms  {v / base * 100:>6.2f}%")
    if own_med["in-band"] > 0:
        print(f"rankscope / in-band (own code): {own_med['rankscope'] / own_med['in-band']:.3f}")
    rs, ib = med["rankscope"] - base, med["in-band"] - base
    if ib > 0:
        print(f"rankscope / in-band (end-to-end medians): {rs / ib:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
