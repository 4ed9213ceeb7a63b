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
alone, the reduced bucket's fingerprint in the all-reduce's callback, the layout lookup) and
``mon.step``, and prints their time a call.

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
    """Wraps STAGES' methods with timers; returns (seconds, calls) dicts keyed by
    'Class.method', and a function that restores the originals."""
    import importlib

    seconds, calls, originals = {}, {}, []
    for module, cls_name, name in STAGES:
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, name)
        key = f"{cls_name}.{name}"
        seconds[key], calls[key] = 0.0, 0

        def timed(*args, _f=original, _k=key, **kwargs):
            t = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                seconds[_k] += time.perf_counter() - t
                calls[_k] += 1

        setattr(cls, name, timed)
        originals.append((cls, name, original))

    def restore():
        for cls, name, original in originals:
            setattr(cls, name, original)

    return seconds, calls, restore


def main() -> None:
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

    import rankscope.torch as rst

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    # One layer's parameters (weight and bias) in a bucket: DDP's cap is in MiB.
    cap_mb = (a.width * a.width + a.width) * 4 / 2**20
    variants = ["plain", "plain-2", "hook", "rankscope", "rankscope-device"]
    ddp, opt, mons = {}, {}, {}
    calls = [0]
    for v in variants:
        m = DDP(model(a.layers, a.width), bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
        if v == "hook":
            m.register_comm_hook(None, counting_allreduce_hook(calls))
        elif v.startswith("rankscope"):
            mon = rst.attach(
                m,
                collector="127.0.0.1:9",
                job=f"hook-{v}",
                sketch_dim=a.sketch_dim,
                warn_after=1e9,
                **extra,
            )
            if v == "rankscope-device":
                mon._bypass_native = True
            mons[v] = mon
        ddp[v] = m
        opt[v] = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(a.batch, a.width)
    times = {v: [] for v in variants}
    step_calls = {v: [] for v in mons}
    buckets = []
    for i in range(a.warmup + a.steps):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for v in order:
            calls[0] = 0
            t0 = time.perf_counter()
            loss = ddp[v](x).square().mean()
            loss.backward()
            opt[v].step()
            opt[v].zero_grad(set_to_none=False)
            if v in mons:
                t1 = time.perf_counter()
                mons[v].step(loss)
                step_calls[v].append(time.perf_counter() - t1)
            elapsed = time.perf_counter() - t0
            if i >= a.warmup:
                times[v].append(elapsed)
                if v == "hook":
                    buckets.append(calls[0])
    breakdown = {}
    if a.breakdown:
        for v in mons:
            seconds, calls, restore = timed_stages()
            try:
                for _ in range(a.steps):
                    loss = ddp[v](x).square().mean()
                    loss.backward()
                    opt[v].step()
                    opt[v].zero_grad(set_to_none=False)
                    mons[v].step(loss)
            finally:
                restore()
            breakdown[v] = {
                k: (seconds[k] / calls[k] * 1e6, calls[k] / a.steps) for k in calls if calls[k]
            }
    for mon in mons.values():
        mon.close(timeout=0.1)
    dist.destroy_process_group()

    n_buckets = statistics.median(buckets)

    def paired(v, base):
        return statistics.median(b - c for b, c in zip(times[v], times[base]))

    rows = {}
    print(
        f"{a.layers} layers of Linear({a.width}, {a.width}), {n_buckets:.0f} buckets a step, "
        f"k = {a.sketch_dim}, attach {extra}, {a.steps} steps a variant, load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'variant':18} {'step':>10} {'vs plain':>10} {'vs hook, a bucket':>18} {'mon.step':>10}"
    )
    for v in variants:
        med = statistics.median(times[v]) * 1e3
        vs_plain = paired(v, "plain") * 1e3
        per_bucket = paired(v, "hook") / n_buckets * 1e6 if v.startswith("rankscope") else None
        mon_step = statistics.median(step_calls[v][a.warmup :]) * 1e6 if v in mons else None
        rows[v] = {
            "step_ms": med,
            "paired_vs_plain_ms": vs_plain,
            "per_bucket_vs_hook_us": per_bucket,
            "mon_step_us": mon_step,
        }
        print(
            f"{v:18} {med:8.3f}ms {vs_plain:+8.3f}ms "
            + (f"{per_bucket:15.1f} us" if per_bucket is not None else f"{'':18}")
            + (f" {mon_step:7.1f} us" if mon_step is not None else "")
        )
    for v, stages in breakdown.items():
        print(f"{v}: time a call (calls a step)")
        for k, (us, per_step) in sorted(stages.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            print(f"  {k:36} {us:9.1f} us  ({per_step:g})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"buckets": n_buckets, "args": vars(a), "rows": rows, "breakdown": breakdown},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
