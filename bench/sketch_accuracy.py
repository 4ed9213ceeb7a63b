#!/usr/bin/env python3
"""Accuracy per byte of the sketch encodings on real DDP gradients (issue 15).

    PYTHONPATH=build/python .venv/bin/python bench/sketch_accuracy.py [--steps 24 --seeds 8]

1. Trains examples/train_ddp.py's CharTransformer with DDP on 4 gloo ranks (CPU), once as the
   example's size ("example": d=64, 2 layers) and once larger ("large": d=256, 4 layers), each
   rank on its own DistributedSampler shard. Every step each rank's local gradient *before* the
   all-reduce (computed under ddp.no_sync(), then all-reduced by hand and stepped, which is what
   DDP does) is gathered to rank 0 and kept, in float32, in rankscope's flat parameter order.
2. For every step, the exact direction consistency C (mean pairwise cosine) and every rank's
   consensus cosine cos(g_r, sum_{j != r} g_j) from the full gradients, in float64.
3. For every budget (bytes per rank-step) and encoding, k = budget / bytes-per-bin; for each of
   `--seeds` sketch seeds: rankscope's count sketch (the agent's C++ kernel, rankscope._native)
   of every rank's gradient, packed and unpacked as the agent and the collector do
   (rankscope._native.pack_sketch / unpack_sketch), and the same statistics from the sketches.
   Beside each k, an ideal count sketch of the same k: bin and sign of every coordinate drawn
   independently at random (numpy), unquantized.
4. Prints, per model, budget and encoding, the p50 / p95 absolute error of C and of the consensus
   cosines against the exact values (over steps x seeds, and x ranks for consensus).
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from train_ddp import TEXT, CharTransformer, CharWindows, free_port  # noqa: E402

MODELS = {
    "example": dict(d=64, heads=4, layers=2),
    "large": dict(d=256, heads=8, layers=4),
}
ENCODINGS = ("float32", "float16", "int8")
WORLD = 4


def worker(rank, world, port, cfg, steps, ctx, bsz, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)
    data = CharWindows(TEXT, ctx)
    model = CharTransformer(len(data.vocab), ctx, **cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    loader = iter(DataLoader(data, batch_size=bsz, sampler=sampler))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    kept = []
    for _ in range(steps):
        x, y = next(loader)
        opt.zero_grad(set_to_none=False)
        with ddp.no_sync():  # the local gradient, before DDP's all-reduce
            loss = F.cross_entropy(ddp(x).reshape(-1, len(data.vocab)), y.reshape(-1))
            loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in params]).float()
        gathered = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(gathered, g)
        if rank == 0:
            kept.append(torch.stack(gathered))
        for p in params:  # DDP's averaging all-reduce
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    if rank == 0:
        torch.save(kept, out_path)
    dist.barrier()
    dist.destroy_process_group()


def statistics(v):
    """(direction consistency, consensus cosines) of the rows of v (float64 [W, n])."""
    norms = np.linalg.norm(v, axis=1)
    units = v / norms[:, None]
    w = v.shape[0]
    c = (np.dot(units.sum(0), units.sum(0)) - w) / (w * (w - 1))
    total = v.sum(0)
    rest = total[None, :] - v
    consensus = (v * rest).sum(1) / (norms * np.linalg.norm(rest, axis=1))
    return c, consensus


def percentiles(errors):
    a = np.abs(np.asarray(errors))
    return np.percentile(a, 50), np.percentile(a, 95)


def evaluate(grads, budgets, seeds, native):
    """{(label, k): ([C errors], [consensus errors])} over steps x seeds."""
    results = {}
    n = grads[0].shape[1]
    exact = [statistics(g.double().numpy()) for g in grads]
    dims = sorted({b // native.SKETCH_BYTES_PER_BIN[e] for b in budgets for e in ENCODINGS})
    for seed in range(seeds):
        for k in dims:
            sk = native.Sketch(k, 0x9E3779B97F4A7C15 ^ (seed * 7919))
            rng = np.random.default_rng(1000 + seed * 31 + k)
            ideal_bin = rng.integers(0, k, n)
            ideal_sign = rng.choice(np.array([-1.0, 1.0]), n)
            for step, g in enumerate(grads):
                floats = []
                for r in range(g.shape[0]):
                    sk.reset()
                    row = g[r].contiguous()
                    sk.add(row.data_ptr(), native.DTYPE_FLOAT32, n, 0)
                    floats.append(sk.values())
                ideal = np.stack(
                    [
                        np.bincount(
                            ideal_bin, weights=ideal_sign * g[r].double().numpy(), minlength=k
                        )
                        for r in range(g.shape[0])
                    ]
                )
                variants = {("ideal", k): ideal}
                for e in ENCODINGS:
                    if not any(b // native.SKETCH_BYTES_PER_BIN[e] == k for b in budgets):
                        continue
                    rows = []
                    for f in floats:
                        if e == "float32":
                            rows.append(np.asarray(f, dtype=np.float64))
                        else:
                            bins, scale = native.pack_sketch(f, e)
                            rows.append(np.asarray(native.unpack_sketch(bins, e, scale)))
                    variants[(e, k)] = np.stack(rows)
                c_exact, cons_exact = exact[step]
                for key, v in variants.items():
                    c, cons = statistics(v)
                    c_err, cons_err = results.setdefault(key, ([], []))
                    c_err.append(c - c_exact)
                    cons_err.extend(cons - cons_exact)
    return results, [e[0] for e in exact]


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="example,large")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--budgets", default="2048,4096,8192", help="bytes per rank-step")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--work-dir", default="/tmp/rankscope-sketch-accuracy")
    args = ap.parse_args(argv)
    from rankscope import _native as native

    budgets = [int(b) for b in args.budgets.split(",")]
    os.makedirs(args.work_dir, exist_ok=True)
    print(
        "| model | coordinates | budget | encoding | k | C p50 | C p95 | consensus p50 | "
        "consensus p95 |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        cfg = MODELS[name]
        path = os.path.join(args.work_dir, f"{name}-{args.steps}.pt")
        if not os.path.exists(path):
            t0 = time.monotonic()
            mp.start_processes(
                worker,
                args=(WORLD, free_port(), cfg, args.steps, args.ctx, args.batch, path),
                nprocs=WORLD,
                start_method="spawn",
            )
            print(
                f"<!-- {name}: {args.steps} DDP steps in {time.monotonic() - t0:.0f} s -->",
                file=sys.stderr,
            )
        grads = torch.load(path)
        results, c_exact = evaluate(grads, budgets, args.seeds, native)
        n = grads[0].shape[1]
        print(
            f"<!-- {name}: exact C over steps: min {min(c_exact):.3f} median "
            f"{float(np.median(c_exact)):.3f} max {max(c_exact):.3f} -->",
            file=sys.stderr,
        )
        for budget in budgets:
            for e in ENCODINGS:
                k = budget // native.SKETCH_BYTES_PER_BIN[e]
                for label in (e, "ideal"):
                    c50, c95 = percentiles(results[(label, k)][0])
                    r50, r95 = percentiles(results[(label, k)][1])
                    shown = e if label == e else f"ideal count sketch, k = {k}"
                    print(
                        f"| {name} | {n:,} | {budget} | {shown} | {k} | {c50:.4f} | {c95:.4f} "
                        f"| {r50:.4f} | {r95:.4f} |"
                    )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
