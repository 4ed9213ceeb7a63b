"""Ranks that train on the same data, in real DDP runs: gloo ranks, the real shim, the real
collector. Each scenario is its own job; the tests read `step_stats.duplicate_groups` from SQLite.

4 ranks:
  same       every rank reads the same batches (no DistributedSampler);
  pair       rank 3 reads rank 1's batches (a shard list that repeats);
  alternate  every rank reads the same batches in odd epochs only (EPOCH steps each), as a
             forgotten set_epoch with a per-epoch reseed does;
  augment    every rank reads the same images, each with its own random augmentation (noise and
             a random crop of features): high cosines, not duplicates;
  clean      every rank its own batches, from step 0 (early steps, where cosines run highest).
2 ranks: clean and same (W = 2). 8 ranks: ranks 2 and 5 read the same batches.
"""

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native")

import torch.nn as nn  # noqa: E402

from shim_harness import spawn, write_json  # noqa: E402

STEPS = 16
EPOCH = 4


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 4))

    def forward(self, x):
        return self.net(x)


def data(source, step, bsz=32):
    """Batch number `step` of data source `source` (a rank's shard)."""
    g = torch.Generator().manual_seed(10_000 * step + source)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(bsz, 16, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(bsz, 4, generator=g)
    return x, y


def augment(x, rank, step):
    """A rank's own random augmentation of the same images: small noise, one feature dropped."""
    g = torch.Generator().manual_seed(7 + 1000 * step + rank)
    x = x + 0.3 * torch.randn(x.shape, generator=g)
    keep = torch.ones(x.shape[1])
    keep[int(torch.randint(0, x.shape[1], (1,), generator=g))] = 0.0
    return x * keep


def source_of(name, rank, step):
    if name == "same":
        return 0
    if name == "pair":
        return 1 if rank == 3 else rank
    if name == "alternate":
        return 0 if (step // EPOCH) % 2 == 1 else rank
    if name == "eight":
        return 2 if rank == 5 else rank
    return 0 if name == "augment" else rank  # augment: the same images, augmented below


def duplicates_worker(rank, world_size, collector, job_prefix, names, out_dir):
    import rankscope.torch as rst

    for name in names:
        torch.manual_seed(11)
        ddp = nn.parallel.DistributedDataParallel(Mlp())
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
        mon = rst.attach(ddp, collector=collector, job=f"{job_prefix}-{name}", sketch_dim=256)
        for step in range(STEPS):
            x, y = data(source_of(name, rank, step), step)
            if name == "augment":
                x = augment(x, rank, step)
            sgd.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            sgd.step()
            mon.step(loss)
        stats = mon.close(timeout=30)
        write_json(Path(out_dir) / f"{job_prefix}-{name}.rank{rank}.json", stats)


@pytest.fixture(scope="module")
def runs(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("duplicates")
    t0 = time.monotonic()
    spawn(
        duplicates_worker,
        4,
        module_collector.address,
        "dup4",
        ["same", "pair", "alternate", "augment", "clean"],
        str(out),
        timeout=300,
    )
    spawn(
        duplicates_worker,
        2,
        module_collector.address,
        "dup2",
        ["clean", "same"],
        str(out),
        timeout=300,
    )
    spawn(duplicates_worker, 8, module_collector.address, "dup8", ["eight"], str(out), timeout=300)
    print(f"duplicate-data DDP runs took {time.monotonic() - t0:.1f} s")
    return module_collector


def groups(collector, job):
    rows = collector.query(
        "SELECT step, ranks, duplicate_groups, grad_cosine_mean FROM "
        "step_stats WHERE job = ? ORDER BY step",
        (job,),
    )
    assert [r[0] for r in rows] == list(range(STEPS)), job
    return {step: (ranks, dup or "", cos) for step, ranks, dup, cos in rows}


def test_every_rank_on_the_same_data(runs):
    for job, expected in (("dup4-same", "0,1,2,3"), ("dup2-same", "0,1")):
        for step, (ranks, dup, _cos) in groups(runs, job).items():
            assert (ranks, dup) == (int(job[3]), expected), (job, step)


def test_two_ranks_on_the_same_shard(runs):
    assert {dup for _, dup, _ in groups(runs, "dup4-pair").values()} == {"1,3"}
    assert {dup for _, dup, _ in groups(runs, "dup8-eight").values()} == {"2,5"}


def test_duplicated_every_other_epoch(runs):
    for step, (_, dup, _) in groups(runs, "dup4-alternate").items():
        assert dup == ("0,1,2,3" if (step // EPOCH) % 2 == 1 else ""), step


def test_healthy_jobs_have_no_duplicates(runs):
    for job in ("dup4-clean", "dup2-clean"):
        assert all(dup == "" for _, dup, _ in groups(runs, job).values()), job


def test_augmented_views_of_the_same_images_are_not_duplicates(runs):
    table = groups(runs, "dup4-augment")
    assert all(dup == "" for _, dup, _ in table.values())
    # ... although the ranks' gradients do point the same way: the test means something.
    mean_cos = sum(cos for _, _, cos in table.values()) / len(table)
    clean = groups(runs, "dup4-clean")
    assert mean_cos > sum(cos for _, _, cos in clean.values()) / len(clean)
    print(f"augment: mean direction consistency {mean_cos:.3f}")


def test_duplicate_metrics_exported(runs):
    assert runs.metric("rankscope_duplicate_steps_total", train_job="dup4-same") == STEPS
    assert runs.metric("rankscope_duplicate_steps_total", train_job="dup4-alternate") == sum(
        1 for s in range(STEPS) if (s // EPOCH) % 2 == 1
    )
    assert runs.metric("rankscope_duplicate_steps_total", train_job="dup4-clean") == 0
    assert runs.metric("rankscope_duplicate_ranks", train_job="dup4-pair") == 2
