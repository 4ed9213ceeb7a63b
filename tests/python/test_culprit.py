"""Naming the culprit in real DDP runs: 4 gloo ranks, the real shim, the real collector.

One spawned run trains a small regression MLP through five scenarios, each its own job:
  healthy   no fault;
  nudge     rank 2's parameters nudged by one ulp (torch.nextafter on one element) after step 30
            (this one runs the shim's device path, torch ops, on the CPU; the others the C++
            kernel);
  perturb   rank 1's *reduced* gradient perturbed by one ulp on step 25 (a chained comm hook that
            runs after the all-reduce, before rankscope's fingerprint);
  corrupt   rank 3 fed pure-noise targets from step 40;
  straggler rank 1 sleeps before every backward;
  layer     rank 1's gradient of one layer (net.2.weight) scaled by 45 from step 15 (a tensor
            hook: a kernel fault in one layer), for "where in the model";
  tolerance replica_check="tolerance" (replicas not bit-identical by design): rank 2's
            parameters nudged in their last bit (four values) after step 12, rank 1's reduced
            gradient moved by one ulp on step 25 (perturb's hook), and rank 1's net.2.weight
            scaled by 1 + 1e-3 after step 22 (a real divergence).
The workers write the ground truth they know (e.g. whether rank 2's parameters still differ at
the check) to JSON; the tests read what the collector stored in SQLite.
"""

import math
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native")

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

from shim_harness import spawn, write_json  # noqa: E402

W = 4
PARAM_CHECK_EVERY = 10
NUDGE_AFTER, NUDGE_RANK = 30, 2
PERTURB_STEP, PERTURB_RANK = 25, 1
CORRUPT_FROM, CORRUPT_RANK = 40, 3
STRAGGLER_RANK, STRAGGLER_SLEEP = 1, 0.05
LAYER_FROM, LAYER_RANK, LAYER_SCALE = 15, 1, 45.0
ROUNDING_AFTER, ROUNDING_RANK = 12, 2
DIVERGE_AFTER, DIVERGE_RANK, DIVERGE_SCALE = 22, 1, 1.001
STEPS = {
    "healthy": 60,
    "nudge": 60,
    "perturb": 40,
    "corrupt": 80,
    "straggler": 25,
    "layer": 30,
    "tolerance": 31,
}


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
        )

    def forward(self, x):
        return self.net(x)


def data(rank, step, corrupt=False, bsz=32):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(16, 4, generator=teacher)
    x = torch.randn(bsz, 16, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(bsz, 4, generator=g)
    if corrupt:
        y = 3.0 * torch.randn(bsz, 4, generator=g)
    return x, y


class _PerturbState:
    def __init__(self, pg, rank):
        self.pg = pg
        self.rank = rank
        self.step = 0


def perturbing_hook(state, bucket):
    """All-reduce, then (rank PERTURB_RANK, step PERTURB_STEP, first bucket) move one reduced
    value by one ulp: silent corruption in gradient aggregation."""
    fut = default_hooks.allreduce_hook(state.pg, bucket)

    def perturb(f):
        t = f.value()
        if state.rank == PERTURB_RANK and state.step == PERTURB_STEP and bucket.index() == 0:
            flat = t.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf))
        return t

    return fut.then(perturb)


def params_differ_from_rank0(module) -> list:
    """Test-only ground truth: which ranks' parameters differ bitwise from rank 0's."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    ref = gathered[0].view(torch.int32)
    return [r for r, g in enumerate(gathered) if not torch.equal(g.view(torch.int32), ref)]


def culprit_worker(rank, world_size, collector, job_prefix, out_dir):
    import rankscope.torch as rst

    out_dir = Path(out_dir)
    for name, steps in STEPS.items():
        torch.manual_seed(11)
        ddp = nn.parallel.DistributedDataParallel(Mlp())
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
        extra = {}
        pstate = None
        if name in ("perturb", "tolerance"):
            pstate = _PerturbState(ddp.process_group, rank)
            extra = {"comm_hook": perturbing_hook, "comm_hook_state": pstate}
        if name == "tolerance":
            extra["replica_check"] = "tolerance"
        mon = rst.attach(
            ddp,
            collector=collector,
            job=f"{job_prefix}-{name}",
            sketch_dim=256,
            local_batch_size=32,
            param_check_every=PARAM_CHECK_EVERY,
            **extra,
        )
        mon._bypass_native = name == "nudge"  # the device (torch-op) path, on the CPU
        truth = {}
        current = [0]
        if name == "layer" and rank == LAYER_RANK:
            ddp.module.net[2].weight.register_hook(
                lambda g: g * LAYER_SCALE if current[0] >= LAYER_FROM else g
            )
        for step in range(steps):
            current[0] = step
            if pstate is not None:
                pstate.step = step
            x, y = data(
                rank,
                step,
                corrupt=(name == "corrupt" and rank == CORRUPT_RANK and step >= CORRUPT_FROM),
            )
            sgd.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp(x), y)
            if name == "straggler" and rank == STRAGGLER_RANK:
                time.sleep(STRAGGLER_SLEEP)
            loss.backward()
            sgd.step()
            mon.step(loss)
            if name == "nudge" and step == NUDGE_AFTER and rank == NUDGE_RANK:
                with torch.no_grad():
                    w = ddp.module.net[0].weight.view(-1)
                    i = int(w.abs().argmax())  # large |w|: an SGD update keeps the ulp
                    w[i] = torch.nextafter(w[i], torch.tensor(math.inf))
            if name == "tolerance" and step == ROUNDING_AFTER and rank == ROUNDING_RANK:
                with torch.no_grad():
                    w = ddp.module.net[0].weight.view(-1)
                    for i in w.abs().topk(4).indices.tolist():  # large |w|: SGD keeps the ulp
                        w[i] = torch.nextafter(w[i], torch.tensor(math.inf))
            if name == "tolerance" and step == DIVERGE_AFTER and rank == DIVERGE_RANK:
                with torch.no_grad():
                    ddp.module.net[2].weight.mul_(DIVERGE_SCALE)
            if name in ("nudge", "perturb", "tolerance") and step % PARAM_CHECK_EVERY == 0:
                truth[step] = params_differ_from_rank0(ddp.module)
        buckets = list(mon._sketcher.bucket_names)
        stats = mon.close(timeout=30)
        if rank == 0:
            write_json(out_dir / f"{name}.truth.json", truth)
            write_json(out_dir / f"{name}.buckets.json", buckets)
        write_json(out_dir / f"{name}.rank{rank}.json", stats)
        dist.barrier()


@pytest.fixture(scope="module")
def run(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("culprit")
    t0 = time.monotonic()
    spawn(culprit_worker, W, module_collector.address, "culprit", str(out), timeout=300)
    return module_collector, out, time.monotonic() - t0


def rank_table(collector, job):
    rows = collector.query(
        "SELECT step, rank, replica_ok, outlier_score, step_time_z, step_time_seconds, "
        "reduced_grad_fingerprint, param_fingerprint FROM rank_steps WHERE job = ? "
        "ORDER BY step, rank",
        (job,),
    )
    table = {}
    for step, rank, ok, score, tz, st, gfp, pfp in rows:
        table.setdefault(step, {})[rank] = {
            "replica_ok": ok,
            "score": score,
            "time_z": tz,
            "time": st,
            "grad_fp": gfp,
            "param_fp": pfp,
        }
    return table


def step_table(collector, job):
    rows = collector.query(
        "SELECT step, ranks, replica_checked, replica_divergent_ranks, outlier_ranks, "
        "grad_noise_scale FROM step_stats WHERE job = ? ORDER BY step",
        (job,),
    )
    return {
        r[0]: {
            "ranks": r[1],
            "checked": r[2],
            "divergent": r[3] or "",
            "outliers": r[4] or "",
            "noise_scale": r[5],
        }
        for r in rows
    }


def test_every_scenario_reports_every_step_with_fingerprints(run):
    collector, out, _ = run
    for name, steps in STEPS.items():
        stats = step_table(collector, f"culprit-{name}")
        assert sorted(stats) == list(range(steps)), name
        assert all(s["ranks"] == W and s["checked"] for s in stats.values()), name
        ranks = rank_table(collector, f"culprit-{name}")
        for step, by_rank in ranks.items():
            assert all(r["grad_fp"] is not None for r in by_rank.values()), (name, step)
            has_param = [r["param_fp"] is not None for r in by_rank.values()]
            assert all(has_param) == (step % PARAM_CHECK_EVERY == 0), (name, step)
            assert not any(has_param) or all(has_param)
            assert all(r["time"] is not None and r["time"] >= 0 for r in by_rank.values())


def test_healthy_job_has_no_divergence(run):
    collector, _, _ = run
    stats = step_table(collector, "culprit-healthy")
    assert all(s["divergent"] == "" for s in stats.values())
    ranks = rank_table(collector, "culprit-healthy")
    assert all(r["replica_ok"] == 1 for by in ranks.values() for r in by.values())
    # The reduced gradient is bit-identical on every rank (gloo's ring all-reduce), and its
    # norm gives a noise-scale estimate on most steps.
    for by in ranks.values():
        assert len({r["grad_fp"] for r in by.values()}) == 1
    finite = [
        s["noise_scale"]
        for s in stats.values()
        if s["noise_scale"] is not None and math.isfinite(s["noise_scale"])
    ]
    assert len(finite) >= len(stats) // 2


def test_healthy_job_outlier_flags(run):
    """No rank is flagged (step_stats.outlier_ranks) on any step of a healthy job. A single step
    above the score threshold is common noise at W = 4 (~4e-2 of rank-steps by the collector's
    calibration, collector/analysis/rank_diagnostics.h; printed below), which is why the collector only
    flags a rank above it on 3 consecutive steps; no healthy rank is the worst on most steps."""
    collector, _, _ = run
    stats = step_table(collector, "culprit-healthy")
    ranks = rank_table(collector, "culprit-healthy")
    above = sum(
        1
        for by in ranks.values()
        for r in by.values()
        if r["score"] is not None and r["score"] > 6.0
    )
    print(f"healthy W=4: {above} rank-steps of {W * len(stats)} above the single-step threshold")
    assert all(s["outliers"] == "" for s in stats.values()), {
        s: v["outliers"] for s, v in stats.items() if v["outliers"]
    }
    for r in range(W):
        worst = sum(
            1 for s in ranks if max(ranks[s], key=lambda q: ranks[s][q]["score"] or 0.0) == r
        )
        assert worst <= len(ranks) // 2, (r, worst)


def test_one_ulp_parameter_nudge_is_caught_at_the_next_check(run):
    collector, out, _ = run
    import json

    truth = json.loads((out / "nudge.truth.json").read_text())
    check = (NUDGE_AFTER // PARAM_CHECK_EVERY + 1) * PARAM_CHECK_EVERY
    assert truth[str(check)] == [NUDGE_RANK], "the nudge must still be there at the check"
    stats = step_table(collector, "culprit-nudge")
    ranks = rank_table(collector, "culprit-nudge")
    for step in range(check):
        assert stats[step]["divergent"] == "", step
    assert stats[check]["divergent"] == str(NUDGE_RANK)
    assert ranks[check][NUDGE_RANK]["replica_ok"] == 0
    assert all(ranks[check][r]["replica_ok"] == 1 for r in range(W) if r != NUDGE_RANK)
    # Between checks the reduced gradients still agree (the all-reduce evens them out).
    for step in range(check + 1, STEPS["nudge"]):
        expected = str(NUDGE_RANK) if step % PARAM_CHECK_EVERY == 0 else ""
        assert stats[step]["divergent"] == expected, step


def test_perturbed_reduced_gradient_is_caught_on_that_step(run):
    collector, out, _ = run
    import json

    truth = json.loads((out / "perturb.truth.json").read_text())
    stats = step_table(collector, "culprit-perturb")
    ranks = rank_table(collector, "culprit-perturb")
    for step in range(PERTURB_STEP):
        assert stats[step]["divergent"] == "", step
    assert stats[PERTURB_STEP]["divergent"] == str(PERTURB_RANK)
    assert ranks[PERTURB_STEP][PERTURB_RANK]["replica_ok"] == 0
    by = ranks[PERTURB_STEP]
    assert len({by[r]["grad_fp"] for r in range(W) if r != PERTURB_RANK}) == 1
    # Later steps' reduced gradients agree again; the parameter checks report exactly what the
    # ground truth says (a one-ulp gradient error usually vanishes in the SGD update's rounding,
    # then the replicas are identical again and nothing may be reported).
    for step in range(PERTURB_STEP + 1, STEPS["perturb"]):
        expected = ",".join(map(str, truth[str(step)])) if str(step) in truth else ""
        assert stats[step]["divergent"] == expected, step


def test_corrupted_data_rank_is_the_worst_outlier(run):
    collector, _, _ = run
    ranks = rank_table(collector, "culprit-corrupt")
    after = [s for s in ranks if s >= CORRUPT_FROM]
    worst = [max(ranks[s], key=lambda r: ranks[s][r]["score"] or 0.0) for s in after]
    hits = sum(1 for w in worst if w == CORRUPT_RANK)
    before = [s for s in ranks if s < CORRUPT_FROM]
    worst_before = [max(ranks[s], key=lambda r: ranks[s][r]["score"] or 0.0) for s in before]
    print(
        f"corrupt: rank {CORRUPT_RANK} worst on {hits}/{len(after)} steps after "
        f"{CORRUPT_FROM}, {worst_before.count(CORRUPT_RANK)}/{len(before)} before"
    )
    assert hits >= 0.8 * len(after)
    stats = step_table(collector, "culprit-corrupt")
    flagged = sum(1 for s in after if str(CORRUPT_RANK) in stats[s]["outliers"].split(","))
    assert flagged >= 0.5 * len(after)


def test_straggler_is_named(run):
    collector, _, _ = run
    ranks = rank_table(collector, "culprit-straggler")
    steps = [s for s in ranks if s >= 1]
    worst = [max(ranks[s], key=lambda r: ranks[s][r]["time_z"] or -math.inf) for s in steps]
    hits = worst.count(STRAGGLER_RANK)
    slow = [ranks[s][STRAGGLER_RANK]["time"] for s in steps]
    print(
        f"straggler: rank {STRAGGLER_RANK} slowest on {hits}/{len(steps)} steps; median "
        f"step time {sorted(slow)[len(slow) // 2]:.3f} s"
    )
    assert hits >= 0.9 * len(steps)
    assert all(t >= STRAGGLER_SLEEP for t in slow)


def deviating(collector, job):
    """{step: {rank: [(bucket name, z)]}} of the rank rows that name deviating buckets, most
    deviating first (the collector's order)."""
    rows = collector.query(
        "SELECT step, rank, deviating_buckets FROM rank_steps WHERE job = ? "
        "AND deviating_buckets <> '' ORDER BY step, rank",
        (job,),
    )
    out = {}
    for step, rank, text in rows:
        named = []
        for part in text.split("; "):
            name, z = part.rsplit(" z=", 1)
            named.append((name, float(z)))
        out.setdefault(step, {})[rank] = named
    return out


def test_bucket_names_in_the_hello_are_the_model_layers(run):
    """The shim's parameter groups are named from the model's parameter names (one group per
    Linear here: its weight and bias), and those names reach the collector (the deviating text
    below is built from the hello's names)."""
    _, out, _ = run
    import json

    names = json.loads((out / "layer.buckets.json").read_text())
    modules = []
    for n, _ in Mlp().named_parameters():
        m = n.rsplit(".", 1)[0]
        if m not in modules:
            modules.append(m)
    assert names == modules == ["net.0", "net.2", "net.4"]


def test_one_corrupted_layer_names_its_bucket(run):
    collector, _, _ = run
    dev = deviating(collector, "culprit-layer")
    named = [s for s in range(LAYER_FROM, STEPS["layer"]) if LAYER_RANK in dev.get(s, {})]
    print(
        f"layer: rank {LAYER_RANK} named buckets on {len(named)} of "
        f"{STEPS['layer'] - LAYER_FROM} steps: {[dev[s][LAYER_RANK] for s in named][:3]}"
    )
    assert len(named) >= 0.8 * (STEPS["layer"] - LAYER_FROM)
    # The layer's bucket first, carrying the deviation: its |z| at least 10x any other bucket
    # named beside it (healthy noise at W = 4 puts a bucket above 6 now and then).
    for s in named:
        (first, z), *rest = dev[s][LAYER_RANK]
        assert first == "net.2", (s, dev[s][LAYER_RANK])
        assert all(abs(z) >= 10 * abs(other) for _, other in rest), (s, dev[s][LAYER_RANK])
    # Before the fault the rank carries no bucket deviation.
    assert not any(LAYER_RANK in dev.get(s, {}) for s in range(LAYER_FROM))
    # The per-bucket norms are kept for the flagged rows (4 bytes a bucket, and their z).
    blobs = collector.query(
        "SELECT length(bucket_norms), length(bucket_z) FROM rank_steps WHERE job = ? "
        "AND rank = ? AND step >= ?",
        ("culprit-layer", LAYER_RANK, LAYER_FROM),
    )
    assert sum(1 for b in blobs if b == (12, 12)) >= len(named)


def test_show_and_the_web_rank_panel_say_where(run):
    """`rankscope show` and the web view's rank series (the rank panel) name the layer's
    bucket."""
    import json
    import subprocess
    import urllib.request

    from conftest import CLI_BIN

    collector, out_dir, _ = run
    out = subprocess.run(
        [str(CLI_BIN), f"--collector={collector.address}", "show", "--job=culprit-layer"]
        + ["--once", "--limit=2", "--worst=4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"\nrank {LAYER_RANK}: net.2 z=" in out.stdout, out.stdout
    base = f"http://127.0.0.1:{collector.http_port}/api/v1/jobs/culprit-layer"
    last = STEPS["layer"] - 1
    with urllib.request.urlopen(f"{base}/ranks?rank={LAYER_RANK}&first={last}&last={last}") as r:
        series = json.load(r)
    assert series["steps"][0]["deviating_buckets"].startswith("net.2 z="), series
    # The report's line (rankscope.report.where_lines) from the job's export.
    from rankscope.report import load, where_lines

    export = subprocess.run(
        [str(CLI_BIN), f"--collector={collector.address}", "export", "--job=culprit-layer"]
        + ["--format=json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert export.returncode == 0, export.stderr
    path = out_dir / "layer.export.json"
    path.write_text(export.stdout)
    lines = where_lines(load(str(path)))
    assert lines[0].startswith(f"rank {LAYER_RANK} (step {last}): net.2 z="), lines


def test_data_fault_names_many_buckets(run):
    """Pure-noise targets move the whole gradient: the flagged rank's deviation is in most
    buckets, not one."""
    collector, _, _ = run
    dev = deviating(collector, "culprit-corrupt")
    named = [
        dev[s][CORRUPT_RANK] for s in sorted(dev) if s >= CORRUPT_FROM and CORRUPT_RANK in dev[s]
    ]
    print(f"corrupt: rank {CORRUPT_RANK} named buckets on {len(named)} steps: {named[:3]}")
    assert len(named) >= 0.5 * (STEPS["corrupt"] - CORRUPT_FROM)
    many = sum(1 for n in named if len(n) >= 2)  # of the 3 buckets
    assert many >= 0.8 * len(named)


def test_unflagged_rows_keep_no_bucket_norms(run):
    """Stored only where it matters: per-bucket norms are kept on the sampled steps (multiples
    of 100: step 0 here) and on the rows of ranks flagged for any reason, nowhere else."""
    collector, _, _ = run
    rows = collector.query(
        "SELECT r.step, r.rank, r.outlier_score, r.nonfinite, r.replica_ok, s.outlier_ranks, "
        "s.drifting_ranks, s.slow_ranks, r.bucket_norms IS NOT NULL FROM rank_steps r "
        "JOIN step_stats s ON s.job = r.job AND s.step = r.step WHERE r.job = ?",
        ("culprit-healthy",),
    )
    assert rows
    for step, rank, score, nonfinite, ok, outliers, drifting, slow, kept in rows:
        named = any(str(rank) in (x or "").split(",") for x in (outliers, drifting, slow))
        flagged = score is None or score > 6.0 or nonfinite or ok == 0 or named
        assert kept == (step == 0 or flagged), (step, rank)


def test_tolerance_check_passes_last_bit_differences_and_names_a_real_divergence(run):
    """replica_check="tolerance": rank 2's parameters, nudged in their last bit after step 12,
    differ bit for bit from the others at the checks of steps 20 and 30, and rank 1's reduced
    gradient on step 25 (their fingerprints differ: what the exact check names, as the nudge and
    perturb scenarios show); neither is named. Rank 1's layer scaled by 1 + 1e-3 after step 22
    is named at the check of step 30, and only rank 1."""
    collector, out, _ = run
    import json

    truth = json.loads((out / "tolerance.truth.json").read_text())
    assert ROUNDING_AFTER < DIVERGE_AFTER < PERTURB_STEP < 30
    first = (ROUNDING_AFTER // PARAM_CHECK_EVERY + 1) * PARAM_CHECK_EVERY
    second = (DIVERGE_AFTER // PARAM_CHECK_EVERY + 1) * PARAM_CHECK_EVERY
    assert truth[str(first)] == [ROUNDING_RANK], "the nudge must still be there at the check"
    assert truth[str(second)] == sorted([ROUNDING_RANK, DIVERGE_RANK])
    stats = step_table(collector, "culprit-tolerance")
    ranks = rank_table(collector, "culprit-tolerance")
    # The stored fingerprints show the bit difference the exact check would name.
    at_first = ranks[first]
    others = {at_first[r]["param_fp"] for r in range(W) if r != ROUNDING_RANK}
    assert len(others) == 1 and at_first[ROUNDING_RANK]["param_fp"] not in others
    # Rank 1's reduced gradient, one ulp off on step 25, is stored with its own fingerprint.
    at_perturb = ranks[PERTURB_STEP]
    others = {at_perturb[r]["grad_fp"] for r in range(W) if r != PERTURB_RANK}
    assert len(others) == 1 and at_perturb[PERTURB_RANK]["grad_fp"] not in others
    for step in range(second):
        assert stats[step]["divergent"] == "", step
        assert all(ranks[step][r]["replica_ok"] == 1 for r in range(W)), step
    assert stats[second]["divergent"] == str(DIVERGE_RANK)
    assert ranks[second][DIVERGE_RANK]["replica_ok"] == 0
    assert all(ranks[second][r]["replica_ok"] == 1 for r in range(W) if r != DIVERGE_RANK)
