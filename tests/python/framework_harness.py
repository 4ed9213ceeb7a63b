"""Workers for the framework tests (tests/python/test_frameworks_*.py), run by
shim_harness.spawn in fresh gloo processes on the CPU.

Each worker trains a tiny model through the framework with rankscope attached the way a user
would, and computes next to it the exact truth: each rank's local loss and full local gradient of
the step from a reference replica (same weights, same micro-batches, no framework), all-gathered
to rank 0 (a collective the test pays).
"""

import contextlib
import copy
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import shim_harness
from shim_harness import TinyLM, batch, exact_step_stats, flat_grad, lm_loss, write_json


def gather_truth(rank, world_size, loss, grad, sketch_dim):
    """exact_step_stats on rank 0 from every rank's (loss, flat local gradient); None elsewhere."""
    from rankscope import DEFAULT_SKETCH_SEED

    grads = [torch.zeros_like(grad) for _ in range(world_size)]
    dist.all_gather(grads, grad)
    losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(losses, loss.double().reshape(1))
    if rank != 0:
        return None
    return exact_step_stats([float(v) for v in losses], grads, sketch_dim, DEFAULT_SKETCH_SEED)


def truth_callback(rank, world_size, truth, ref, sketch_dim):
    """A Trainer callback that, at each optimizer step, gathers the ranks' exact values of the
    step (the mean of ``truth["losses"]``, the reference model's local gradient) into rank 0's
    ``truth["expected"][global_step]`` and empties ``truth["losses"]``."""
    import transformers

    class Truth(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            loss = torch.stack(truth["losses"]).mean()
            truth["losses"] = []
            e = gather_truth(rank, world_size, loss, flat_grad(ref), sketch_dim)
            if rank == 0:
                truth["expected"][state.global_step] = e

    return Truth()


def reference_step(ref, rank, step, accumulation, bsz=4):
    """(mean micro-batch loss, flat local gradient of the step): the sum over micro-batches of
    the gradients of loss / accumulation, as DeepSpeed, Hugging Face and Lightning scale it."""
    ref.zero_grad(set_to_none=True)
    losses = []
    for micro in range(accumulation):
        x, y = batch(rank, step, micro, bsz=bsz)
        loss = lm_loss(ref, x, y)
        (loss / accumulation).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean(), flat_grad(ref)


# ---- DeepSpeed ---------------------------------------------------------------------------------

# name -> (ZeRO stage, gradient accumulation steps)
DEEPSPEED_SCENARIOS = {
    "zero0": (0, 1),
    "zero1-accum": (1, 2),
    "zero2-accum": (2, 3),
    "zero3-accum": (3, 2),
    # The Hugging Face Trainer on accelerate's DeepSpeed backend (rankscope.torch.attach(trainer)).
    "hf-zero2-accum": (2, 2),
    # The zero-code launch (rankscope.auto.install) attaches the engine when it is built; runs
    # last (every engine built after it is attached).
    "auto-zero2-accum": (2, 2),
}

# The aggregation check on ZeRO-0 (rankscope.frameworks.deepspeed): in this scenario the reduced
# gradient of this step is perturbed by this fraction of its norm on every rank, after DeepSpeed's
# all-reduce (the same wrong sum everywhere); the truth checks read the local gradients only.
DEEPSPEED_CORRUPT = ("zero0", 1, 2e-4)


def corrupt_allreduce(engine, step: int, relative: float) -> None:
    """Wraps the engine's ``allreduce_bucket`` (ZeRO-0's reduction; its result is copied back
    into the gradients) to add noise of ``relative`` times the reduced bucket's norm, the same on
    every rank, at the optimizer step ``step``."""
    original = engine.allreduce_bucket

    def allreduce_bucket(bucket, dp_group, dp_world_size=None):
        out = original(bucket, dp_group, dp_world_size)
        if engine.global_steps == step:
            g = torch.Generator().manual_seed(1000 * step + out.numel())
            noise = torch.randn(out.numel(), generator=g, dtype=torch.float64)
            scale = relative * out.double().norm() / noise.norm()
            out.add_((noise * scale).to(out.dtype).view_as(out))
        return out

    engine.allreduce_bucket = allreduce_bucket


def import_deepspeed():
    """deepspeed on its CPU accelerator, without the shared-memory all-reduce op that it would
    compile with a C++ compiler at start-up (minutes; gloo does the collectives)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def full_state(engine, stage):
    """The engine's full parameters (ZeRO-3 gathers its shards) as a state dict copy."""
    deepspeed = sys.modules["deepspeed"]
    if stage < 3:
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def deepspeed_worker(rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, names):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    auto = [n for n in names if n.startswith("auto-")]
    for name in [n for n in names if n not in auto]:
        if name.startswith("hf-"):
            _huggingface_deepspeed(
                rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, name
            )
            continue
        _deepspeed_scenario(
            rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, name
        )
    refusal(rank, out_dir)
    for name in auto:
        import rankscope.auto

        options = {"collector": collector, "sketch_dim": sketch_dim}
        rankscope.auto.install(f"{job_prefix}-{name}", dormant=False, options=options)
        _deepspeed_scenario(
            rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, name
        )


def _deepspeed_scenario(rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, name):
    deepspeed = sys.modules["deepspeed"]
    import rankscope.torch as rst

    out_dir = Path(out_dir)
    stage, accumulation = DEEPSPEED_SCENARIOS[name]
    torch.manual_seed(7)
    model = TinyLM()
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), config=config
    )
    job = f"{job_prefix}-{name}"
    if name.startswith("auto-"):  # attached when built; attach again is a no-op
        mon = engine._rankscope_monitor
        assert rst.attach(engine, collector=collector, job="other") is mon
    else:
        mon = rst.attach(engine, collector=collector, job=job, sketch_dim=sketch_dim)
    assert mon is not None and mon.framework.endswith(f"zero-{stage}"), mon
    if name == DEEPSPEED_CORRUPT[0]:
        corrupt_allreduce(engine, *DEEPSPEED_CORRUPT[1:])
    expected = {}
    for step in range(steps):
        ref.load_state_dict(full_state(engine, stage))
        ref_loss, g = reference_step(ref, rank, step, accumulation)
        for micro in range(accumulation):
            x, y = batch(rank, step, micro)
            loss = lm_loss(engine, x, y)
            engine.backward(loss)
            engine.step()
        e = gather_truth(rank, world_size, ref_loss, g, sketch_dim)
        if rank == 0:
            expected[step] = e
    stats = mon.close(timeout=30)
    write_json(out_dir / f"{name}.rank{rank}.json", {"stats": stats})
    if rank == 0:
        write_json(out_dir / f"{name}.expected.json", expected)
    dist.barrier()


def _huggingface_deepspeed(
    rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, name
):
    """A Hugging Face Trainer with ``deepspeed=`` (accelerate builds the engine in ``train()``;
    accelerate enables it without ``use_cpu``, on DeepSpeed's CPU accelerator here), attached
    with rankscope.torch.attach(trainer); the truth comes from the micro-batches the Trainer fed
    this rank, as in huggingface_worker."""
    import transformers

    import rankscope.torch as rst

    stage, accum = DEEPSPEED_SCENARIOS[name]
    job = f"{job_prefix}-{name}"
    torch.manual_seed(7)
    model = LMForTrainer()
    ref = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    args = trainer_arguments(Path(out_dir) / f"hfds{rank}", accum, steps, deepspeed=config)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData())
    cb = rst.attach(trainer, collector=collector, job=job, sketch_dim=sketch_dim)
    truth = {"losses": [], "expected": {}}
    original = trainer.training_step

    def training_step(model_, inputs, *a, **kw):
        if not truth["losses"]:  # the step's first micro-batch: weights before its update
            ref.load_state_dict(full_state(trainer.model_wrapped, stage))  # the engine
            ref.zero_grad(set_to_none=True)
        loss = lm_loss(ref.lm, inputs["input_ids"], inputs["labels"])
        (loss / accum).backward()
        truth["losses"].append(loss.detach())
        return original(model_, inputs, *a, **kw)

    trainer.training_step = training_step

    trainer.add_callback(truth_callback(rank, world_size, truth, ref, sketch_dim))
    trainer.train()
    mon = cb.monitor
    assert mon.framework.startswith(f"transformers {transformers.__version__} deepspeed"), mon
    write_json(Path(out_dir) / f"{name}.rank{rank}.json", {"stats": mon.close(timeout=30)})
    if rank == 0:
        write_json(Path(out_dir) / f"{name}.expected.json", truth["expected"])
    dist.barrier()


def refusal(rank, out_dir):
    """A DeepSpeed version outside SUPPORTED is refused with one warning naming it, before
    anything is hooked, and the engine trains on."""
    deepspeed = sys.modules["deepspeed"]
    import rankscope.torch as rst

    torch.manual_seed(7)
    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10**9,
        },
    )
    deepspeed.__version__, real = "0.99.0", deepspeed.__version__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = rst.attach(engine, collector="127.0.0.1:1", job="refused")
    deepspeed.__version__ = real
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    x, y = batch(rank, 0)
    loss = lm_loss(engine, x, y)
    engine.backward(loss)
    engine.step()
    from rankscope.frameworks._local_grads import Unwatched

    write_json(
        Path(out_dir) / f"refusal.rank{rank}.json",
        {
            "monitor": not isinstance(mon, Unwatched),
            "messages": messages,
            "steps": int(engine.global_steps),
        },
    )


__all__ = [
    "DEEPSPEED_SCENARIOS",
    "deepspeed_worker",
    "gather_truth",
    "reference_step",
    "shim_harness",
]


# ---- Hugging Face Trainer ----------------------------------------------------------------------


class LMForTrainer(torch.nn.Module):
    """TinyLM with the Trainer's calling convention: keyword inputs, a dict with the loss."""

    def __init__(self, **tiny_lm_options):
        super().__init__()
        self.lm = TinyLM(**tiny_lm_options)

    def forward(self, input_ids, labels):
        return {"loss": lm_loss(self.lm, input_ids, labels)}


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n=64, ctx=16):
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, shim_harness.VOCAB, (n, ctx + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i, :-1], "labels": self.data[i, 1:]}


def huggingface_worker(
    rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, accum, modes
):
    """Trainers on accelerate's DDP backend and its FSDP2 backend (gloo, CPU), one per mode in
    ``modes`` (job ``<prefix>-<mode>``): ``explicit`` / ``fsdp-explicit`` attached with
    rankscope.torch.attach(trainer), ``auto`` / ``fsdp-auto`` by the zero-code launch
    (``rankscope.auto.install``; it attaches every Trainer built after it, so the auto modes come
    last); the truth comes from the micro-batches each Trainer fed this
    rank."""
    import transformers

    import rankscope.auto
    import rankscope.torch as rst
    from rankscope import _autoattach

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # unused: the process group exists already
    )
    for mode in modes:
        job = f"{job_prefix}-{mode}"
        fsdp = mode.startswith("fsdp-")
        torch.manual_seed(7)
        model = LMForTrainer()
        ref = copy.deepcopy(model.lm)
        args = trainer_arguments(Path(out_dir) / f"hf{rank}", accum, steps, fsdp=fsdp)
        if mode.endswith("auto"):
            options = {"collector": collector, "sketch_dim": sketch_dim}
            attacher = rankscope.auto.install(job, dormant=False, options=options)
            # install is once a process (the first job stays): a second auto mode renames the
            # job, as a fresh process launched with that job would have it.
            attacher.job = job
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData())
        if fsdp:
            fsdp_on_cpu(trainer)
        if mode.endswith("explicit"):
            rst.attach(trainer, collector=collector, job=job, sketch_dim=sketch_dim)
        (cb,) = [c for c in trainer.callback_handler.callbacks if getattr(c, "_rankscope", 0)]

        truth = {"losses": [], "expected": {}}
        original = trainer.training_step

        def training_step(model_, inputs, *a, _truth=truth, _ref=ref, _original=original, **kw):
            if not _truth["losses"]:  # the step's first micro-batch: weights before its update
                _ref.load_state_dict(trainer_lm_state(model_))
                _ref.zero_grad(set_to_none=True)
            loss = lm_loss(_ref, inputs["input_ids"], inputs["labels"])
            (loss / accum).backward()
            _truth["losses"].append(loss.detach())
            return _original(model_, inputs, *a, **kw)

        trainer.training_step = training_step

        trainer.add_callback(truth_callback(rank, world_size, truth, ref, sketch_dim))
        trainer.train()
        attacher = _autoattach.current()
        info = {
            "stats": cb.monitor.close(timeout=30),
            "framework": cb.monitor.framework,
            "model": type(trainer.model_wrapped).__name__,
            # The DDP model the Trainer built was left to the Trainer's callback.
            "ddp_attachments": 0 if attacher is None else len(attacher.models),
        }
        write_json(Path(out_dir) / f"{mode}.rank{rank}.json", info)
        if rank == 0:
            write_json(Path(out_dir) / f"{mode}.expected.json", truth["expected"])
        dist.barrier()


def fsdp_on_cpu(trainer) -> None:
    """Lets accelerate build its FSDP2 model on the CPU: accelerate 1.15 enables FSDP only for
    accelerator distributed types (AcceleratorState sets DistributedType.FSDP for MULTI_GPU and
    the like, never MULTI_CPU) and otherwise silently trains DDP. This sets the state the Trainer
    made to what it is on a GPU machine (FSDP, with the Trainer's own FSDP plugin arguments);
    everything after (accelerate's fully_shard of the model, the Trainer's loop) is theirs."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def trainer_lm_state(model):
    """The full TinyLM weights of the model a Trainer trains (DDP's module, or FSDP2's sharded
    DTensors gathered: a collective every rank runs at the same point)."""
    lm = model.module.lm if hasattr(model, "module") else model.lm
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in lm.state_dict().items()
    }


# ---- Lightning ---------------------------------------------------------------------------------


def lightning_worker(rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, accum):
    """Lightning Trainers with the DDP strategy on the CPU (the process group exists: Lightning
    sees LOCAL_RANK and creates no processes): one attached with
    rankscope.torch.attach(lightning_module) (job ``<prefix>-explicit``), then one attached by the
    zero-code launch (``rankscope.auto.install``; job ``<prefix>-auto``); the truth comes from the
    micro-batches Lightning fed this rank."""
    import lightning.pytorch as pl

    import rankscope.auto
    import rankscope.torch as rst

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # unused: the process group exists already
    )

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(7)
            self.lm = TinyLM()
            self.ref = None
            self.truth = {"losses": [], "expected": {}}

        def training_step(self, batch_, batch_idx):
            x, y = batch_["input_ids"], batch_["labels"]
            truth = self.truth
            if not truth["losses"]:  # the step's first micro-batch: weights before its update
                self.ref = copy.deepcopy(self.lm)
                self.ref.zero_grad(set_to_none=True)
            with torch.enable_grad():
                ref_loss = lm_loss(self.ref, x, y)
                (ref_loss / accum).backward()
            truth["losses"].append(ref_loss.detach())
            return lm_loss(self.lm, x, y)

        def on_train_batch_end(self, outputs, batch_, batch_idx):
            truth = self.truth
            if len(truth["losses"]) < accum:
                return
            loss = torch.stack(truth["losses"]).mean()
            truth["losses"] = []
            e = gather_truth(rank, world_size, loss, flat_grad(self.ref), sketch_dim)
            if rank == 0:
                truth["expected"][self.trainer.global_step - 1] = e

        def configure_optimizers(self):
            return torch.optim.SGD(self.lm.parameters(), lr=0.05)

    for mode in ("explicit", "auto"):
        job = f"{job_prefix}-{mode}"
        module = Module()
        if mode == "explicit":
            rst.attach(module, collector=collector, job=job, sketch_dim=sketch_dim)
        else:
            options = {"collector": collector, "sketch_dim": sketch_dim}
            rankscope.auto.install(job, dormant=False, options=options)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy="ddp",
            max_steps=steps,
            accumulate_grad_batches=accum,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        loader = torch.utils.data.DataLoader(TokenData(), batch_size=4, shuffle=True)
        trainer.fit(module, loader)
        (cb,) = [c for c in trainer.callbacks if getattr(c, "_rankscope", False)]
        stats = cb.monitor.close(timeout=30)
        write_json(Path(out_dir) / f"{mode}.rank{rank}.json", {"stats": stats})
        if rank == 0:
            write_json(Path(out_dir) / f"{mode}.expected.json", module.truth["expected"])
        dist.barrier()


# ---- checks the framework test files share (run in the pytest process) -----------------------


def load(path):
    return json.loads(Path(path).read_text())


def check_framework_job(collector, out, job, prefix, world, steps, sketch_dim, zero_counters=()):
    """Holds job ``job`` to the exact truth the workers wrote (``<prefix>.expected.json``; the
    DDP truth tests' shim_harness.check_exact_rows) and each rank's counters
    (``<prefix>.rank<R>.json``: every step recorded and acked, no hook error, no backward
    restart, and 0 for each name in ``zero_counters``). Returns (the ranks' json dicts, the
    rows (step, rank, reduced_grad_fingerprint, param_fingerprint) ordered by step, rank)."""
    expected = {int(k): v for k, v in load(Path(out) / f"{prefix}.expected.json").items()}
    assert sorted(expected) == list(range(steps))
    rows = collector.step_rows(job)
    rank_rows = collector.rank_rows(job)
    assert len(rank_rows) == world * steps
    shim_harness.check_exact_rows(rows, rank_rows, expected, world, sketch_dim)
    infos = []
    for rank in range(world):
        info = load(Path(out) / f"{prefix}.rank{rank}.json")
        stats = info["stats"]
        assert stats["recorded"] == steps and stats["acked"] == steps, stats
        for name in ("shim_hook_errors", "shim_backward_restarts", *zero_counters):
            assert stats.get(name, 0) == 0, (name, stats)
        infos.append(info)
    fps = collector.query(
        "SELECT step, rank, reduced_grad_fingerprint, param_fingerprint FROM rank_steps "
        "WHERE job = ? ORDER BY step, rank",
        (job,),
    )
    return infos, fps


def check_ddp_replicas(fps, steps) -> None:
    """Replicas of a DDP-backed framework: one reduced-gradient fingerprint per step, and one
    parameter fingerprint on the first step."""
    for step in range(steps):
        grad = {r[2] for r in fps if r[0] == step}
        assert len(grad) == 1 and None not in grad, fps
    first = {r[3] for r in fps if r[0] == 0}
    assert len(first) == 1 and None not in first, fps


def trainer_arguments(
    output_dir, accum: int, max_steps: int, fsdp: bool = False, deepspeed=None, optim="sgd"
):
    """The Hugging Face TrainingArguments of the framework tests: gloo DDP on the CPU (or
    accelerate's FSDP2, ``fsdp``: one fully_shard of the whole model, see fsdp_on_cpu), plain SGD
    at a constant rate, no clipping, nothing logged or saved (so the reference replica's steps
    are the Trainer's own). ``deepspeed``: accelerate's DeepSpeed backend with that config
    (accelerate enables it only without ``use_cpu``). ``optim``: the Trainer's optimizer name
    (``adamw_torch`` for an optimizer that counts its steps)."""
    import transformers

    extra = {"use_cpu": True}
    if fsdp:
        extra["fsdp"] = True
        extra["fsdp_config"] = {"fsdp_version": 2, "reshard_after_forward": True}
    if deepspeed is not None:
        extra = {"deepspeed": deepspeed}
    return transformers.TrainingArguments(
        **extra,
        output_dir=str(output_dir),
        ddp_backend="gloo",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accum,
        max_steps=max_steps,
        learning_rate=0.05,
        optim=optim,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


# ---- Megatron-core DDP -------------------------------------------------------------------------


class _NoStream:
    """What megatron-core 0.19's gradient sync asks of torch.cuda.current_stream() (it waits on
    CUDA-graph events that CPU parameters never carry): nothing to wait for on the CPU."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def megatron_on_cpu() -> None:
    """Lets megatron-core's DDP run on the CPU in this (test rank) process: it allocates its
    parameter and gradient buffers on ``torch.cuda.current_device()`` and ``start_grad_sync``
    reads ``torch.cuda.current_stream()`` unconditionally. Both are pointed at the CPU; every
    other line (buckets, main_grad views, scaling, the gloo collectives, finalize_model_grads) is
    Megatron's own, the overlapped path (overlap_grad_reduce: asynchronous gloo collectives from
    the backward hooks, waited on in finish_grad_sync) included: it uses a CUDA stream only with
    several distributed-optimizer instances, which rankscope refuses."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _NoStream()


# name -> (micro-batches a step, refuse by version, use_distributed_optimizer, overlap_grad_reduce)
MEGATRON_SCENARIOS = {
    "allreduce-accum": (2, False, False, False),
    # Buckets of about 200 elements: several bucket groups, each reduced asynchronously from
    # Megatron's backward hooks as it becomes ready on the last micro-batch (the first runs under
    # model.no_sync()); finish_grad_sync waits.
    "overlap-accum": (2, False, False, True),
    # Reduce-scatter into each rank's shard of the buffer. Megatron's DistributedOptimizer is not
    # built here: the parameters are not updated (the truth reloads them every step anyway).
    "distopt-accum": (2, False, True, False),
    "refused": (1, True, False, False),
}

# The zero-code launch (rankscope.auto.install) with Megatron's mixed-precision optimizers: bf16
# parameters and gradient buffers, get_megatron_optimizer(bf16=True); name -> (its
# use_distributed_optimizer, the optimizer's loss_scale). Run after the scenarios above, in the
# same processes (every model built after install is attached).
MEGATRON_AUTO_SCENARIOS = {
    "auto-bf16": (False, None),  # Float16OptimizerWithFloat16Params
    "auto-bf16-distopt": (True, None),  # DistributedOptimizer: shards of the main parameters
    "auto-bf16-scaled": (False, 1024.0),  # a constant loss scale: refused
    # float32 parameters: DistributedOptimizer steps shard views of them (no main parameters):
    # not found, refused.
    "auto-fp32-distopt": (True, None),
}


def megatron_optimizers_on_cpu() -> None:
    """Lets megatron-core 0.19's Float16OptimizerWithFloat16Params and DistributedOptimizer be
    built and step on the CPU in this (test rank) process: they accept only parameters whose
    ``Tensor.type()`` is ``torch.cuda.{Half,BFloat16,Float}Tensor`` and make a few scalars with
    ``torch.tensor(..., device="cuda")`` / ``torch.zeros(..., device="cuda")`` (the unit scale,
    the grad norm's accumulator). ``type()`` without arguments names CPU tensors as CUDA ones and
    those two factories put ``"cuda"`` tensors on the CPU; every other line (main parameters,
    gradient copies, Adam, the shard all-gather) is Megatron's own."""
    real_type, real_tensor, real_zeros = torch.Tensor.type, torch.tensor, torch.zeros

    def type_(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if args or kwargs or not name.startswith("torch.") or name.startswith("torch.cuda."):
            return name
        return "torch.cuda." + name[len("torch.") :]

    def on_cpu(factory):
        def make(*args, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    torch.Tensor.type = type_
    torch.tensor = on_cpu(real_tensor)
    torch.zeros = on_cpu(real_zeros)


# The aggregation check in all-reduce mode (rankscope.frameworks.megatron): in this scenario the
# reduced gradient of this step is perturbed by this fraction of its norm on every rank, after
# Megatron's all-reduce (the same wrong mean everywhere); the truth checks read the local
# gradients only.
def check_corrupted_sum(rows, scenario, corrupt) -> None:
    """The aggregation check's rows (step, ratio, relative error, fault, suspect) of a job whose
    every step was checked: the step ``corrupt`` = (scenario, step, relative size) perturbed the
    same on every rank after the reduction is flagged as a wrong sum, its size measured within
    half, no rank named; every other step is clean."""
    name, bad_step, relative = corrupt
    for step, ratio, rel, fault, suspect in rows:
        assert ratio is not None, f"step {step} not checked: {rows}"
        if scenario == name and step == bad_step:
            assert fault == "sum" and suspect is None, rows
            assert ratio > 1.0 and abs(rel - relative) < 0.5 * relative, rows
        else:
            assert fault == "" and ratio <= 1.0, rows


MEGATRON_CORRUPT = ("allreduce-accum", 1, 2e-4)


def corrupt_finish_grad_sync(model, current: dict, step: int, relative: float) -> None:
    """Wraps each bucket group's ``finish_grad_sync`` (after it, the bucket's grad_data holds the
    all-reduced gradient) to add noise of ``relative`` times each parameter's reduced gradient
    norm, the same on every rank, when ``current["step"] == step``."""
    for group in model.bucket_groups:
        original = group.finish_grad_sync

        def finish_grad_sync(*args, group=group, original=original, **kwargs):
            out = original(*args, **kwargs)
            if current["step"] == step:
                for p in (p for b in group.buckets for p in b.params_list):
                    g = torch.Generator().manual_seed(1000 * step + p.numel())
                    noise = torch.randn(p.numel(), generator=g, dtype=torch.float64)
                    scale = relative * p.main_grad.double().norm() / noise.norm()
                    p.main_grad.add_((noise * scale).to(p.main_grad.dtype).view_as(p.main_grad))
            return out

        group.finish_grad_sync = finish_grad_sync


def _megatron_refusals(model, job):
    """``rst.attach`` of ``model`` under a megatron-core version outside the tested ones, and of
    an fp16 model (Megatron's buffers hold loss-scaled gradients; never trained here): each must
    return the Unwatched stand-in. Returns (the first's stand-in, the RuntimeWarnings' texts)."""
    from megatron.core import package_info
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    import rankscope.torch as rst
    from rankscope.frameworks._local_grads import Unwatched

    real = package_info.__version__
    package_info.__version__ = "0.99.0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = rst.attach(model, collector="127.0.0.1:1", job=job)
    package_info.__version__ = real
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert isinstance(mon, Unwatched), mon
    fp16 = DistributedDataParallel(
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, fp16=True),
        DistributedDataParallelConfig(),
        TinyLM(),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused_fp16 = rst.attach(fp16, collector="127.0.0.1:1", job=f"{job}-fp16")
    assert isinstance(refused_fp16, Unwatched), refused_fp16
    messages += [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return mon, messages


# Long: one rank's run of every Megatron scenario against its reference replica, step by step;
# the overlap, the corrupted reduction and the refusals act at their places in that loop.
def megatron_worker(rank, world_size, collector, job_prefix, out_dir, steps, sketch_dim, names):
    """Megatron-core DistributedDataParallel (MEGATRON_SCENARIOS: all-reduce or reduce-scatter,
    overlapped or not; grad_reduce_in_fp32; without overlap_grad_reduce Megatron makes one
    bucket) training TinyLM, attached with rankscope.torch.attach(model); the step's loss is the
    mean of its micro-batch losses, each backpropagated as loss / micro-batches (Megatron's
    schedules' scaling), and finalize_model_grads ends the reduction."""
    megatron_on_cpu()
    from megatron.core import package_info, parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer import TransformerConfig

    import rankscope.torch as rst

    parallel_state.initialize_model_parallel()
    for name in [n for n in names if n in MEGATRON_SCENARIOS]:
        accumulation, refused, distopt, overlap = MEGATRON_SCENARIOS[name]
        torch.manual_seed(7)
        lm = TinyLM()
        ref = copy.deepcopy(lm)
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=overlap,
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=distopt,
            bucket_size=200 if overlap else None,
        )
        model = DistributedDataParallel(config, ddp_config, lm)
        if overlap:
            assert len(model.bucket_groups) > 1, model.bucket_groups
        opt = torch.optim.SGD(lm.parameters(), lr=0.05)
        job = f"{job_prefix}-{name}"
        current = {"step": -1}
        if name == MEGATRON_CORRUPT[0]:
            corrupt_finish_grad_sync(model, current, *MEGATRON_CORRUPT[1:])
        messages = []
        if refused:
            mon, messages = _megatron_refusals(model, job)
        else:
            mon = rst.attach(model, collector=collector, job=job, sketch_dim=sketch_dim)
            assert mon.framework == f"megatron-core {package_info.__version__} ddp", mon
        expected = {}
        for step in range(steps):
            ref.load_state_dict(lm.state_dict())
            ref_loss, g = reference_step(ref, rank, step, accumulation)
            current["step"] = step
            model.zero_grad_buffer()
            losses = []
            for micro in range(accumulation):
                x, y = batch(rank, step, micro)
                last = micro == accumulation - 1
                with contextlib.nullcontext() if last or not overlap else model.no_sync():
                    loss = lm_loss(model, x, y)
                    (loss / accumulation).backward()
                losses.append(loss.detach())
            if overlap and step > 0:  # issued from backward, one bucket group at a time
                assert all(g.grad_reduce_handle is not None for g in model.bucket_groups)
            finalize_model_grads([model])
            if not distopt:
                for p in lm.parameters():
                    p.grad = p.main_grad  # the reduced gradient (Megatron's optimizers read it)
                opt.step()
            for p in lm.parameters():
                p.grad = None  # Megatron's backward hook adds .grad into main_grad
            mon.step(torch.stack(losses).mean())
            e = gather_truth(rank, world_size, ref_loss, g, sketch_dim)
            if rank == 0:
                expected[step] = e
        info = {
            "stats": mon.close(timeout=30),
            "messages": messages,
            "integrity_unsupported": getattr(mon, "integrity_unsupported", None),
        }
        write_json(Path(out_dir) / f"{name}.rank{rank}.json", info)
        if rank == 0:
            write_json(Path(out_dir) / f"{name}.expected.json", expected)
        dist.barrier()
    auto = [n for n in names if n in MEGATRON_AUTO_SCENARIOS]
    if auto:
        megatron_optimizers_on_cpu()
        _megatron_scaled_attach(rank, collector, job_prefix, out_dir)
    for name in auto:
        _megatron_auto_scenario(rank, world_size, collector, job_prefix, out_dir, steps, name)


def _megatron_bf16(distopt: bool, loss_scale, bf16: bool = True):
    """(TinyLM in bf16, its Megatron DDP model, Megatron's optimizer of it: Adam, bf16), or all
    in float32 when not ``bf16``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(7)
    lm = TinyLM().to(torch.bfloat16 if bf16 else torch.float32)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=bf16)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, use_distributed_optimizer=distopt
    )
    model = DistributedDataParallel(config, ddp_config, lm)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=0.01,
            bf16=bf16,
            loss_scale=loss_scale,
            use_distributed_optimizer=distopt,
        ),
        [model],
    )
    return lm, model, opt


def _megatron_scaled_attach(rank, collector, job_prefix, out_dir):
    """rst.attach(model) on a bf16 model whose Megatron optimizer has a loss scale: refused at
    its first reduction (one warning), two steps trained, nothing reported."""
    from megatron.core.distributed import finalize_model_grads

    import rankscope.torch as rst

    _, model, opt = _megatron_bf16(False, 1024.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = rst.attach(model, collector=collector, job=f"{job_prefix}-scaled-attach")
        for step in range(2):
            model.zero_grad_buffer()
            opt.zero_grad()
            x, y = batch(rank, step, 0)
            opt.scale_loss(lm_loss(model, x, y)).backward()  # Megatron's schedules' scaling
            finalize_model_grads([model])
            opt.step()
            mon.step()
    info = {
        "stats": mon.close(timeout=30),
        "messages": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }
    write_json(Path(out_dir) / f"scaled-attach.rank{rank}.json", info)
    dist.barrier()


def _bf16_reference_step(ref, rank, step, accumulation):
    """reference_step through torch.autograd.grad (the zero-code launch records every
    ``.backward`` of the process as the step's loss): the micro-batches' gradients of loss /
    accumulation added in the parameters' dtype in micro-batch order, as Megatron's buffer adds
    each ``.grad`` into ``main_grad``."""
    params = [p for p in ref.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    losses = []
    for micro in range(accumulation):
        x, y = batch(rank, step, micro)
        loss = lm_loss(ref, x, y)
        for t, g in zip(total, torch.autograd.grad(loss / accumulation, params)):
            t.add_(g)
        losses.append(loss.detach())
    return torch.stack(losses).mean(), torch.cat([t.reshape(-1).double() for t in total])


def _megatron_auto_scenario(rank, world_size, collector, job_prefix, out_dir, steps, name):
    """One model of bf16 parameters under the zero-code launch, stepped by Megatron's
    mixed-precision optimizer (MEGATRON_AUTO_SCENARIOS); the truth from a bf16 reference
    replica, whose autograd accumulates the micro-batches' gradients in bf16 as Megatron's
    buffers do. Writes the attachment's stats, state and step boundary."""
    from megatron.core.distributed import finalize_model_grads

    import rankscope.auto

    distopt, loss_scale = MEGATRON_AUTO_SCENARIOS[name]
    job = f"{job_prefix}-{name}"
    options = {"collector": collector, "sketch_dim": 256}
    attacher = rankscope.auto.install(job, dormant=False, options=options)
    attacher.job = job  # install is once a process: later scenarios rename the job
    accumulation = 2
    lm, model, opt = _megatron_bf16(distopt, loss_scale, bf16=not name.startswith("auto-fp32"))
    ref = copy.deepcopy(lm)
    expected = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            ref.load_state_dict(lm.state_dict())
            ref_loss, g = _bf16_reference_step(ref, rank, step, accumulation)
            model.zero_grad_buffer()
            opt.zero_grad()
            for micro in range(accumulation):
                x, y = batch(rank, step, micro)
                loss = lm_loss(model, x, y)
                (loss / accumulation).backward()
            finalize_model_grads([model])
            opt.step()
            e = gather_truth(rank, world_size, ref_loss, g, 256)
            if rank == 0:
                expected[step] = e
    (attachment,) = [m for m in attacher.models if m._model() is model]
    info = {
        "state": attachment.state,
        "error": attachment.error,
        "group": attachment.group,
        "step_boundary": getattr(attachment, "step_boundary", None),
        "messages": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "stats": attachment.monitor.close(timeout=30) if attachment.monitor else None,
    }
    write_json(Path(out_dir) / f"{name}.rank{rank}.json", info)
    if rank == 0:
        write_json(Path(out_dir) / f"{name}.expected.json", expected)
    dist.barrier()
