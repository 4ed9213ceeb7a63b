"""Trainers that reduce gradients themselves (``rankscope.torch.attach_reducer``), on real gloo
processes, the real shim and the real collector: a trainer that all-reduces one flat gradient
buffer per step, as Megatron-core's DDP does, reports the same per-rank values as the same model
and data under torch's DDP.

Two ranks: with two addends the all-reduce's sum is exact in any order, so the reduced gradients,
their fingerprints and the parameters are bit-identical between the two runs.
"""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native")

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from shim_harness import spawn, write_json  # noqa: E402

STEPS = 8


def model():
    torch.manual_seed(21)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 3))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 10, generator=g), torch.randn(16, 3, generator=g)


def ddp_worker(rank, world_size, collector, out_dir):
    import rankscope.torch as rst

    ddp = nn.parallel.DistributedDataParallel(model())
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = rst.attach(ddp, collector=collector, job="reduce-ddp", sketch_dim=64, param_check_every=1)
    for step in range(STEPS):
        x, y = batch(rank, step)
        sgd.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        sgd.step()
        mon.step(loss)
    write_json(Path(out_dir) / f"ddp.rank{rank}.json", mon.close(timeout=30))


def hand_worker(rank, world_size, collector, out_dir):
    """All-reduces one flat buffer of every gradient (averaged), then steps: no DDP."""
    import rankscope.torch as rst

    net = model()
    for p in net.parameters():  # DDP's initial broadcast, by hand
        dist.broadcast(p.data, 0)
    params = [p for p in net.parameters() if p.requires_grad]
    sgd = torch.optim.SGD(params, lr=0.1)
    mon = rst.attach_reducer(
        net, collector=collector, job="reduce-hand", sketch_dim=64, param_check_every=1
    )
    for step in range(STEPS):
        x, y = batch(rank, step)
        sgd.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        mon.local_gradient(flat, params)
        flat.div_(world_size)
        dist.all_reduce(flat)
        mon.reduced_gradient(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        sgd.step()
        mon.step(loss)
    write_json(Path(out_dir) / f"hand.rank{rank}.json", mon.close(timeout=30))


@pytest.fixture(scope="module")
def runs(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("reducer")
    spawn(ddp_worker, 2, module_collector.address, str(out), timeout=180)
    spawn(hand_worker, 2, module_collector.address, str(out), timeout=180)
    return module_collector, out


COLUMNS = (
    "step, rank, loss, grad_norm, grad_cosine, reduced_grad_fingerprint, "
    "param_fingerprint, replica_ok"
)


def test_the_hand_reduced_trainer_reports_what_ddp_reports(runs):
    collector, out = runs
    for name in ("ddp", "hand"):
        for rank in range(2):
            stats = json.loads((Path(out) / f"{name}.rank{rank}.json").read_text())
            assert stats["acked"] == STEPS and stats["rejected"] == 0, (name, stats)
    sql = f"SELECT {COLUMNS} FROM rank_steps WHERE job = ? ORDER BY step, rank"
    ddp = collector.query(sql, ("reduce-ddp",))
    hand = collector.query(sql, ("reduce-hand",))
    assert len(ddp) == len(hand) == 2 * STEPS
    for a, b in zip(ddp, hand):
        assert a[:2] == b[:2]
        assert b[2] == pytest.approx(a[2], rel=1e-6)  # loss
        assert b[3] == pytest.approx(a[3], rel=1e-6)  # local gradient norm
        assert b[4] == pytest.approx(a[4], rel=1e-5, abs=1e-6)  # consensus cosine
        assert b[5] is not None and b[5] == a[5], a[:2]  # reduced-gradient fingerprint
        assert b[6] is not None and b[6] == a[6], a[:2]  # parameter fingerprint
        assert b[7] == a[7] == 1
