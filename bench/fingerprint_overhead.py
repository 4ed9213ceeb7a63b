#!/usr/bin/env python3
"""What rankscope's replica fingerprints cost, against the step and against Megatron's check.

    PYTHONPATH=build/python .venv/bin/python bench/fingerprint_overhead.py [--device cuda]

One process, one model (a decoder-only transformer; size set by --d-model/--layers), measured
in one run with the variants interleaved (rotating order) so that all see the same machine:

  step            forward + backward + SGD step of the bare model (the denominator);
  grad-fp         what the comm hook adds per step: the fingerprint of the gradient laid out in
                  DDP-sized buckets (--bucket-mb) plus the reduced gradient's sum of squares, as
                  the shim does after each bucket's all-reduce (the C++ kernel on the CPU,
                  rankscope.fingerprint.fold_segments' torch ops on a device);
  grad-fp-torch   (CPU only) the same with the torch-op path, for comparison;
  param-fp        the parameter fingerprint (rankscope.fingerprint.fold per parameter), done
                  every param_check_every steps (default 50): per-check and amortized costs;
  megatron-sha1   Megatron-LM's check (``check_param_hashes_across_dp_replicas``): SHA-1 of
                  every parameter's bytes on the host (a device-to-host copy where the model
                  is not on the CPU), hashlib; its all-gather of the hashes is not counted.

With ``--e2e`` it also trains through the real shim, in this process as a one-rank gloo DDP job:
two DDP replicas of the model, one attached with ``fingerprints=True`` (param_check_every as
given) and one with ``fingerprints=False``, stepped alternately; the difference of their median
step times is what the fingerprints add end to end (hook callback, mon.step). The agents point
at an address where no collector listens (reports are buffered and dropped: the training side
is what is measured).

On a device, each timing synchronizes before and after the measured work (the shim itself
never synchronizes; there, the fingerprint kernels queue behind the step's own). Prints median
milliseconds and ratios; ``--json`` writes them to a file.
"""

import argparse
import hashlib
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankscope import _backend
from rankscope import fingerprint as fp


class Lm(nn.Module):
    def __init__(self, vocab, d, layers, heads, ctx):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]]))


def bucket_layouts(params, bucket_bytes):
    """DDP-like buckets (parameters in reverse order, capped at bucket_bytes): for each, the
    flat buffer's size and a SegmentLayout to global offsets (model.parameters() order)."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    buckets, cur, size = [], [], 0
    for i in reversed(range(len(params))):
        cur.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    layouts = []
    for b in buckets:
        starts, counts, offs, pos = [], [], [], 0
        for i in b:
            starts.append(pos)
            counts.append(params[i].numel())
            offs.append(offsets[i])
            pos += params[i].numel()
        layouts.append((b, fp.SegmentLayout(pos, starts, counts, offs)))
    return layouts, offsets


# Long: a benchmark driver run by hand, read top to bottom: its flags, the set-up, the measured
# runs, the table it prints; the measured pieces are functions of their own.
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--param-check-every", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--json", default="")
    ap.add_argument("--e2e", action="store_true", help="also time the real shim (see above)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = Lm(args.vocab, args.d_model, args.layers, args.heads, args.ctx).to(dev)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.SGD(params, lr=1e-3)
    x = torch.randint(0, args.vocab, (args.batch, args.ctx), device=dev)
    y = torch.randint(0, args.vocab, (args.batch, args.ctx), device=dev)
    layouts, offsets = bucket_layouts(params, int(args.bucket_mb * 2**20))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        loss.backward()
        opt.step()

    step()  # grads exist from here on
    # The gradient in bucket buffers, as DDP holds it.
    buffers = [torch.cat([params[i].grad.reshape(-1) for i in b]) for b, _ in layouts]

    native = _backend.fingerprint(params[0]).backend == _backend.NATIVE

    def grad_fp_torch():
        fps, sss = [], []
        for buf, (_, layout) in zip(buffers, layouts):
            fps.append(fp.fold_segments(buf, layout))
            n = torch.linalg.vector_norm(buf, 2, dtype=torch.float64)
            sss.append(n * n)
        return torch.stack(fps).sum(), torch.stack(sss).sum()

    def grad_fp():  # what the shim runs: the C++ kernel on the CPU, torch ops on a device
        if not native:
            return grad_fp_torch()
        fps = [fp.fold_segments_cpu(buf, layout) for buf, (_, layout) in zip(buffers, layouts)]
        return sum(f for f, _ in fps), sum(s for _, s in fps)

    def param_fp():
        with torch.no_grad():
            if native:
                return fp.add_all([fp.fold_cpu(p, o)[0] for p, o in zip(params, offsets)], dev)
            return torch.stack([fp.fold(p, o) for p, o in zip(params, offsets)]).sum()

    def megatron_sha1():
        hashes = []
        for p in params:
            h = hashlib.sha1()
            h.update(
                p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                if p.dtype == torch.bfloat16
                else p.detach().cpu().numpy().tobytes()
            )
            hashes.append(h.digest())
        return hashes

    variants = {
        "step": step,
        "grad-fp": grad_fp,
        "param-fp": param_fp,
        "megatron-sha1": megatron_sha1,
    }
    if native:
        variants["grad-fp-torch"] = grad_fp_torch
    for fn in variants.values():  # warm-up
        fn()
        sync()
    times = {k: [] for k in variants}
    names = list(variants)
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for k in order:
            sync()
            t0 = time.perf_counter()
            variants[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    pce = args.param_check_every
    per_step = med["grad-fp"] + med["param-fp"] / pce
    result = {
        "device": str(dev) if dev.type != "cuda" else torch.cuda.get_device_name(dev),
        "params": n_params,
        "buckets": len(layouts),
        "torch_threads": torch.get_num_threads(),
        "median_ms": med,
        "grad_fp_over_step": med["grad-fp"] / med["step"],
        "param_fp_over_step": med["param-fp"] / med["step"],
        "fingerprints_per_step_over_step": per_step / med["step"],
        "megatron_over_param_fp": med["megatron-sha1"] / med["param-fp"],
        "megatron_every_step_over_step": med["megatron-sha1"] / med["step"],
    }
    print(
        f"model: {n_params / 1e6:.2f} M parameters in {len(layouts)} bucket(s), device "
        f"{result['device']}, {result['torch_threads']} torch threads, {args.reps} reps"
    )
    for k in names:
        print(f"  {k:14s} {med[k]:9.3f} ms (median)")
    print(
        "reduced-gradient fingerprint + norm, every step: "
        f"{100 * result['grad_fp_over_step']:.2f} % of a step"
    )
    print(
        f"parameter fingerprint: {100 * result['param_fp_over_step']:.2f} % of a step per check,"
        f" {100 * med['param-fp'] / pce / med['step']:.3f} % amortized over {pce} steps"
    )
    print(
        f"all fingerprints, per step: {100 * result['fingerprints_per_step_over_step']:.2f} % of "
        "a step"
    )
    print(
        f"Megatron SHA-1 of every parameter on the host: {result['megatron_over_param_fp']:.1f}x"
        f" rankscope's parameter fingerprint; {100 * result['megatron_every_step_over_step']:.1f}"
        " % of a step if done every step"
    )
    if args.e2e:
        result["e2e"] = e2e(args, dev)
        on, off = result["e2e"]["fingerprints_on_ms"], result["e2e"]["fingerprints_off_ms"]
        print(
            f"end to end through the shim (1-rank DDP): fingerprints on {on:.1f} ms, off "
            f"{off:.1f} ms a step: +{100 * (on - off) / off:.2f} %"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def e2e(args, dev):
    import copy
    import socket
    import warnings

    import torch.distributed as dist

    import rankscope.torch as rst

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    base = Lm(args.vocab, args.d_model, args.layers, args.heads, args.ctx).to(dev)
    x = torch.randint(0, args.vocab, (args.batch, args.ctx), device=dev)
    y = torch.randint(0, args.vocab, (args.batch, args.ctx), device=dev)
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, on in (("on", True), ("off", False)):
            ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            mon = rst.attach(
                ddp,
                collector="127.0.0.1:1",
                job=f"fp-bench-{name}",
                fingerprints=on,
                param_check_every=args.param_check_every,
                warn_after=1e9,
                close_timeout=0,
            )
            runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3), mon, [])
        steps = max(2 * args.reps, args.param_check_every)
        for i in range(steps + 2):
            for name in ("on", "off") if i % 2 else ("off", "on"):
                ddp, opt, mon, times = runs[name]
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(x).reshape(-1, args.vocab), y.reshape(-1))
                loss.backward()
                opt.step()
                mon.step(loss)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
        out = {}
        for name, (_, _, mon, times) in runs.items():
            out[f"fingerprints_{name}_ms"] = statistics.median(times) * 1e3
            out[f"stats_{name}"] = {
                k: v for k, v in mon.close(timeout=0).items() if k.startswith("shim_")
            }
    dist.destroy_process_group()
    out["steps_each"] = steps
    return out


if __name__ == "__main__":
    main()
