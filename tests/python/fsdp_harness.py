"""Workers for the FSDP1 / FSDP2 / torch.compile truth tests (imported by spawned processes).

Each runs one scenario on its own job: the framework's model (wrapped from the same initial weights
on every rank) trains a few steps with rankscope attached, while a reference replica of the
unwrapped module (same weights, same batches, no framework) gives each rank's exact local loss and
full local gradient in rankscope's flat order (shim_harness.flat_grad), all-gathered to rank 0 (the
test's collective, not the shim's). Rank 0 writes the exact statistics (shim_harness.exact_step_stats)
for the collector rows to be checked against.
"""

import contextlib
import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import shim_harness as sh


def _wrap_fsdp2(model, mode, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model.block)
        replicate(model)
        return model
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _wrap_fsdp1(model, strategy):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
        sharding_strategy=getattr(ShardingStrategy, strategy),
        device_id=torch.device("cpu"),  # torch >= 2.4 looks for an accelerator otherwise
    )


def exact_worker(rank, world_size, collector, out_dir, steps, sketch_dim, scenarios):
    """Runs each of ``scenarios`` (job name -> scenario) in turn, in these processes."""
    for job, scenario in scenarios.items():
        exact_scenario(rank, world_size, collector, job, out_dir, steps, sketch_dim, scenario)


# Long: one rank's run of one scenario against its reference replica, step by step; the
# scenario's options (accumulation, unused branch, perturbation) act at their places in that
# loop, which split into helpers would be handed its whole state.
def exact_scenario(rank, world_size, collector, job, out_dir, steps, sketch_dim, scenario):
    """``scenario``: {"framework": "fsdp2"|"fsdp1"|"compile", "mode": ..., "backend": torch.compile's
    (default aot_eager), "accum": micro-batches
    per step (each reduced), "keep": attach's accumulate_local_grad, "unused": a branch without
    gradients, "sync_last": only the last micro-batch reduces, "ff": TinyLM's feed-forward width
    (odd: uneven shards), "param_check_every": attach's, "perturb": {"rank", "step"}: that rank
    adds 1e-3 to one value of its local parameters after that step's optimizer step}. Writes
    JOB.expected.json (rank 0) and JOB.rankR.json: the monitor's stats and the parameter
    fingerprint of the replicas after step 0 (pure data-parallel modes and HSDP's local shards),
    computed here with rankscope.fingerprint, with the shapes of what it covers."""
    from rankscope import DEFAULT_SKETCH_SEED
    from rankscope import fingerprint as fp
    import rankscope.torch as rst

    torch.manual_seed(7)
    # "unused": a branch no forward takes, on every rank: its parameters never get a gradient,
    # so FSDP2 leaves them out of the reduction (the layout it reduces changes).
    model = sh.TinyLM(extra_branch=bool(scenario.get("unused")), ff=scenario.get("ff", 64))
    ref = copy.deepcopy(model)
    framework = scenario["framework"]
    if framework == "fsdp2":
        wrapped = _wrap_fsdp2(model, scenario["mode"], world_size)
    elif framework == "fsdp1":
        wrapped = _wrap_fsdp1(model, scenario["mode"])
    else:  # a compiled model under DDP (torch.compile's default ddp_optimizer mode)
        ddp = nn.parallel.DistributedDataParallel(model)
        wrapped = torch.compile(ddp, backend=scenario.get("backend", "aot_eager"))
        model = ddp.module
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    accum = scenario.get("accum", 1)
    extra = {}
    if "param_check_every" in scenario:
        extra["param_check_every"] = scenario["param_check_every"]
    perturb = scenario.get("perturb", {})
    mon = rst.attach(
        ddp if framework == "compile" else wrapped,
        collector=collector,
        job=job,
        sketch_dim=sketch_dim,
        accumulate_local_grad=scenario.get("keep"),
        **extra,
    )
    expected = {}
    param_fp = shapes = None
    for step in range(steps):
        ref.load_state_dict(_full_state(wrapped, framework, model))
        ref.zero_grad(set_to_none=True)
        ref_losses = []
        for micro in range(accum):
            x, y = sh.batch(rank, step, micro)
            rl = sh.lm_loss(ref, x, y)
            rl.backward()
            ref_losses.append(rl.detach())
        ref_loss = torch.stack(ref_losses).mean()
        g = sh.flat_grad(ref)

        opt.zero_grad(set_to_none=True)
        losses = []
        for micro in range(accum):
            x, y = sh.batch(rank, step, micro)
            with _sync(wrapped, framework, micro == accum - 1 or not scenario.get("sync_last")):
                loss = sh.lm_loss(wrapped, x, y)
                loss.backward()
            losses.append(loss.detach())
        opt.step()
        if perturb.get("rank") == rank and perturb.get("step") == step:
            with torch.no_grad():  # a replica that went its own way (a bit flip, a bad update)
                local = next(t for t in mon._replica._params if t.numel() > 0)
                local.view(-1)[0] += 1e-3
        mon.step(torch.stack(losses).mean())
        if step == 0 and scenario.get("mode") in ("replicate", "NO_SHARD", "hsdp"):
            replicas = list(mon._replica._params)  # what the path fingerprints
            if scenario["mode"] in ("replicate", "hsdp"):
                assert [id(t) for t in replicas] == [
                    id(getattr(p, "_local_tensor", p)) for p in wrapped.parameters()
                ]
            param_fp = fp.to_uint64(fp.fold_parameters(replicas))
            shapes = [list(t.shape) for t in replicas]

        gathered = [torch.zeros_like(g) for _ in range(world_size)]
        dist.all_gather(gathered, g)
        all_losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(all_losses, ref_loss.double().reshape(1))
        if rank == 0:
            expected[step] = sh.exact_step_stats(
                [float(v) for v in all_losses], gathered, sketch_dim, DEFAULT_SKETCH_SEED
            )
    stats = mon.close(timeout=30)
    out_dir = Path(out_dir)
    sh.write_json(
        out_dir / f"{job}.rank{rank}.json",
        {"stats": stats, "param_fp": param_fp, "shapes": shapes},
    )
    if rank == 0:
        sh.write_json(out_dir / f"{job}.expected.json", expected)
    dist.barrier()


def _sync(wrapped, framework, sync: bool):
    """The context of a micro-batch's forward and backward: reduce its gradient or not (FSDP1's
    ``no_sync()``, FSDP2's ``set_requires_gradient_sync``)."""
    if framework == "fsdp2":
        wrapped.set_requires_gradient_sync(sync)
    elif not sync:
        return wrapped.no_sync()
    return contextlib.nullcontext()


def _full_state(wrapped, framework, model):
    """The model's full parameters as a plain state dict (what the reference replica loads)."""
    if framework == "fsdp2":
        out = {}
        for name, t in wrapped.state_dict().items():
            out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
        return out
    if framework == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(wrapped):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model.state_dict()


def checks_worker(rank, world_size, out_dir, identical_cases):
    """The bit-identity runs (framework, mode) and both refusals, in these processes."""
    for framework, mode in identical_cases:
        identical_worker(rank, world_size, out_dir, 3, framework, mode)
    refusal_worker(rank, world_size, out_dir)
    if "fsdp2" in {f for f, _ in identical_cases}:
        non_root_worker(rank, world_size, out_dir)
    python_reducer_worker(rank, world_size, out_dir)  # last: it sets torch._dynamo's config


def identical_worker(rank, world_size, out_dir, steps, framework, mode):
    """Trains two copies of one model from the same weights on the same batches, one watched by
    rankscope and one not, and writes whether their parameters are bit-identical after each
    step (FSDP1: rankscope's hook chains to PyTorch's default hooks; FSDP2: rankscope wraps only
    the reduce-scatter's input preparation)."""
    import rankscope.torch as rst

    torch.manual_seed(7)
    base = sh.TinyLM()
    watched_module, plain_module = copy.deepcopy(base), copy.deepcopy(base)
    if framework == "fsdp1":
        watched, plain = _wrap_fsdp1(watched_module, mode), _wrap_fsdp1(plain_module, mode)
    else:
        watched = _wrap_fsdp2(watched_module, mode, world_size)
        plain = _wrap_fsdp2(plain_module, mode, world_size)
    mon = rst.attach(
        watched, collector="127.0.0.1:9", job=f"identical-{framework}-{mode}", sketch_dim=64
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (watched, plain)]
    same = []
    for step in range(steps):
        for m, opt in zip((watched, plain), opts):
            opt.zero_grad(set_to_none=True)
            for micro in range(2):  # two reductions a step (no no_sync)
                x, y = sh.batch(rank, step, micro)
                sh.lm_loss(m, x, y).backward()
            opt.step()
        mon.step()
        a = _full_state(watched, framework, watched_module)
        b = _full_state(plain, framework, plain_module)
        same.append(all(torch.equal(a[k], b[k]) for k in a))
    stats = mon.close(timeout=0)
    sh.write_json(
        Path(out_dir) / f"identical-{framework}-{mode}.rank{rank}.json",
        {
            "same": same,
            "buckets": stats.get("shim_buckets", 0),
            "errors": stats.get("shim_hook_errors", 0),
        },
    )
    dist.barrier()


def refusal_worker(rank, world_size, out_dir):
    """FSDP1 HYBRID_SHARD: attach warns once and returns a stand-in; training goes on."""
    import warnings

    import rankscope.torch as rst
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(7)
    # Sharded over both ranks, replicated across one "node" each (an intra-node group of one
    # rank would make FSDP fall back to NO_SHARD).
    intra = dist.new_group(list(range(world_size)))
    inter = [dist.new_group([r]) for r in range(world_size)][rank]
    model = FSDP(
        sh.TinyLM(),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        process_group=(intra, inter),
        device_id=torch.device("cpu"),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = rst.attach(model, collector="127.0.0.1:9", job="refused", sketch_dim=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        x, y = sh.batch(rank, step)
        sh.lm_loss(model, x, y).backward()
        opt.step()
        mon.step()
    sh.write_json(
        Path(out_dir) / f"hybrid.rank{rank}.json",
        {
            "messages": [str(w.message) for w in caught if "rankscope" in str(w.message)],
            "stats": mon.close(),
            "steps": mon.step_number,
        },
    )
    dist.barrier()


def python_reducer_worker(rank, world_size, out_dir):
    """DDP built in torch.compile's python_reducer mode (for compiled autograd): attach warns once
    and returns a stand-in; training goes on."""
    import warnings

    import rankscope.torch as rst

    try:
        torch._dynamo.config.optimize_ddp = "python_reducer"
    except Exception:  # a torch without the mode: the test skips
        pass
    torch.manual_seed(7)
    ddp = nn.parallel.DistributedDataParallel(sh.TinyLM())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = rst.attach(ddp, collector="127.0.0.1:9", job="python-reducer", sketch_dim=64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    x, y = sh.batch(rank, 0)
    sh.lm_loss(ddp, x, y).backward()
    opt.step()
    mon.step()
    sh.write_json(
        Path(out_dir) / f"python-reducer.rank{rank}.json",
        {
            "python_reducer": bool(getattr(ddp, "_use_python_reducer", False)),
            "messages": [str(w.message) for w in caught if "rankscope" in str(w.message)],
            "stats": mon.close(),
        },
    )
    dist.barrier()


def non_root_worker(rank, world_size, out_dir):
    """attach on an FSDP2 submodule (not the root) after a forward: refused with one message."""
    import warnings

    import rankscope.torch as rst

    torch.manual_seed(7)
    model = _wrap_fsdp2(sh.TinyLM(), "shard", world_size)
    x, y = sh.batch(rank, 0)
    sh.lm_loss(model, x, y).backward()  # FSDP2 decides its root at the first forward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = rst.attach(model.block, collector="127.0.0.1:9", job="non-root", sketch_dim=64)
    sh.write_json(
        Path(out_dir) / f"non-root.rank{rank}.json",
        {
            "messages": [str(w.message) for w in caught if "rankscope" in str(w.message)],
            "stats": mon.close(),
        },
    )
    dist.barrier()
