"""Aggregation integrity end to end (docs/DESIGN.md "Aggregation integrity"): real DDP on 4 gloo
ranks through the shim, a real collector. A user's comm hook, chained by rankscope, injects
faults into the all-reduce on chosen steps: (a) a perturbation of 2e-4 of the reduced bucket's
norm added on every rank after the reduction (the same wrong sum everywhere: replica fingerprints
agree, only the aggregation check can see it), (b) one rank's contribution dropped (its bucket
zeroed before the reduction), (c) one rank's contribution doubled. Every other step is clean, in
float32, bfloat16 and float16 gradients and every sketch encoding, and must raise nothing.

The ``torchpath-`` jobs take the device path on the CPU (``Monitor._bypass_native``: the torch-op
DeviceSketch for the local and the reduced sketch, read back through rankscope._deferred, as a
GPU's are), with the same faults and the same verdicts.

The ``fsdp2-`` jobs (same ranks, after the DDP ones) are FSDP2 pure data parallelism, where the
check reads every parameter's reduced ``.grad`` at the end of the step's last reducing backward
(rankscope.frameworks.fsdp2): ``replicate`` (torch's replicate_with_fsdp) reducing both
micro-batches of every step (``.grad`` accumulates the two reduced means), and ``fully_shard``
on a (4, 1) replicate x shard mesh reducing only the last micro-batch
(``set_requires_gradient_sync``). Faults: one rank's contribution doubled before FSDP2's
reduction (a wrapper inside rankscope's on ``_prepare_reduce_scatter_inputs``: "doubled", that
rank named), and the checking rank's reduced gradient perturbed by 2e-4 of its norm after
FSDP2's reduction (a post-accumulate-grad hook, which FSDP2 calls once it has written ``.grad``:
"sum", no rank named: only the checking rank's sketch of it is compared).
"""

import torch
import torch.distributed as dist
import torch.nn as nn

import shim_harness
from conftest import parse_metric
from shim_harness import TinyLM, batch, lm_loss

WORLD = 4
STEPS = 60
SKETCH_DIM = 512
DROP_STEP, DROP_RANK = 21, 1
DOUBLE_STEP, DOUBLE_RANK = 34, 2
PERTURB_STEP, PERTURB = 47, 2e-4

# name -> (gradient dtype, sketch encoding, faults {step: (kind, rank or relative size)}).
# The 2e-4 perturbation is checked where the arithmetic lets the check see it: float32 gradients
# and float32 sketches (the tolerance of the other combinations is larger: DESIGN.md's table).
FAULTS = {DROP_STEP: ("drop", DROP_RANK), DOUBLE_STEP: ("double", DOUBLE_RANK)}
CONFIGS = {
    "f32-float32": ("float32", "float32", {**FAULTS, PERTURB_STEP: ("perturb", PERTURB)}),
    "f32-float16": ("float32", "float16", FAULTS),
    "f32-int8": ("float32", "int8", FAULTS),
    "bf16-int8": ("bfloat16", "int8", FAULTS),
    "f16-float32": ("float16", "float32", FAULTS),
    "torchpath-f32-float32": ("float32", "float32", {**FAULTS, PERTURB_STEP: ("perturb", PERTURB)}),
}
# The jobs that take the deferred device path (torch ops on the CPU).
TORCH_PATH = {"torchpath-f32-float32"}


class FaultState:
    """The fault hook's state: the step being trained and the faults to inject."""

    def __init__(self, faults, rank, world):
        self.step = 0
        self.faults = faults
        self.rank = rank
        self.world = world


def fault_hook(state, bucket):
    """A user's comm hook (rankscope chains to it): the default all-reduce, in float32 for
    half-precision buckets, with the step's fault injected."""
    buf = bucket.buffer()
    fault = state.faults.get(state.step)
    if fault and fault[0] == "drop" and state.rank == fault[1]:
        buf.zero_()
    if fault and fault[0] == "double" and state.rank == fault[1]:
        buf.mul_(2)
    wide = buf if buf.dtype == torch.float32 else buf.to(torch.float32)
    wide.div_(state.world)
    fut = dist.all_reduce(wide, async_op=True).get_future()

    def after(f):
        out = f.value()[0]
        if fault and fault[0] == "perturb":  # the same noise on every rank
            g = torch.Generator().manual_seed(1000 * state.step + bucket.index())
            noise = torch.randn(out.numel(), generator=g, dtype=torch.float64)
            out.add_((noise * (fault[1] * out.double().norm() / noise.norm())).to(out.dtype))
        if out is not buf:
            buf.copy_(out)
        return buf

    return fut.then(after)


def integrity_worker(rank, world, collector, fsdp2=False):
    import rankscope.torch as rst

    if fsdp2:
        fsdp2_integrity_jobs(rank, world, collector)

    for name, (dtype, encoding, faults) in CONFIGS.items():
        torch.manual_seed(7)
        model = TinyLM().to(getattr(torch, dtype))
        ddp = nn.parallel.DistributedDataParallel(model)
        state = FaultState(faults, rank, world)
        mon = rst.attach(
            ddp,
            collector=collector,
            job=f"integrity-{name}",
            sketch_dim=SKETCH_DIM,
            sketch_encoding=encoding,
            comm_hook=fault_hook,
            comm_hook_state=state,
            integrity_every=1,
        )
        mon._bypass_native = name in TORCH_PATH
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(STEPS):
            state.step = step
            sgd.zero_grad(set_to_none=True)
            loss = lm_loss(ddp, *batch(rank, step))
            loss.backward()
            sgd.step()
            mon.step(loss)
        # The device path's reports went through the deferred queue (none left behind).
        assert bool(mon._sketcher.device_sketches) == (name in TORCH_PATH), name
        assert mon.flush(60.0), f"{name}: reports not acknowledged"
        stats = mon.close()
        assert stats.get("shim_integrity_checks_sent", 0) == STEPS // world, stats
        assert stats.get("shim_integrity_skipped_buckets", 0) == 0, stats
        assert stats.get("shim_integrity_errors", 0) == 0, stats


# FSDP2 pure data parallelism: name -> (wrapping, only the last micro-batch reduces).
FSDP2_CONFIGS = {"fsdp2-replicate": ("replicate", False), "fsdp2-shard1": ("shard1", True)}
FSDP2_STEPS, FSDP2_ACCUM = 8, 2
FSDP2_DOUBLE_STEP, FSDP2_DOUBLE_RANK = 3, 2
FSDP2_PERTURB_STEP = 6  # checked by rank 6 % WORLD, whose reduced gradient is perturbed
FSDP2_FAULTS = {
    FSDP2_DOUBLE_STEP: ("double", FSDP2_DOUBLE_RANK),
    FSDP2_PERTURB_STEP: ("perturb", PERTURB),
}


def _fsdp2_available() -> bool:
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: F401

        from rankscope.frameworks import fsdp2

        return fsdp2.fsdp_module_class() is not None
    except ImportError:
        return False


def _fsdp2_model(wrapping):
    torch.manual_seed(7)
    model = TinyLM()
    if wrapping == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model.block)
        replicate(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _inject_fsdp2_faults(model, state, micro):
    """Before rankscope attaches: a wrapper of each group's _prepare_reduce_scatter_inputs (that
    rankscope's then wraps: it sees the local gradient first) doubles FSDP2_DOUBLE_RANK's
    contribution; a post-accumulate-grad hook perturbs the checking rank's reduced .grad after
    the step's last micro-batch's reduction. ``micro[0]``: the micro-batch being trained."""
    from rankscope.frameworks import fsdp2

    for group in fsdp2.param_groups(model):

        def prepare(
            fsdp_params,
            unsharded_grads,
            world_size,
            *a,
            _original=group._prepare_reduce_scatter_inputs,
            **kw,
        ):
            if state.faults.get(state.step) == ("double", state.rank):
                for g in unsharded_grads:
                    g.mul_(2)
            return _original(fsdp_params, unsharded_grads, world_size, *a, **kw)

        group._prepare_reduce_scatter_inputs = prepare

    def perturb(param):
        fault = state.faults.get(state.step)
        last = micro[0] == FSDP2_ACCUM - 1
        if fault and fault[0] == "perturb" and last and state.rank == state.step % state.world:
            g = param.grad._local_tensor
            gen = torch.Generator().manual_seed(1000 * state.step + g.numel())
            noise = torch.randn(g.shape, generator=gen, dtype=torch.float64)
            g.add_((noise * (fault[1] * g.double().norm() / noise.norm())).to(g.dtype))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(perturb)


def fsdp2_integrity_jobs(rank, world, collector):
    import rankscope.torch as rst

    for name, (wrapping, sync_last) in FSDP2_CONFIGS.items():
        model = _fsdp2_model(wrapping)
        state, micro = FaultState(FSDP2_FAULTS, rank, world), [0]
        _inject_fsdp2_faults(model, state, micro)
        mon = rst.attach(
            model,
            collector=collector,
            job=f"integrity-{name}",
            sketch_dim=SKETCH_DIM,
            integrity_every=1,
            accumulate_local_grad=True,
        )
        assert mon.framework_mode == "FSDP2 replicate" and not mon.integrity_unsupported
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(FSDP2_STEPS):
            state.step = step
            sgd.zero_grad(set_to_none=True)
            losses = []
            for m in range(FSDP2_ACCUM):
                micro[0] = m
                if sync_last:
                    model.set_requires_gradient_sync(m == FSDP2_ACCUM - 1)
                loss = lm_loss(model, *batch(rank, step, m))
                loss.backward()
                losses.append(loss.detach())
            sgd.step()
            mon.step(torch.stack(losses).mean())
        assert mon.flush(60.0), f"{name}: reports not acknowledged"
        stats = mon.close()
        assert stats.get("shim_integrity_checks_sent", 0) == FSDP2_STEPS // world, stats
        for counter in ("skipped_buckets", "errors", "unread"):
            assert stats.get(f"shim_integrity_{counter}", 0) == 0, stats


def _check_verdicts(collector, job, steps, faults):
    """Every step checked; each injected fault named as the design predicts, the rest clean."""
    rows = collector.query(
        "SELECT step, integrity_error_ratio, integrity_relative_error, integrity_fault, "
        "integrity_rank, integrity_weight FROM step_stats WHERE job = ? ORDER BY step",
        (job,),
    )
    assert [r[0] for r in rows] == list(range(steps)), job
    for step, ratio, rel, fault, suspect, weight in rows:
        assert ratio is not None, f"{job} step {step}: not checked"
        injected = faults.get(step)
        if injected is None:
            assert fault == "" and ratio <= 1.0, (
                f"{job} step {step}: clean step flagged {fault!r} (ratio {ratio}, "
                f"relative error {rel})"
            )
        elif injected[0] == "drop":
            assert (fault, suspect) == ("missing", injected[1]), (job, step, fault, suspect)
            assert abs(weight) < 0.1, (job, weight)
        elif injected[0] == "double":
            assert (fault, suspect) == ("doubled", injected[1]), (job, step, fault, suspect)
            assert abs(weight - 2.0) < 0.1, (job, weight)
        else:
            # The same wrong sum on every rank, or (FSDP2) the checking rank's reduced gradient
            # perturbed: flagged, its size measured, no rank to name.
            assert fault == "sum" and suspect is None, (job, step, fault, suspect)
            assert ratio > 1.0 and abs(rel - injected[1]) < 0.5 * injected[1], (job, ratio, rel)


def test_faults_in_the_reduction_are_named_and_clean_steps_raise_nothing(collector):
    fsdp2 = _fsdp2_available()  # torch 2.2 (the oldest-torch run) has no FSDP2
    shim_harness.spawn(integrity_worker, WORLD, collector.address, fsdp2, timeout=600.0)
    scrape = collector.scrape()
    for name in FSDP2_CONFIGS if fsdp2 else ():
        job = f"integrity-{name}"
        _check_verdicts(collector, job, FSDP2_STEPS, FSDP2_FAULTS)
        failed = parse_metric(scrape, "rankscope_integrity_failed_steps_total", train_job=job)
        assert failed == len(FSDP2_FAULTS), (name, failed)
        checks = parse_metric(scrape, "rankscope_integrity_checks_total", train_job=job)
        assert checks == FSDP2_STEPS, (name, checks)
    for name, (_, _, faults) in CONFIGS.items():
        job = f"integrity-{name}"
        _check_verdicts(collector, job, STEPS, faults)
        failed = parse_metric(scrape, "rankscope_integrity_failed_steps_total", train_job=job)
        assert failed == len(faults), (name, failed)
        assert parse_metric(scrape, "rankscope_integrity_checks_total", train_job=job) == STEPS
