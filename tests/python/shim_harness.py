"""Multi-process DDP harness for the trainer-shim tests (imported by spawned workers).

``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh
processes joined in a gloo process group, with a deadline. The training scenarios below compute,
next to the DDP step that rankscope watches, the exact per-rank quantities the collector must
report: each rank's local loss and full local gradient, from a reference replica of the module
(same parameters, same batch, no DDP), all-gathered to rank 0 (a collective the *test* pays, not
the shim).
"""

import copy
import json
import math
import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from conftest import free_port


# ---- process management ------------------------------------------------------------------------


def _entry(rank, fn, port, world_size, args, backend):
    torch.set_num_threads(1)  # 4 ranks share 2 cores
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size, *args, timeout=180.0, backend="gloo"):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a ``backend`` process
    group (gloo; nccl puts rank r on GPU r); raises if any rank fails or the whole run takes
    longer than ``timeout`` seconds (then every rank is killed)."""
    ctx = mp.start_processes(
        _entry,
        args=(fn, free_port(), world_size, args, backend),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise AssertionError(f"DDP run {fn.__name__} exceeded {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def flag_from_rank0(value: bool) -> bool:
    """Rank 0's decision, seen by every rank (a test-only collective: keeps ranks in step)."""
    t = torch.tensor([1 if value else 0], dtype=torch.int32)
    dist.broadcast(t, 0)
    return bool(t.item())


def write_json(path, obj) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


# ---- models ------------------------------------------------------------------------------------

VOCAB = 48


class TinyLM(nn.Module):
    """A one-layer causal transformer LM, deterministic (no dropout)."""

    def __init__(self, d=32, heads=2, ff=64, ctx=16, extra_branch=False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.block = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, VOCAB)
        self.extra = nn.Linear(d, d) if extra_branch else None
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, x, use_extra=False):
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.block(h, src_mask=self.mask[: x.shape[1], : x.shape[1]].to(h.dtype))
        if use_extra and self.extra is not None:
            h = h + self.extra(h)
        return self.head(h)


def lm_loss(model, x, y, use_extra=False):
    logits = model(x, use_extra) if use_extra else model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def batch(rank, step, micro=0, bsz=4, ctx=16):
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    data = torch.randint(0, VOCAB, (bsz, ctx + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def flat_grad(module) -> torch.Tensor:
    """The full local gradient in module.named_parameters() order (rankscope's flat order), in
    float64; a parameter without a gradient counts as zeros."""
    parts = []
    for _, p in module.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(g.detach().reshape(-1).double())
    return torch.cat(parts)


def fp32_allreduce_hook(process_group, bucket):
    """A user's own comm hook (for rankscope to chain to): all-reduce in float32."""
    buf = bucket.buffer()
    wide = buf.to(torch.float32).div_(dist.get_world_size(process_group))
    fut = dist.all_reduce(wide, group=process_group, async_op=True).get_future()

    def narrow(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(narrow)


# ---- exact statistics --------------------------------------------------------------------------


def exact_step_stats(losses, grads, sketch_dim, sketch_seed, encoding="float32"):
    """What the collector must compute for one step, from exact per-rank values; the sketches
    in `encoding` as the agent packs them (rankscope._native.pack_sketch)."""
    from rankscope import _native
    from rankscope._device_sketch import DeviceSketch

    w = len(losses)
    norms = [float(g.norm()) for g in grads]

    def pop_std(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)), m

    def mean_pairwise_cos(vs):
        units = []
        for v in vs:
            n = float(v.norm())
            units.append(v / n if n > 0 else torch.zeros_like(v))
        total = 0.0
        for i in range(w):
            for j in range(i + 1, w):
                total += float(torch.dot(units[i], units[j]))
        return total / (w * (w - 1) / 2)

    sketches = []
    for g in grads:
        s = DeviceSketch(sketch_dim, sketch_seed, "cpu")
        s.add(g, 0)
        values = s.bins.float()
        if encoding != "float32":
            bins, scale = _native.pack_sketch(values.tolist(), encoding)
            values = torch.tensor(_native.unpack_sketch(bins, encoding, scale), dtype=torch.float64)
        sketches.append(values.double())
    loss_std, loss_mean = pop_std(losses)
    gn_std, gn_mean = pop_std(norms)
    return {
        "loss_mean": loss_mean,
        "loss_std": loss_std,
        "loss_range": max(losses) - min(losses),
        "grad_norm_mean": gn_mean,
        "grad_norm_std": gn_std,
        "grad_norms": norms,
        "exact_cosine": mean_pairwise_cos(grads),
        "sketch_cosine": mean_pairwise_cos(sketches),
    }


def check_exact_rows(rows, rank_rows, expected, world_size, sketch_dim) -> None:
    """Asserts that the collector's step rows (``Collector.step_rows``) and rank rows
    (``Collector.rank_rows``) equal the exact values of ``expected`` (step -> exact_step_stats):
    loss and grad-norm dispersion and each rank's norm to float tolerance, direction consistency
    equal to the cosine of ideal sketches of the exact gradients and within the sketch's error of
    the exact cosine."""
    assert sorted(rows) == sorted(expected), "steps stored"
    cos_bound = 4 * math.sqrt(2 / sketch_dim)
    for step, e in expected.items():
        r = rows[step]
        assert r["ranks"] == world_size and r["missing_ranks"] == "" and not r["timed_out"]
        assert r["loss_mean"] == pytest.approx(e["loss_mean"], rel=1e-6)
        assert r["loss_std"] == pytest.approx(e["loss_std"], rel=1e-5, abs=1e-7)
        assert r["loss_range"] == pytest.approx(e["loss_range"], rel=1e-5, abs=1e-7)
        assert r["grad_norm_mean"] == pytest.approx(e["grad_norm_mean"], rel=1e-6)
        assert r["grad_norm_std"] == pytest.approx(e["grad_norm_std"], rel=1e-5, abs=1e-9)
        norms = {rank: gn for s, rank, _, gn, _ in rank_rows if s == step}
        assert [norms[k] for k in range(world_size)] == pytest.approx(e["grad_norms"], rel=1e-6)
        # The collector's cosine is exactly that of sketches of the exact gradients...
        assert r["grad_cosine_mean"] == pytest.approx(e["sketch_cosine"], abs=2e-5)
        # ...and the sketch estimates the exact cosine within its error.
        assert abs(r["grad_cosine_mean"] - e["exact_cosine"]) < cos_bound, (
            f"step {step}: sketch {r['grad_cosine_mean']:.4f} exact {e['exact_cosine']:.4f}"
        )


# ---- scenario: exact statistics on many model shapes -------------------------------------------

# name -> options. Each runs a few steps on its own job and DDP model.
SCENARIOS = {
    "plain": {},
    "buckets": {"bucket_cap_mb": 0.01, "d": 48, "ff": 96},
    "unused": {"unused": True},
    "bf16": {"dtype": "bfloat16"},
    "accum": {"accum": 3},
    "late": {"late": 20},
    "env": {"env": True},
    "torchpath": {"torchpath": True},
}


def bucket_norm_error(sketcher, ddp, ref) -> float:
    """The worst relative difference, over the parameter groups, between the per-bucket local
    gradient norms the sketcher holds for the step (read before mon.step) and torch's float64
    norms of the reference replica's gradients, grouped as the sketcher groups them."""
    got = sketcher.bucket_norms()
    assert len(got) == len(sketcher.bucket_names) > 0
    sq = [0.0] * len(got)
    for p, (_, q) in zip(ddp.module.parameters(), ref.named_parameters()):
        off = sketcher.offset_of(p)
        if q.grad is None or off is None or p.numel() == 0:
            continue
        n = torch.linalg.vector_norm(q.grad.detach().double()).item()
        sq[sketcher.bucket_of_offset(off)] += n * n
    return max(abs(g - math.sqrt(e)) / max(math.sqrt(e), 1e-30) for g, e in zip(got, sq))


# Long: one end-to-end scenario read top to bottom, its phases commented in order; split, its
# processes and expectations would be handed between helpers.
def exact_worker(
    rank,
    world_size,
    collector,
    job_prefix,
    out_dir,
    steps,
    sketch_dim,
    encoding="float32",
    scenarios=None,
):
    """Runs `scenarios` (default: all of SCENARIOS) with sketches of `sketch_dim` bins in
    `encoding`."""
    from rankscope import DEFAULT_SKETCH_SEED
    import rankscope.torch as rst

    out_dir = Path(out_dir)
    for name, opt in SCENARIOS.items():
        if scenarios is not None and name not in scenarios:
            continue
        torch.manual_seed(7)  # the same initial weights on every rank
        model = TinyLM(d=opt.get("d", 32), ff=opt.get("ff", 64), extra_branch=opt.get("unused"))
        if "dtype" in opt:
            model = model.to(getattr(torch, opt["dtype"]))
        ref = copy.deepcopy(model)
        # bfloat16 gradients are all-reduced in float32 through a user's comm hook that
        # rankscope chains to (its comm_hook=).
        bf16 = opt.get("dtype") == "bfloat16"
        first_bucket_bytes = dist._DEFAULT_FIRST_BUCKET_BYTES
        if "bucket_cap_mb" in opt:  # DDP's first bucket is 1 MiB regardless of bucket_cap_mb
            dist._DEFAULT_FIRST_BUCKET_BYTES = int(opt["bucket_cap_mb"] * 2**20)
        ddp = nn.parallel.DistributedDataParallel(
            model,
            bucket_cap_mb=opt.get("bucket_cap_mb", 25),
            find_unused_parameters=bool(opt.get("unused")),
        )
        dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket_bytes
        chain = {"comm_hook": fp32_allreduce_hook, "comm_hook_state": None} if bf16 else {}
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
        job = f"{job_prefix}-{name}"
        use_extra = bool(opt.get("unused")) and rank % 2 == 0
        accum = opt.get("accum", 1)

        def train_step(step):
            sgd.zero_grad(set_to_none=True)
            losses = []
            for micro in range(accum):
                x, y = batch(rank, step, micro)
                if micro < accum - 1:
                    with ddp.no_sync():
                        loss = lm_loss(ddp, x, y, use_extra)
                        loss.backward()
                else:
                    loss = lm_loss(ddp, x, y, use_extra)
                    loss.backward()
                losses.append(loss.detach())
            sgd.step()
            return torch.stack(losses).mean() if accum > 1 else losses[0]

        first = opt.get("late", 0)
        for step in range(first):  # trained before rankscope is attached
            train_step(step)

        if opt.get("env"):
            os.environ["RANKSCOPE_COLLECTOR"] = collector
            os.environ["RANKSCOPE_JOB"] = job
            mon = rst.attach(
                ddp, sketch_dim=sketch_dim, start_step=first, sketch_encoding=encoding, **chain
            )
            del os.environ["RANKSCOPE_COLLECTOR"], os.environ["RANKSCOPE_JOB"]
        else:
            mon = rst.attach(
                ddp,
                collector=collector,
                job=job,
                sketch_dim=sketch_dim,
                start_step=first,
                sketch_encoding=encoding,
                **chain,
            )
        mon._bypass_native = bool(opt.get("torchpath"))

        expected = {}
        norm_errors = []  # per step: (planned buckets so far, worst relative error)
        for step in range(first, first + steps):
            # Exact local loss and gradient from the reference replica (same weights, batch).
            ref.load_state_dict(ddp.module.state_dict())
            ref.zero_grad(set_to_none=True)
            ref_losses = []
            for micro in range(accum):
                x, y = batch(rank, step, micro)
                rl = lm_loss(ref, x, y, use_extra)
                rl.backward()
                ref_losses.append(rl.detach())
            ref_loss = torch.stack(ref_losses).mean() if accum > 1 else ref_losses[0]
            g = flat_grad(ref)

            loss = train_step(step)
            norm_errors.append(
                (mon.counters["planned_buckets"], bucket_norm_error(mon._sketcher, ddp, ref))
            )
            mon.step(loss)

            gathered = [torch.zeros_like(g) for _ in range(world_size)]
            dist.all_gather(gathered, g)
            losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
            dist.all_gather(losses, ref_loss.double().reshape(1))
            if rank == 0:
                expected[step] = exact_step_stats(
                    [float(v) for v in losses], gathered, sketch_dim, DEFAULT_SKETCH_SEED, encoding
                )
                expected[step]["reported_loss_rank0"] = float(loss)
        stats = mon.close(timeout=30)
        info = {
            "stats": stats,
            "first": first,
            "steps": steps,
            "num_coordinates": mon.num_coordinates,
            "bucket_norm_errors": norm_errors,
        }
        write_json(out_dir / f"{name}.rank{rank}.json", info)
        if rank == 0:
            write_json(out_dir / f"{name}.expected.json", expected)
        dist.barrier()


# ---- scenario: control (dormant -> enabled -> re-tuned -> disabled) ----------------------------


def control_worker(rank, world_size, collector, job, work_dir, max_seconds):
    import rankscope.torch as rst

    work_dir = Path(work_dir)
    torch.manual_seed(7)
    ddp = nn.parallel.DistributedDataParallel(TinyLM())
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mon = rst.attach(
        ddp, collector=collector, job=job, sketch_dim=256, dormant=True, control_margin=0.5
    )
    transitions = []  # (first step with these settings, enabled, every, sketch_dim)
    t_end = time.monotonic() + max_seconds
    step = 0
    while True:
        state = (mon.enabled, mon.every, mon.sketch_dim)
        if not transitions or tuple(transitions[-1][1:]) != state:
            transitions.append((mon.step_number,) + state)
            write_json(work_dir / f"rank{rank}.json", transitions)
        stop = (work_dir / "stop").exists() or time.monotonic() > t_end
        if flag_from_rank0(stop if rank == 0 else False):
            break
        x, y = batch(rank, step)
        sgd.zero_grad(set_to_none=True)
        loss = lm_loss(ddp, x, y)
        loss.backward()
        sgd.step()
        mon.step(loss)
        step += 1
        if rank == 0 and step % 5 == 0:
            write_json(work_dir / "progress.json", {"step": mon.step_number})
    stats = mon.close(timeout=20)
    write_json(work_dir / f"rank{rank}.json", transitions)
    write_json(work_dir / f"rank{rank}.stats.json", {"stats": stats, "last": mon.step_number})


# ---- scenario: the collector is killed mid-training --------------------------------------------


def outage_worker(rank, world_size, collector, job, work_dir, min_outage_steps):
    """Phases, decided by rank 0 and broadcast: (A) train until the parent killed the collector
    (file 'killed'); (B) train through the outage for at least min_outage_steps steps and until
    the shim warned; (C) train 10 more steps while the parent restarts the collector; close."""
    import rankscope.torch as rst

    work_dir = Path(work_dir)
    torch.manual_seed(7)
    ddp = nn.parallel.DistributedDataParallel(TinyLM())
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    caught = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mon = rst.attach(
            ddp, collector=collector, job=job, sketch_dim=256, warn_after=0.3, max_backoff=0.5
        )
        phase, step, phase_start = "A", 0, 0
        times = {"A": [], "B": [], "C": []}
        while True:
            t0 = time.perf_counter()
            x, y = batch(rank, step)
            sgd.zero_grad(set_to_none=True)
            loss = lm_loss(ddp, x, y)
            loss.backward()
            sgd.step()
            mon.step(loss)
            times[phase].append(time.perf_counter() - t0)
            step += 1
            if rank == 0:
                write_json(work_dir / "progress.json", {"step": step, "phase": phase})
            if phase == "A":
                if flag_from_rank0(rank == 0 and (work_dir / "killed").exists()):
                    phase, phase_start = "B", step
            elif phase == "B":
                warned = any("no connection" in str(m.message) for m in w)
                done = step - phase_start >= min_outage_steps and warned
                if flag_from_rank0(rank == 0 and done):
                    phase, phase_start = "C", step
                    if rank == 0:
                        write_json(work_dir / "outage_done.json", {"step": step})
            elif step - phase_start >= 10:
                break
        caught = [str(m.message) for m in w if "rankscope" in str(m.message)]
        stats = mon.close(timeout=60)
    write_json(
        work_dir / f"rank{rank}.json",
        {
            "steps": step,
            "times": times,
            "warnings": caught,
            "stats": stats,
            "collector": mon.collector,
        },
    )
