#!/usr/bin/env python3
"""What rankscope costs a framework's step on the CPU, side by side with the same training without
it: DeepSpeed ZeRO 1-3, FSDP2, FSDP1, torch.compile on DDP, the Hugging Face Trainer (DDP backend),
Lightning (DDP) and Megatron-core's DDP.

    PYTHONPATH=build/python:tests/python .venv/bin/python bench/framework_overhead.py \
        [--frameworks deepspeed fsdp2 fsdp1 compile hf lightning megatron]

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

FSDP2 (``fully_shard`` of the whole TinyLM, 2 ranks): the same three variants, interleaved a
step at a time as for DeepSpeed; a step is ``--accum`` micro-batches (FSDP2 reduces each: the
rankscope variant keeps the float32 sum, ``accumulate_local_grad=True``), ``opt.step()``,
``mon.step(loss)``. FSDP1 (FULL_SHARD of the whole TinyLM), torch.compile (backend aot_eager of a
DDP TinyLM) and Megatron-core's DDP (all-reduce mode, as tests/python/test_frameworks_megatron.py
runs it on the CPU) the same way.

The Hugging Face Trainer and Lightning own their loops, so their variants cannot be interleaved a
step at a time: each variant is a fresh Trainer (same seed) training ``--steps`` steps, and the
variants run in turn for ``--rounds`` rounds (rotating order); a step's time is the wall time
between consecutive optimizer steps (the Trainer's ``on_step_end``, Lightning's
``on_train_batch_end`` at the accumulation boundary), the first ``--warmup`` of each Trainer
dropped. The paired differences pair the i-th step of each variant's runs.
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
    rows = []
    for framework in args.frameworks:
        rows += globals()[f"{framework}_rows"](rank, world, args)
    if rank == 0:
        print(json.dumps(rows, indent=1))
    dist.barrier()


def summary(framework, mode, params, args, plain, plain2, rs):
    """One row: medians and the paired median differences against plain."""
    diff = statistics.median(b - a for a, b in zip(plain, rs))
    floor = statistics.median(b - a for a, b in zip(plain, plain2))
    return {
        "framework": framework,
        "mode": mode,
        "parameters": params,
        "accum": args.accum,
        "steps": len(plain),
        "plain_ms": 1e3 * statistics.median(plain),
        "plain2_ms": 1e3 * statistics.median(plain2),
        "noise_floor_pct": 100 * floor / statistics.median(plain),
        "rankscope_ms": 1e3 * statistics.median(rs),
        "paired_diff_ms": 1e3 * diff,
        "paired_diff_pct": 100 * diff / statistics.median(plain),
    }


def interleaved(rank, args, units):
    """units: key -> step(step_index) callable; runs one step of each in a rotating order, after
    a barrier, and returns key -> step times after the warm-up."""
    times = {k: [] for k in units}
    keys = list(units)
    for step in range(args.warmup + args.steps):
        order = keys[step % len(keys) :] + keys[: step % len(keys)]
        for key in order:
            dist.barrier()
            t0 = time.perf_counter()
            units[key](step)
            if step >= args.warmup:
                times[key].append(time.perf_counter() - t0)
    return times


def _sharded_rows(rank, args, framework, mode, wrap):
    """FSDP2's and FSDP1's rows: ``wrap(TinyLM)`` three times, each micro-batch reduced (the
    rankscope variant keeps the float32 sum), the variants interleaved a step at a time."""
    import rankscope.torch as rst
    from shim_harness import TinyLM

    units = {}
    for variant in ("plain", "plain-2", "rankscope"):
        torch.manual_seed(7)
        model = wrap(TinyLM(d=args.d_model, ff=4 * args.d_model))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = None
        if variant == "rankscope":
            mon = rst.attach(
                model,
                collector=args.collector,
                job=f"bench-{framework}",
                warn_after=1e9,
                accumulate_local_grad=args.accum > 1,
            )
        units[variant] = _micro_steps(rank, args, model, opt, mon)
    times = interleaved(rank, args, units)
    return [summary(framework, mode, _tiny_params(args), args, *(times[v] for v in units))]


def fsdp2_rows(rank, world, args):
    from torch.distributed.fsdp import fully_shard

    return _sharded_rows(rank, args, "fsdp2", "FSDP", fully_shard)


def _micro_steps(rank, args, model, opt, mon, *, before=None, after=None):
    """A step of ``--accum`` micro-batches, each ``(loss / accum).backward()``, then ``after()``
    (the framework's end of the reduction, if any), ``opt.step()`` and ``mon.step``."""
    from shim_harness import batch, lm_loss

    def step(i):
        if before is not None:
            before()
        losses = []
        for micro in range(args.accum):
            x, y = batch(rank, i, micro, bsz=8)
            loss = lm_loss(model, x, y)
            (loss / args.accum).backward()
            losses.append(loss.detach())
        if after is not None:
            after()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon is not None:
            mon.step(torch.stack(losses).mean())

    return step


def fsdp1_rows(rank, world, args):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def wrap(model):
        return FSDP(model, device_id=torch.device("cpu"))

    return _sharded_rows(rank, args, "fsdp1", "FULL_SHARD", wrap)


def compile_rows(rank, world, args):
    """torch.compile (backend aot_eager: the graph capture and DDPOptimizer's bucket split without
    inductor's C++ compile) of a DDP TinyLM; DDP's C++ reducer and its comm hook stay."""
    import rankscope.torch as rst
    from shim_harness import TinyLM

    units = {}
    for variant in ("plain", "plain-2", "rankscope"):
        torch.manual_seed(7)
        ddp = torch.nn.parallel.DistributedDataParallel(TinyLM(d=args.d_model, ff=4 * args.d_model))
        model = torch.compile(ddp, backend="aot_eager")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        mon = None
        if variant == "rankscope":
            mon = rst.attach(ddp, collector=args.collector, job="bench-compile", warn_after=1e9)
        units[variant] = _micro_steps(rank, args, model, opt, mon)
    times = interleaved(rank, args, units)
    mode = "DDP, aot_eager"
    return [summary("compile", mode, _tiny_params(args), args, *(times[v] for v in units))]


def megatron_rows(rank, world, args):
    """Megatron-core DistributedDataParallel (all-reduce mode, fp32 main grads, no overlap) around
    TinyLM, on the CPU as its test runs it (framework_harness.megatron_on_cpu: last, since it
    points torch.cuda's current device and stream at the CPU for the rest of the process)."""
    import framework_harness

    framework_harness.megatron_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer import TransformerConfig

    import rankscope.torch as rst
    from shim_harness import TinyLM

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    units = {}
    for variant in ("plain", "plain-2", "rankscope"):
        torch.manual_seed(7)
        lm = TinyLM(d=args.d_model, ff=4 * args.d_model)
        model = DistributedDataParallel(
            TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1),
            DistributedDataParallelConfig(overlap_grad_reduce=False, grad_reduce_in_fp32=True),
            lm,
        )
        opt = torch.optim.SGD(lm.parameters(), lr=0.01)
        mon = None
        if variant == "rankscope":
            mon = rst.attach(model, collector=args.collector, job="bench-megatron", warn_after=1e9)

        def to_optimizer(model=model, lm=lm):
            finalize_model_grads([model])
            for p in lm.parameters():
                p.grad = p.main_grad  # the reduced gradient, as Megatron's optimizers read it

        def reset(model=model, lm=lm):
            for p in lm.parameters():
                p.grad = None  # Megatron's backward hook adds .grad into main_grad
            model.zero_grad_buffer()

        units[variant] = _micro_steps(rank, args, model, opt, mon, before=reset, after=to_optimizer)
    times = interleaved(rank, args, units)
    mode = "DDP, all-reduce"
    return [summary("megatron", mode, _tiny_params(args), args, *(times[v] for v in units))]


def _trainer_env(rank, world):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.update(NODE_RANK="0", MASTER_ADDR="127.0.0.1")


def in_rounds(args, run_one):
    """run_one(variant) -> that Trainer's step times; variants in turn for args.rounds rounds."""
    variants = ["plain", "plain-2", "rankscope"]
    times = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % 3 :] + variants[: r % 3]
        for v in order:
            dist.barrier()
            times[v] += run_one(v)[args.warmup :]
    return [times[v] for v in variants]


def _close_monitors(callbacks):
    """Close the Monitor of every rankscope callback a Trainer holds (HF and Lightning alike)."""
    for cb in callbacks:
        if getattr(cb, "_rankscope", False) and cb.monitor is not None:
            cb.monitor.close(timeout=0.1)


def _intervals(marks):
    """Step times from the clock marks taken at the first step's start and each step's end."""
    return [b - a for a, b in zip(marks, marks[1:])]


def _tiny_params(args):
    from shim_harness import TinyLM

    return sum(p.numel() for p in TinyLM(d=args.d_model, ff=4 * args.d_model).parameters())


def hf_rows(rank, world, args):
    import framework_harness
    import transformers

    import rankscope.torch as rst

    _trainer_env(rank, world)

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_begin(self, a, state, control, **kw):
            if not self.marks:
                self.marks.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            self.marks.append(time.perf_counter())

    def run_one(variant):
        torch.manual_seed(7)
        model = framework_harness.LMForTrainer(d=args.d_model, ff=4 * args.d_model)
        targs = framework_harness.trainer_arguments(
            f"/tmp/rs-bench-hf{rank}", args.accum, args.warmup + args.steps
        )
        targs.per_device_train_batch_size = 8
        data = framework_harness.TokenData(
            n=8 * args.accum * world * (args.warmup + args.steps + 1)
        )
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=data)
        if variant == "rankscope":
            rst.attach(trainer, collector=args.collector, job="bench-hf", warn_after=1e9)
        clock = Clock()
        trainer.add_callback(clock)
        trainer.train()
        _close_monitors(trainer.callback_handler.callbacks)
        return _intervals(clock.marks)

    params = _tiny_params(args)
    return [summary("hf", "Trainer, DDP backend", params, args, *in_rounds(args, run_one))]


def lightning_rows(rank, world, args):
    import framework_harness
    import lightning.pytorch as pl

    import rankscope.torch as rst
    from shim_harness import TinyLM, lm_loss

    _trainer_env(rank, world)
    os.environ["MASTER_PORT"] = "1"  # unused: the process group exists already

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(7)
            self.lm = TinyLM(d=args.d_model, ff=4 * args.d_model)
            self.marks = []

        def training_step(self, batch_, batch_idx):
            if not self.marks:
                self.marks.append(time.perf_counter())
            return lm_loss(self.lm, batch_["input_ids"], batch_["labels"])

        def on_train_batch_end(self, outputs, batch_, batch_idx):
            if (batch_idx + 1) % args.accum == 0:
                self.marks.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.SGD(self.lm.parameters(), lr=0.01)

    def run_one(variant):
        module = Module()
        if variant == "rankscope":
            rst.attach(module, collector=args.collector, job="bench-pl", warn_after=1e9)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy="ddp",
            max_steps=args.warmup + args.steps,
            accumulate_grad_batches=args.accum,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        n = 8 * args.accum * world * (args.warmup + args.steps + 1)
        data = framework_harness.TokenData(n=n)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
        _close_monitors(trainer.callbacks)
        return _intervals(module.marks)

    params = _tiny_params(args)
    return [summary("lightning", "DDP strategy", params, args, *in_rounds(args, run_one))]


def deepspeed_rows(rank, world, args):
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
    params = _tiny_params(args)

    def unit(engine):
        def step(i):
            for micro in range(args.accum):
                x, y = batch(rank, i, micro, bsz=8)
                engine.backward(lm_loss(engine, x, y))
                engine.step()

        return step

    times = interleaved(rank, args, {k: unit(e) for k, e in engines.items()})
    rows = []
    for stage in args.stages:
        t = [times[(stage, v)] for v in ("plain", "plain-2", "rankscope")]
        rows.append(summary("deepspeed", f"ZeRO-{stage}", params, args, *t))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--frameworks",
        nargs="+",
        default=["deepspeed", "fsdp2", "fsdp1", "compile", "hf", "lightning", "megatron"],
        choices=["deepspeed", "fsdp2", "fsdp1", "compile", "hf", "lightning", "megatron"],
        help="in this order: megatron is best last (it repoints torch.cuda for the process)",
    )
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument(
        "--rounds", type=int, default=2, help="Trainer runs of each variant (hf, lightning)"
    )
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
