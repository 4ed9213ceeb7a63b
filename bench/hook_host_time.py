#!/usr/bin/env python3
"""The host time rankscope adds per DDP bucket and in ``mon.step``, on the CPU, with many buckets
(issue 33 item 5: the CPU-visible part of the GPU path's host cost).

    PYTHONPATH=build/python .venv/bin/python bench/hook_host_time.py [--layers 96] [--width 64]

One process, DDP over gloo with a world of one (the all-reduce is a copy), a model of --layers
Linear(width, width) layers and a bucket cap small enough that DDP puts about one layer in each
bucket, so the per-bucket costs dominate and the kernels' share is small (width 64: 4,160
coordinates a bucket). Variants, each its own replica of the same model, stepped one after the
other in a rotating order so all see the same machine noise:

  plain            DDP, no comm hook;
  plain-2          the same again (the noise floor);
  hook             DDP with torch's default all-reduce hook registered as a comm hook (the
                   baseline for a Python comm hook: what registering any hook costs);
  rankscope        rankscope.torch.attach: the CPU path (the C++ kernel, in place);
  rankscope-device the same with the device path forced on the CPU tensors (``bypass_native``:
                   the torch ops a GPU tensor runs through when Triton is not used), i.e. the
                   Python and dispatch a GPU step's buckets go through, without a GPU.

With --breakdown, after the run, each rankscope variant trains --steps more steps with timers around
the shim's per-bucket stages (the sketch of the local bucket with its per-bucket norms, the norms
alone where torch computes them, the reduced bucket's fingerprint in the all-reduce's callback,
the layout lookup) and ``mon.step``, and prints their wall time a call and the calling thread's
CPU time a call (the difference is waiting, mostly for the GIL: the callback runs on the process
group's thread).

Prints each variant's median step time, the paired median difference against ``hook`` divided by
the buckets a step (the host time a bucket rankscope adds beyond any comm hook), and the median
time of ``mon.step`` itself. The agents report to a port nobody listens on (they buffer on their
own thread): the training thread's cost is what is measured.
"""

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def counting_allreduce_hook(calls: list):
    """The default all-reduce hook, counting its calls (= buckets) in ``calls[0]``."""

    def hook(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    return hook


# The shim's per-bucket stages --breakdown times: (module, class, method).
STAGES = [
    ("rankscope._bucket_sketcher", "BucketSketcher", "add_bucket"),
    ("rankscope._bucket_sketcher", "BucketSketcher", "_add_bucket_norms"),
    ("rankscope._bucket_sketcher", "BucketSketcher", "_note_bucket"),
    ("rankscope._replica", "ReplicaFingerprints", "bucket_layout"),
    ("rankscope._replica", "ReplicaFingerprints", "fold_reduced"),
    ("rankscope._monitor", "Monitor", "step"),
]


def timed_stages():
    """Wraps STAGES' methods with timers; returns (seconds, calls, cpu_seconds) dicts keyed by
    'Class.method', and a function that restores the originals. ``seconds`` is wall time,
    ``cpu_seconds`` the calling thread's CPU time: the difference is time spent waiting (for the
    GIL, mostly: the all-reduce callback runs on the process group's thread and takes turns with
    the autograd thread's comm hook)."""
    import importlib

    seconds, calls, cpu, originals = {}, {}, {}, []
    for module, cls_name, name in STAGES:
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, name)
        key = f"{cls_name}.{name}"
        seconds[key], calls[key], cpu[key] = 0.0, 0, 0.0

        def timed(*args, _f=original, _k=key, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                seconds[_k] += time.perf_counter() - t
                cpu[_k] += time.thread_time() - c
                calls[_k] += 1

        setattr(cls, name, timed)
        originals.append((cls, name, original))

    def restore():
        for cls, name, original in originals:
            setattr(cls, name, original)

    return seconds, calls, cpu, restore


VARIANTS = ["plain", "plain-2", "hook", "rankscope", "rankscope-device"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300, help="measured steps a variant")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--sketch-dim", type=int, default=1024)
    ap.add_argument(
        "--attach",
        default="{}",
        help="more keyword arguments for rankscope.torch.attach, as JSON (e.g. '{\"integrity_every\": 0}')",
    )
    ap.add_argument("--breakdown", action="store_true", help="time the shim's stages too")
    ap.add_argument("--json", default="", help="write the results here too")
    a = ap.parse_args()
    if a.layers < 1 or a.width < 1 or a.steps < 1 or a.warmup < 0:
        ap.error("--layers, --width and --steps must be positive, --warmup not negative")
    try:
        extra = json.loads(a.attach)
    except json.JSONDecodeError as e:
        ap.error(f"--attach is not JSON: {e}")
    if not isinstance(extra, dict):
        ap.error("--attach must be a JSON object of attach's keyword arguments")
    return a, extra


class Variants:
    """One DDP replica, optimizer and (rankscope variants) monitor per variant; ``calls[0]``
    counts the ``hook`` variant's buckets."""

    def __init__(self, a, extra):
        import rankscope.torch as rst

        # One layer's parameters (weight and bias) in a bucket: DDP's cap is in MiB.
        cap_mb = (a.width * a.width + a.width) * 4 / 2**20
        self.ddp, self.opt, self.mons = {}, {}, {}
        self.calls = [0]
        self.x = torch.randn(a.batch, a.width)
        for v in VARIANTS:
            m = DDP(model(a.layers, a.width), bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
            if v == "hook":
                m.register_comm_hook(None, counting_allreduce_hook(self.calls))
            elif v.startswith("rankscope"):
                mon = rst.attach(
                    m,
                    collector="127.0.0.1:9",
                    job=f"hook-{v}",
                    sketch_dim=a.sketch_dim,
                    warn_after=1e9,
                    **extra,
                )
                mon._bypass_native = v == "rankscope-device"
                self.mons[v] = mon
            self.ddp[v] = m
            self.opt[v] = torch.optim.SGD(m.parameters(), lr=1e-3)

    def step(self, v):
        """One training step of variant ``v``; returns the seconds ``mon.step`` took, or None."""
        loss = self.ddp[v](self.x).square().mean()
        loss.backward()
        self.opt[v].step()
        self.opt[v].zero_grad(set_to_none=False)
        if v not in self.mons:
            return None
        t = time.perf_counter()
        self.mons[v].step(loss)
        return time.perf_counter() - t

    def close(self):
        for mon in self.mons.values():
            mon.close(timeout=0.1)


def interleaved(a, vs: Variants):
    """Steps every variant in a rotating order; returns each variant's measured step times, each
    rankscope variant's ``mon.step`` times, and the buckets a step."""
    times = {v: [] for v in VARIANTS}
    mon_step = {v: [] for v in vs.mons}
    buckets = []
    for i in range(a.warmup + a.steps):
        order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
        for v in order:
            vs.calls[0] = 0
            t0 = time.perf_counter()
            in_mon = vs.step(v)
            elapsed = time.perf_counter() - t0
            if i < a.warmup:
                continue
            times[v].append(elapsed)
            if in_mon is not None:
                mon_step[v].append(in_mon)
            if v == "hook":
                buckets.append(vs.calls[0])
    return times, mon_step, statistics.median(buckets)


def breakdown(a, vs: Variants) -> dict:
    """Per rankscope variant: {stage: (microseconds a call, calls a step)} over --steps steps."""
    out = {}
    for v in vs.mons:
        seconds, calls, cpu, restore = timed_stages()
        try:
            for _ in range(a.steps):
                vs.step(v)
        finally:
            restore()
        out[v] = {
            k: (seconds[k] / calls[k] * 1e6, calls[k] / a.steps, cpu[k] / calls[k] * 1e6)
            for k in calls
            if calls[k]
        }
    return out


def report(a, extra, times, mon_step, n_buckets, stages) -> dict:
    """Prints the table (and the breakdown); returns the rows."""

    def paired(v, base):
        return statistics.median(b - c for b, c in zip(times[v], times[base]))

    print(
        f"{a.layers} layers of Linear({a.width}, {a.width}), {n_buckets:.0f} buckets a step, "
        f"k = {a.sketch_dim}, attach {extra}, {a.steps} steps a variant, load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'variant':18} {'step':>10} {'vs plain':>10} {'vs hook, a bucket':>18} {'mon.step':>10}"
    )
    rows = {}
    for v in VARIANTS:
        med = statistics.median(times[v]) * 1e3
        vs_plain = paired(v, "plain") * 1e3
        per_bucket = paired(v, "hook") / n_buckets * 1e6 if v.startswith("rankscope") else None
        in_mon = statistics.median(mon_step[v]) * 1e6 if v in mon_step else None
        rows[v] = {
            "step_ms": med,
            "paired_vs_plain_ms": vs_plain,
            "per_bucket_vs_hook_us": per_bucket,
            "mon_step_us": in_mon,
        }
        print(
            f"{v:18} {med:8.3f}ms {vs_plain:+8.3f}ms "
            + (f"{per_bucket:15.1f} us" if per_bucket is not None else f"{'':18}")
            + (f" {in_mon:7.1f} us" if in_mon is not None else "")
        )
    for v, by_stage in stages.items():
        print(f"{v}: wall time a call, the thread's CPU time a call (calls a step)")
        for k, (us, per_step, cpu_us) in sorted(
            by_stage.items(), key=lambda kv: -kv[1][0] * kv[1][1]
        ):
            print(f"  {k:36} {us:9.1f} us {cpu_us:9.1f} us  ({per_step:g})")
    return rows


def main() -> None:
    a, extra = parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    vs = Variants(a, extra)
    try:
        times, mon_step, n_buckets = interleaved(a, vs)
        stages = breakdown(a, vs) if a.breakdown else {}
    finally:
        vs.close()
        dist.destroy_process_group()
    rows = report(a, extra, times, mon_step, n_buckets, stages)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"buckets": n_buckets, "args": vars(a), "rows": rows, "breakdown": stages},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
