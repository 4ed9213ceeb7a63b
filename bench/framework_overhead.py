#!/usr/bin/env python3
"""What rankscope costs a DeepSpeed step on the CPU, side by side with the same training without it.

    PYTHONPATH=build/python:tests/python .venv/bin/python bench/framework_overhead.py

Two ranks (gloo, DeepSpeed's CPU accelerator, one torch thread each) each hold, for every ZeRO
stage asked for, two engines of the same model (tests/python/shim_harness.py's TinyLM, or a
wider one with --d-model): **plain**, **plain-2** (the same again: plain against plain-2 is the
noise floor), and **rankscope** (``rankscope.torch.attach(engine)``:
tensor hooks on every parameter, the float32 sums under accumulation, the sketch at the step).
They train in turn, one step of each after the other in a rotating order, so both see the same
machine noise. A step is ``--accum`` micro-batches (forward, ``engine.backward``,
``engine.step``). Prints rank 0's median step time per variant and the paired median difference.
The rankscope engines report to ``--collector`` (default: a port nobody listens on; the agent
buffers and drops on its own thread, so the training thread's cost is what is measured).

The Hugging Face and Lightning paths are the DDP comm hook (see "Training overhead") plus one
callback call a step; they are not measured again here.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, args):
    os.environ.update(
        DS_ACCELERATOR="cpu",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import framework_harness
    import rankscope.torch as rst
    from shim_harness import TinyLM, batch, lm_loss

    deepspeed = framework_harness.import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    engines = {}
    for stage in args.stages:
        for variant in ("plain", "plain-2", "rankscope"):
            torch.manual_seed(7)
            model = TinyLM(d=args.d_model, ff=4 * args.d_model)
            engine, _, _, _ = deepspeed.initialize(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                config={
                    "train_micro_batch_size_per_gpu": 8,
                    "gradient_accumulation_steps": args.accum,
                    "zero_allow_untested_optimizer": True,
                    "zero_optimization": {"stage": stage},
                    "steps_per_print": 10**9,
                },
            )
            if variant == "rankscope":
                rst.attach(engine, collector=args.collector, job=f"bench-z{stage}", warn_after=1e9)
            engines[(stage, variant)] = engine
    params = sum(p.numel() for p in TinyLM(d=args.d_model, ff=4 * args.d_model).parameters())
    times = {k: [] for k in engines}
    keys = list(engines)
    for step in range(args.warmup + args.steps):
        order = keys[step % len(keys) :] + keys[: step % len(keys)]
        for key in order:
            engine = engines[key]
            dist.barrier()
            t0 = time.perf_counter()
            for micro in range(args.accum):
                x, y = batch(rank, step, micro, bsz=8)
                engine.backward(lm_loss(engine, x, y))
                engine.step()
            if step >= args.warmup:
                times[key].append(time.perf_counter() - t0)
    if rank == 0:
        rows = []
        for stage in args.stages:
            plain, plain2 = times[(stage, "plain")], times[(stage, "plain-2")]
            rs = times[(stage, "rankscope")]
            diff = statistics.median(b - a for a, b in zip(plain, rs))
            floor = statistics.median(b - a for a, b in zip(plain, plain2))
            rows.append(
                {
                    "stage": stage,
                    "parameters": params,
                    "accum": args.accum,
                    "plain_ms": 1e3 * statistics.median(plain),
                    "plain2_ms": 1e3 * statistics.median(plain2),
                    "noise_floor_pct": 100 * floor / statistics.median(plain),
                    "rankscope_ms": 1e3 * statistics.median(rs),
                    "paired_diff_ms": 1e3 * diff,
                    "paired_diff_pct": 100 * diff / statistics.median(plain),
                }
            )
        print(json.dumps(rows, indent=1))
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--collector", default="127.0.0.1:9")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
