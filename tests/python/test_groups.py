"""Who a rank is (docs/DESIGN.md "Who a rank is"), on real gloo DDP processes, the real shim and
the real collector: data-parallel groups, two models in one process, two runs with one job name,
a resume with no restart counter and an elastic resize.

  megatron   8 ranks as 2 model shards x 4 data-parallel ranks, laid out as Megatron does with
             tensor parallelism 2 (the data-parallel groups are the even and the odd global
             ranks); each shard its own parameters and its DDP on its own real subgroup. Global
             rank 5 (rank 2 of group dp1) trains on 100 % label noise from NOISE_ONSET; global
             rank 2 (rank 1 of group dp0) has one parameter nudged by one ulp at NUDGE_STEP.
  pipeline   4 ranks as 2 pipeline stages x 2 data-parallel ranks: only the last stage has a
             loss; the first reports gradients only (mon.step() without a loss).
  gan        two DDP models in one process (a generator and a discriminator): one job name
             without groups is refused at attach; with group= each is its own group.
  resume     2 ranks run steps 0..7, then new processes resume at step 4 with other data and no
             restart counter: their values replace the first run's for steps 4..7.
  elastic    4 ranks run steps 0..5, then 2 new processes run steps 6..11: watched, exact.
"""

import json
import math
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native")

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from conftest import CLI_BIN  # noqa: E402
from shim_harness import spawn, write_json  # noqa: E402

STEPS = 24
NOISE_ONSET = 4
NUDGE_STEP = 10
CLASSES = 6
PIPE_STEPS = 8


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, CLASSES))

    def forward(self, x):
        return self.net(x)


def batch(source, step, noisy=False, bsz=32):
    """A separable classification batch of data source `source`; `noisy`: random labels."""
    g = torch.Generator().manual_seed(10_000 * step + source)
    w = torch.randn(12, CLASSES, generator=torch.Generator().manual_seed(3))
    x = torch.randn(bsz, 12, generator=g)
    y = (x @ w).argmax(dim=1)
    if noisy:
        y = torch.randint(0, CLASSES, (bsz,), generator=g)
    return x, y


def megatron_worker(rank, world_size, collector, out_dir):
    import rankscope.torch as rst

    tp = 2
    # Megatron's default order (tp-cp-ep-dp-pp) with tensor parallelism 2: the data-parallel
    # groups are the ranks with the same tensor-parallel index, i.e. the even and the odd ranks.
    groups = [dist.new_group(list(range(shard, world_size, tp))) for shard in range(tp)]
    shard = rank % tp
    torch.manual_seed(100 + shard)  # the two shards hold different parameters
    ddp = nn.parallel.DistributedDataParallel(Classifier(), process_group=groups[shard])
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = rst.attach(ddp, collector=collector, job="megatron", sketch_dim=256, param_check_every=1)
    for step in range(STEPS):
        x, y = batch(rank, step, noisy=(rank == 5 and step >= NOISE_ONSET))
        sgd.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        sgd.step()
        if rank == 2 and step == NUDGE_STEP:
            with torch.no_grad():
                w = ddp.module.net[0].weight.view(-1)
                w[0] = torch.nextafter(w[0], torch.tensor(math.inf))
        mon.step(loss)
    write_json(
        Path(out_dir) / f"megatron.rank{rank}.json",
        {"group": mon.group, "rank": mon.rank, "stats": mon.close(timeout=30)},
    )


def gan_worker(rank, world_size, collector, out_dir):
    import rankscope.torch as rst

    torch.manual_seed(7)
    gen = nn.parallel.DistributedDataParallel(nn.Linear(8, 12))
    disc = nn.parallel.DistributedDataParallel(Classifier())
    mon_g = rst.attach(gen, collector=collector, job="gan", sketch_dim=128)
    refusal = ""
    try:
        rst.attach(disc, collector=collector, job="gan", sketch_dim=128)
    except ValueError as e:
        refusal = str(e)
    mon_g.close(timeout=5)
    # A DDP model takes one comm hook, registered once: the named groups on two fresh models.
    gen = nn.parallel.DistributedDataParallel(nn.Linear(8, 12))
    disc = nn.parallel.DistributedDataParallel(Classifier())
    mon_g = rst.attach(gen, collector=collector, job="gan-named", sketch_dim=128, group="generator")
    mon_d = rst.attach(
        disc, collector=collector, job="gan-named", sketch_dim=128, group="discriminator"
    )
    opt = torch.optim.SGD(list(gen.parameters()) + list(disc.parameters()), lr=0.05)
    for step in range(6):
        z = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        opt.zero_grad(set_to_none=True)
        fake = gen(z)
        d_loss = disc(fake.detach()).logsumexp(dim=1).mean()
        d_loss.backward()
        g_loss = -disc(fake).logsumexp(dim=1).mean()
        g_loss.backward()
        opt.step()
        mon_d.step(d_loss)
        mon_g.step(g_loss)
    write_json(
        Path(out_dir) / f"gan.rank{rank}.json",
        {"refusal": refusal, "g": mon_g.close(timeout=30), "d": mon_d.close(timeout=30)},
    )


def pipeline_worker(rank, world_size, collector, out_dir):
    """4 ranks, pipeline parallelism 2 x data parallelism 2: stage 0 (global ranks 0, 1) has no
    loss (it would hand activations on), stage 1 (ranks 2, 3) has one. Each stage's own model
    under DDP on its data-parallel group; only the last stage passes a loss to mon.step."""
    import rankscope.torch as rst

    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage = rank // 2
    torch.manual_seed(40 + stage)
    ddp = nn.parallel.DistributedDataParallel(Classifier(), process_group=stages[stage])
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = rst.attach(ddp, collector=collector, job="pipeline", sketch_dim=128)
    for step in range(PIPE_STEPS):
        x, y = batch(rank, step)
        sgd.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        sgd.step()
        mon.step(loss if stage == 1 else None)
    write_json(Path(out_dir) / f"pipeline.rank{rank}.json", mon.close(timeout=30))


def run_worker(rank, world_size, collector, job, first_step, steps, data_seed, out_dir, tag):
    """`steps` steps from `first_step` on data `data_seed`; writes the losses it reported."""
    import rankscope.torch as rst

    torch.manual_seed(5)
    ddp = nn.parallel.DistributedDataParallel(Classifier())
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = rst.attach(ddp, collector=collector, job=job, sketch_dim=128, start_step=first_step)
    losses = {}
    for step in range(first_step, first_step + steps):
        x, y = batch(data_seed + rank, step)
        sgd.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        sgd.step()
        mon.step(loss)
        losses[step] = float(loss)
    write_json(
        Path(out_dir) / f"{tag}.rank{rank}.json", {"losses": losses, "stats": mon.close(timeout=30)}
    )


def read(out_dir, tag, world_size):
    return [
        json.loads((Path(out_dir) / f"{tag}.rank{r}.json").read_text()) for r in range(world_size)
    ]


@pytest.fixture(scope="module")
def runs(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("groups")
    t0 = time.monotonic()
    addr = module_collector.address
    spawn(megatron_worker, 8, addr, str(out), timeout=300)
    spawn(gan_worker, 2, addr, str(out), timeout=180)
    spawn(pipeline_worker, 4, addr, str(out), timeout=180)
    spawn(run_worker, 2, addr, "resume", 0, 8, 0, str(out), "resume-a", timeout=180)
    spawn(run_worker, 2, addr, "resume", 4, 8, 500, str(out), "resume-b", timeout=180)
    spawn(run_worker, 4, addr, "elastic", 0, 6, 0, str(out), "elastic-a", timeout=180)
    spawn(run_worker, 2, addr, "elastic", 6, 6, 0, str(out), "elastic-b", timeout=180)
    print(f"group DDP runs took {time.monotonic() - t0:.1f} s")
    return module_collector, out


def flags(collector, job, column):
    rows = collector.query(
        f"SELECT step, ranks, {column} FROM step_stats WHERE job = ? ORDER BY step", (job,)
    )
    assert [r[0] for r in rows] == list(range(STEPS)), job
    assert all(r[1] == 4 for r in rows), job  # every step joined all 4 ranks of the group
    return {step: text for step, _, text in rows}


def test_megatron_groups_are_joined_apart(runs):
    collector, out = runs
    for worker in read(out, "megatron", 8):
        assert worker["stats"]["acked"] == STEPS and worker["stats"]["rejected"] == 0
    # Each group its own rows: nothing of one group overwrote the other's.
    for job in ("megatron/dp0", "megatron/dp1"):
        assert (
            collector.query("SELECT count(*) FROM rank_steps WHERE job = ?", (job,))[0][0]
            == 4 * STEPS
        )
    assert collector.query("SELECT count(*) FROM step_stats WHERE job = 'megatron'") == [(0,)]
    # Who is who: group rank, global rank and host of every rank.
    who = collector.query(
        "SELECT job, rank, global_rank, host FROM rank_identities WHERE job "
        "LIKE 'megatron/%' ORDER BY global_rank"
    )
    host = socket.gethostname()
    assert who == [(f"megatron/dp{g % 2}", g // 2, g, host) for g in range(8)]


def test_label_noise_is_named_in_its_group_only(runs):
    collector, _ = runs
    noisy = flags(collector, "megatron/dp1", "outlier_ranks")
    named = [s for s, text in noisy.items() if text]
    assert named and min(named) >= NOISE_ONSET, noisy
    assert {noisy[s] for s in named} == {"2"}  # global rank 5 is rank 2 of dp1
    clean = flags(collector, "megatron/dp0", "outlier_ranks")
    assert all(text == "" for text in clean.values()), clean


def test_the_cli_names_the_least_consistent_group(runs):
    """`rankscope groups`: the groups side by side, the noisy group the least consistent."""
    collector, _ = runs
    out = subprocess.run(
        [
            str(CLI_BIN),
            f"--collector={collector.address}",
            "--job=megatron",
            f"--limit={STEPS}",
            "groups",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "job megatron: 2 groups" in out.stdout, out.stdout
    assert re.search(r"^dp0 +\|", out.stdout, re.M) and re.search(r"^dp1 +\|", out.stdout, re.M)
    assert "least consistent group: dp1" in out.stdout, out.stdout


def test_ulp_nudge_is_named_in_its_group_only(runs):
    collector, _ = runs
    divergent = flags(collector, "megatron/dp0", "replica_divergent_ranks")
    assert divergent[NUDGE_STEP] == "1"  # global rank 2 is rank 1 of dp0
    assert all(divergent[s] == "" for s in range(NUDGE_STEP)), divergent
    other = flags(collector, "megatron/dp1", "replica_divergent_ranks")
    assert all(text == "" for text in other.values()), other


def test_a_pipeline_stage_without_loss_reports_gradients_only(runs):
    collector, out = runs
    for rank in range(4):
        stats = json.loads((Path(out) / f"pipeline.rank{rank}.json").read_text())
        assert stats["acked"] == PIPE_STEPS and stats["rejected"] == 0, stats
    cols = "step, ranks, loss_mean, loss_std, grad_norm_mean, grad_cosine_mean, outlier_ranks"
    first = collector.query(
        f"SELECT {cols} FROM step_stats WHERE job = 'pipeline/dp0' ORDER BY step"
    )
    last = collector.query(
        f"SELECT {cols} FROM step_stats WHERE job = 'pipeline/dp2' ORDER BY step"
    )
    assert [r[0] for r in first] == [r[0] for r in last] == list(range(PIPE_STEPS))
    for row in first:  # no loss: loss statistics absent, gradients watched, nothing flagged
        assert row[1] == 2 and row[2] is None and row[3] is None, row
        assert row[4] > 0 and row[5] is not None and row[6] == "", row
    for row in last:
        assert row[1] == 2 and row[2] > 0 and row[3] is not None and row[6] == "", row
    assert collector.query(
        "SELECT count(*) FROM rank_steps WHERE job = 'pipeline/dp0' AND "
        "(loss IS NOT NULL OR nonfinite != 0)"
    ) == [(0,)]
    assert collector.metric("rankscope_steps_nonfinite_total", train_job="pipeline") == 0


def test_two_models_in_one_process(runs):
    collector, out = runs
    for worker in read(out, "gan", 2):
        assert "group=" in worker["refusal"], worker["refusal"]
        assert worker["g"]["acked"] == 6 and worker["d"]["acked"] == 6
    for job in ("gan-named/generator", "gan-named/discriminator"):
        rows = collector.query(
            "SELECT step, ranks FROM step_stats WHERE job = ? ORDER BY step", (job,)
        )
        assert rows == [(s, 2) for s in range(6)], job
    # The two models' gradients were never mixed: their sketches differ in norm and shape.
    g = collector.query("SELECT grad_norm FROM rank_steps WHERE job = 'gan-named/generator'")
    d = collector.query("SELECT grad_norm FROM rank_steps WHERE job = 'gan-named/discriminator'")
    assert len(g) == len(d) == 12


def test_a_resume_without_restart_counter_replaces_the_overlap(runs):
    collector, out = runs
    first = read(out, "resume-a", 2)
    second = read(out, "resume-b", 2)
    for worker in first + second:
        assert worker["stats"]["acked"] == 8 and worker["stats"]["rejected"] == 0
    stored = {(step, rank): loss for step, rank, loss, *_ in collector.rank_rows("resume")}
    assert sorted({s for s, _ in stored}) == list(range(12))
    for rank in range(2):
        for step in range(12):
            source = second if step >= 4 else first
            want = source[rank]["losses"][str(step)]
            assert stored[(step, rank)] == pytest.approx(want, rel=1e-6), (step, rank)
    # The overlap's statistics are the second run's too.
    steps = collector.step_rows("resume")
    for step in range(4, 12):
        mean = sum(w["losses"][str(step)] for w in second) / 2
        assert steps[step]["loss_mean"] == pytest.approx(mean, rel=1e-6)


def test_an_elastic_shrink_is_watched_after_the_resize(runs):
    collector, out = runs
    before = read(out, "elastic-a", 4)
    after = read(out, "elastic-b", 2)
    for worker in before + after:
        assert worker["stats"]["acked"] == 6 and worker["stats"]["rejected"] == 0
    steps = collector.step_rows("elastic")
    assert sorted(steps) == list(range(12))
    for step in range(12):
        workers = before if step < 6 else after
        losses = [w["losses"][str(step)] for w in workers]
        row = steps[step]
        assert (row["ranks"], row["timed_out"], row["missing_ranks"]) == (len(workers), 0, "")
        mean = sum(losses) / len(losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in losses) / len(losses))
        assert row["loss_mean"] == pytest.approx(mean, rel=1e-6)
        assert row["loss_std"] == pytest.approx(std, rel=1e-5, abs=1e-9)
    assert collector.query("SELECT world_size FROM jobs WHERE job = 'elastic'") == [(2,)]


def test_a_second_run_with_the_same_job_name_is_refused(collector):
    """Two live processes claim rank 0 of one job: the second is refused with a message naming
    the holder (stats: held_elsewhere), and nothing of it is stored while the holder lives; it is
    not refused for good (it keeps its reports and retries, docs/reliability.md section 9)."""
    from rankscope import _native

    first = _native.Agent(
        collector=collector.address, job="twice", rank=0, world_size=1, sketch_dim=8
    )
    sketch = _native.Sketch(8)
    assert first.record_sketch(step=1, loss=1.0, grad_norm=1.0, sketch=sketch) == ""
    assert first.flush(10.0) == "" and first.stats()["acked"] == 1  # it holds rank 0 now
    second = _native.Agent(
        collector=collector.address, job="twice", rank=0, world_size=1, sketch_dim=8
    )
    # Refused at its hello: whether this report is still queued or already refused is a race.
    second.record_sketch(step=1, loss=2.0, grad_norm=2.0, sketch=sketch)
    deadline = time.monotonic() + 30
    while not second.stats()["held_elsewhere"]:
        assert time.monotonic() < deadline, second.stats()
        time.sleep(0.05)
    err = second.stats()["last_error"]
    assert "ALREADY_EXISTS" in err and f"pid {os.getpid()}" in err, err
    assert not second.stats()["refused"]
    assert second.record_sketch(step=2, loss=2.0, grad_norm=2.0, sketch=sketch) == ""  # kept
    assert [r[:4] for r in collector.rank_rows("twice")] == [(1, 0, 1.0, 1.0)]
    assert "refused a stream of job twice" in collector.log()
    first.close(5.0)
    second.close(0.0)
