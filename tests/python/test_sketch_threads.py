"""Sketching a CPU gradient on several threads (issue 16; rankscope/striped_sketch.h): real gloo
DDP ranks with a 404,010-parameter model (one bucket of 3 stripes' worth and more, so the bucket
is split over the threads) attached with sketch_threads=1 and sketch_threads=3 store bit-identical
gradient norms and cosines; the native sketch is bit-identical for 1 to 4 threads on buckets fed
as the comm hook feeds them; and the option's default and its errors."""

import sqlite3

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import shim_harness  # noqa: E402
from conftest import wait_until  # noqa: E402
from rankscope import _native  # noqa: E402
import rankscope.torch as rst  # noqa: E402

STEPS = 4
WORLD = 2


def threads_worker(rank, world_size, collector, job, threads):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 400), nn.Tanh(), nn.Linear(400, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mon = rst.attach(ddp, collector=collector, job=job, sketch_dim=1024, sketch_threads=threads)
    assert mon.sketch_threads == threads
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(16, 1000, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        mon.step(loss)
    mon.close(timeout=30)


def stored(db_path, job):
    with sqlite3.connect(db_path) as db:
        return db.execute(
            "SELECT step, rank, loss, grad_norm, grad_cosine FROM rank_steps "
            "WHERE job = ? ORDER BY step, rank",
            (job,),
        ).fetchall()


def test_ddp_reports_are_bit_identical_with_one_or_three_sketch_threads(collector):
    rows = {}
    for threads in (1, 3):
        job = f"threads-{threads}"
        shim_harness.spawn(threads_worker, WORLD, collector.address, job, threads)
        wait_until(
            lambda: len(stored(collector.db_path, job)) == STEPS * WORLD,
            30,
            f"{STEPS * WORLD} rank-steps of {job}",
        )
        rows[threads] = stored(collector.db_path, job)
    assert all(r[4] is not None and -1.0 <= r[4] <= 1.0 for r in rows[1]), rows[1]
    # Same training, same sketch bits: every stored float equal, not just close.
    assert rows[3] == rows[1]


def bucket(n_segments=9, seed=0):
    """Segments of a bucket as the comm hook feeds them: parameter views at their global
    offsets (not ascending), sizes from 1 to 300,007."""
    g = torch.Generator().manual_seed(seed)
    sizes = [300_007, 1, 65_536, 17, 131_073, 4_099, 1_000, 250_000, 7][:n_segments]
    tensors = [torch.randn(n, generator=g) for n in sizes]
    offsets, total = [], 5
    for t in reversed(tensors):
        offsets.insert(0, total)
        total += t.numel()
    return tensors, offsets


def kernel_bins(sketch):
    out = torch.empty(sketch.dim, dtype=torch.float64)
    sketch.copy_bins_to(out.data_ptr())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_sketch_is_bit_identical_for_any_thread_count(dtype):
    tensors, offsets = bucket()
    tensors = [t.to(dtype) for t in tensors]
    code = {
        torch.float32: _native.DTYPE_FLOAT32,
        torch.bfloat16: _native.DTYPE_BFLOAT16,
        torch.float16: _native.DTYPE_FLOAT16,
    }[dtype]
    results = []
    for threads in (1, 2, 3, 4):
        s = _native.Sketch(1000, threads=threads)
        assert s.threads == threads
        assert (
            s.add_many([t.data_ptr() for t in tensors], [t.numel() for t in tensors], offsets, code)
            == ""
        )
        results.append((kernel_bins(s), s.sum_squares()))
    for bins, ss in results[1:]:
        assert torch.equal(bins.view(torch.int64), results[0][0].view(torch.int64))
        assert ss == results[0][1]
    # sketch.h "Rounding": squares summed in float partials of at most 32 terms, then in double.
    exact = sum(float(t.double().square().sum()) for t in tensors)
    assert results[0][1] == pytest.approx(exact, rel=33 * 2.0**-24)


def test_default_sketch_threads_and_bad_values(monkeypatch):
    monkeypatch.setenv("RANKSCOPE_SKETCH_THREADS", "3")
    assert rst.default_sketch_threads() == 3
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("RANKSCOPE_SKETCH_THREADS", bad)
        with pytest.raises(ValueError, match="RANKSCOPE_SKETCH_THREADS"):
            rst.default_sketch_threads()
    monkeypatch.delenv("RANKSCOPE_SKETCH_THREADS")
    import os

    free = len(os.sched_getaffinity(0)) - torch.get_num_threads()
    assert rst.default_sketch_threads() == max(1, min(rst.MAX_DEFAULT_SKETCH_THREADS, free))
    with pytest.raises(ValueError, match="threads must be in"):
        _native.Sketch(64, threads=0)
