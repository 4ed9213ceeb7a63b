"""What the shim sends for replica checks, against independently computed values: one gloo rank
in this process, a real collector, several DDP buckets, both the C++ and the torch-op paths."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native")

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from conftest import free_port  # noqa: E402


@pytest.fixture
def one_rank():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def model():
    torch.manual_seed(3)
    m = nn.Sequential(
        nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 2)
    )
    m[0].bias.requires_grad_(False)  # frozen: in the parameter fingerprint, not the gradient's
    return m


@pytest.mark.parametrize("torch_path", [False, True])
def test_sent_fingerprints_equal_the_definition(one_rank, collector, torch_path):
    import rankscope.torch as rst
    from rankscope import fingerprint as fp

    first = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = 64 * 1024
    try:
        ddp = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=0.2)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = first
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    job = f"sent-{int(torch_path)}"
    mon = rst.attach(ddp, collector=collector.address, job=job, sketch_dim=64, param_check_every=2)
    mon._bypass_native = torch_path
    expected = {}
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        sgd.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        # W = 1: the reduced gradient is the local one; flat order = named_parameters() with
        # requires_grad (the sketch's order).
        grads = [p.grad for p in ddp.module.parameters() if p.requires_grad]
        gfp = fp.to_uint64(fp.fold(torch.cat([t.reshape(-1) for t in grads]), 0))
        sgd.step()
        mon.step(loss)
        pfp = fp.to_uint64(fp.fold_parameters(list(ddp.module.parameters())))
        expected[step] = (gfp, pfp if step % 2 == 0 else None)
    assert mon.counters["reported"] == 5
    assert mon.counters["planned_buckets"] > 0 or torch_path  # final buckets were cached
    assert mon.flush(timeout=20)
    rows = collector.query(
        "SELECT step, reduced_grad_fingerprint, param_fingerprint, "
        "step_time_seconds, replica_ok FROM rank_steps WHERE job = ? "
        "ORDER BY step",
        (job,),
    )
    assert [r[0] for r in rows] == list(range(5))
    for step, gfp, pfp, st, ok in rows:
        assert gfp & (2**64 - 1) == expected[step][0], step
        assert (None if pfp is None else pfp & (2**64 - 1)) == expected[step][1], step
        assert st is not None and st >= 0
        assert ok == 1
    assert mon.stats()["shim_param_checks"] == 3
    mon.close(timeout=0)
