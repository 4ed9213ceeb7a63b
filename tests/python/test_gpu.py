"""The shim's GPU path on a real CUDA GPU (skipped where there is none: CI has none; run
tools/gpu/run_checks.sh on a GPU machine).

* exact: 2 DDP ranks sharing the one GPU (gloo with CUDA tensors), the real shim and the real
  collector; float32, bf16 autocast and bf16 gradients, each with the three GPU sketch paths
  (KERNELS: Triton on the tensor cores, Triton with atomic adds, torch ops): loss and grad-norm
  dispersion equal to the ranks' own exact values, direction consistency within the ideal count
  sketch's bound (the CPU truth tests' checks, shim_harness.check_exact_rows); the aggregation
  check's reduced sketch, computed on the device, sent every step and clean.
* nudge: 3 ranks; healthy ranks' replica fingerprints are equal; a one-ulp nudge of one rank's
  parameters is named at the next parameter check, and only that rank.
* no synchronization: one rank with NCCL, every step (forward, backward, optimizer step,
  mon.step; reporting, skipped (every=2) and parameter-check steps) under
  torch.cuda.set_sync_debug_mode("error"), which raises on any synchronizing CUDA call; the
  step's host side also returns while a long kernel queued before it is still running (an event
  recorded after that kernel has not completed: nothing in the step waited for the device), and
  the host buffers of pending reports are pinned.
* the CUDA C++ sketch kernel (trainer_shim/cuda/sketch.cu, the opt-in ``cuda`` backend): its
  bins, bin for bin, equal the torch-op path's within the float32 summation bound, and its sum of
  squares equals theirs, for float32, bfloat16 and float16 values at dims 1,024 and 4,096 (and
  dim 1,000), through the 16-byte path and the element-by-element one (misaligned pointers,
  offsets within a hash block, partial tiles) and the piece-table kernel over a bucket's
  segments, launched strictly (no fallback hides a failure).
* CUDA graphs: one NCCL rank whose DDP forward and backward are captured into a CUDA graph
  (PyTorch's whole-network recipe: side stream, 11 eager warm-up steps) and replayed: the hook
  chains the captured buckets without sketching (rankscope's kernels would replay into freed
  buffers), the captured step and the replays are not reported, the eager steps before and after
  are, and the parameters after the replays equal, bit for bit, those of the same run without
  rankscope.
"""

import copy
import json
import math
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU (tools/gpu/run_checks.sh on a GPU machine)", allow_module_level=True
    )

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import shim_harness as H  # noqa: E402

WORLD = 2
STEPS = 6
SKETCH_DIM = 1024
# name -> (model dtype, autocast dtype)
MODES = {
    "f32": (torch.float32, None),
    "autocast": (torch.float32, torch.bfloat16),
    "bf16": (torch.bfloat16, None),
}
# The GPU kernels: Triton with the tensor cores (the default for 16-bit gradients at dims 512 ..
# 4,096), Triton with one atomic add a value, and the torch ops (the fallback, as CI runs it on
# CPU).
KERNELS = {
    "dot": {"RANKSCOPE_GPU_SKETCH": "dot"},
    "atomic": {"RANKSCOPE_GPU_SKETCH": "atomic"},
    "torch": {"RANKSCOPE_GPU_KERNELS": "torch"},
}


def _use_kernels(name):
    for k in ("RANKSCOPE_GPU_KERNELS", "RANKSCOPE_GPU_SKETCH"):
        os.environ.pop(k, None)
    os.environ.update(KERNELS[name])


PARAM_CHECK_EVERY = 4
NUDGE_WORLD = 3  # a strict majority names the nudged rank (with 2, both are named)
NUDGE_AFTER, NUDGE_RANK = 5, 1


def _deterministic():
    """The math attention kernels: the fused ones' backward may add in any order, and the
    reference replica must compute the same gradient as the DDP rank, bit for bit."""
    torch.cuda.set_device(0)
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        if hasattr(torch.backends.cuda, name):
            getattr(torch.backends.cuda, name)(False)


def _ddp(model, bf16):
    kwargs = {"device_ids": [0]}
    if bf16:
        # Every rank built the same weights from the same seed; gloo's broadcast of bfloat16
        # is not needed (and not in every torch).
        kwargs["broadcast_buffers"] = False
        if "init_sync" in nn.parallel.DistributedDataParallel.__init__.__code__.co_varnames:
            kwargs["init_sync"] = False
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def _loss(model, x, y, autocast):
    if autocast is None:
        return H.lm_loss(model, x, y)
    with torch.autocast("cuda", dtype=autocast):
        return H.lm_loss(model, x, y)


def exact_worker(rank, world_size, collector, out_dir):
    import rankscope.torch as rst
    from rankscope import DEFAULT_SKETCH_SEED

    dev = torch.device("cuda", 0)
    _deterministic()
    out_dir = Path(out_dir)
    for mode, (dtype, autocast) in MODES.items():
        for kernels in KERNELS:
            _use_kernels(kernels)
            name = f"{mode}-{kernels}"
            torch.manual_seed(7)
            model = H.TinyLM().to(dev, dtype)
            ref = copy.deepcopy(model)
            bf16 = dtype == torch.bfloat16
            ddp = _ddp(model, bf16)
            chain = {"comm_hook": H.fp32_allreduce_hook, "comm_hook_state": None} if bf16 else {}
            sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
            mon = rst.attach(
                ddp, collector=collector, job=f"gpu-{name}", sketch_dim=SKETCH_DIM, **chain
            )
            expected = {}
            for step in range(STEPS):
                ref.load_state_dict(ddp.module.state_dict())
                ref.zero_grad(set_to_none=True)
                x, y = (t.to(dev) for t in H.batch(rank, step))
                ref_loss = _loss(ref, x, y, autocast)
                ref_loss.backward()
                g = H.flat_grad(ref).cpu()

                sgd.zero_grad(set_to_none=True)
                loss = _loss(ddp, x, y, autocast)
                loss.backward()
                sgd.step()
                mon.step(loss)

                gathered = [torch.zeros_like(g) for _ in range(world_size)]
                dist.all_gather(gathered, g)
                losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
                dist.all_gather(losses, ref_loss.detach().double().reshape(1).cpu())
                if rank == 0:
                    expected[step] = H.exact_step_stats(
                        [float(v) for v in losses], gathered, SKETCH_DIM, DEFAULT_SKETCH_SEED
                    )
            stats = mon.close(timeout=30)
            from rankscope import _backend

            H.write_json(
                out_dir / f"{name}.rank{rank}.json",
                {
                    "stats": stats,
                    "dot_failed": _backend.DOT_FAILED,
                    "triton_failed": _backend.TRITON_FAILED,
                },
            )
            if rank == 0:
                H.write_json(out_dir / f"{name}.expected.json", expected)
            dist.barrier()


def nudge_worker(rank, world_size, collector, out_dir):
    import rankscope.torch as rst

    dev = torch.device("cuda", 0)
    _deterministic()
    torch.manual_seed(7)
    ddp = _ddp(H.TinyLM().to(dev), False)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mon = rst.attach(
        ddp,
        collector=collector,
        job="gpu-nudge",
        sketch_dim=256,
        param_check_every=PARAM_CHECK_EVERY,
    )
    for step in range(3 * PARAM_CHECK_EVERY):
        x, y = (t.to(dev) for t in H.batch(rank, step))
        sgd.zero_grad(set_to_none=True)
        loss = H.lm_loss(ddp, x, y)
        loss.backward()
        sgd.step()
        mon.step(loss)
        if step == NUDGE_AFTER and rank == NUDGE_RANK:
            with torch.no_grad():
                w = ddp.module.head.weight.view(-1)
                i = int(w.abs().argmax())  # large |w|: an SGD update keeps the ulp
                w[i] = torch.nextafter(w[i], torch.tensor(math.inf, device=dev))
    stats = mon.close(timeout=30)
    H.write_json(Path(out_dir) / f"nudge.rank{rank}.json", {"stats": stats})


def nosync_worker(rank, world_size, collector, out_dir):
    """Plain DDP steps, then rankscope-attached ones, all under sync debug mode "error" (one
    NCCL rank)."""
    import rankscope.torch as rst

    dev = torch.device("cuda", 0)
    _deterministic()
    out = {}
    for kernels in KERNELS:
        _use_kernels(kernels)
        for every in (1, 2):
            torch.manual_seed(7)
            ddp = _ddp(H.TinyLM().to(dev), False)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
            batches = [tuple(t.to(dev) for t in H.batch(0, s)) for s in range(12)]
            torch.cuda.synchronize()

            def step(s, mon=None):
                x, y = batches[s]
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = H.lm_loss(ddp, x, y)
                loss.backward()
                opt.step()
                if mon is not None:
                    mon.step(loss)

            for s in range(2):  # DDP rebuilds its buckets once, synchronizing (torch 2.11)
                step(s)
            torch.cuda.set_sync_debug_mode("error")
            step(2)  # plain DDP after that: the baseline must not trip the mode itself
            torch.cuda.set_sync_debug_mode(0)
            mon = rst.attach(
                ddp,
                collector=collector,
                job=f"gpu-nosync-{kernels}-{every}",
                sketch_dim=1024,
                every=every,
                param_check_every=2,
            )
            errors = []
            busy_ok, pinned = [], []
            for s in range(3, 12):
                # Steps 3 and 4 compile the Triton kernels (seconds of host time, no device
                # synchronization): under the mode, but not in the busy check.
                warm = s < 5
                # A long kernel first, an event after it; the step is then issued. If anything
                # in the step waited for the device, the event has completed when it returns.
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
                queued = torch.cuda.Event()
                queued.record()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step(s, mon)
                except RuntimeError as e:
                    errors.append(f"step {s}: {e}")
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                if not warm:
                    busy_ok.append(not queued.query())
                pinned.extend(p.host.is_pinned() for p in mon._deferred._pending)
                torch.cuda.synchronize()
            stats = mon.close(timeout=30)
            out[f"{kernels}-{every}"] = {
                "errors": errors,
                "busy_ok": busy_ok,
                "pinned": pinned,
                "stats": stats,
            }
    from rankscope import _backend

    out["dot_failed"] = _backend.DOT_FAILED
    out["triton_failed"] = _backend.TRITON_FAILED
    H.write_json(Path(out_dir) / "nosync.json", out)


GRAPH_WARMUP, GRAPH_REPLAYS, GRAPH_AFTER = 11, 4, 3


def graph_worker(rank, world_size, collector, out_dir):
    """The same training twice, without and with rankscope: eager warm-up steps on a side
    stream, a CUDA graph of forward + backward captured, replayed (an eager SGD step after
    each), then eager steps again. Writes the final parameters' equality and the shim's stats."""
    import rankscope.torch as rst

    dev = torch.device("cuda", 0)
    _deterministic()
    xs = [torch.randn(64, 32, generator=torch.Generator().manual_seed(s)) for s in range(40)]
    batches = [(x.to(dev), x.sum(1, keepdim=True).to(dev)) for x in xs]

    def train(with_rankscope):
        torch.manual_seed(11)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # DDP built on a side stream, as the recipe asks
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.01)
        torch.cuda.current_stream().wait_stream(side)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        mon = None
        if with_rankscope:
            mon = rst.attach(ddp, collector=collector, job="gpu-graph", sketch_dim=1024)
        loss_fn = nn.MSELoss()
        step = 0

        def eager(x, y):
            nonlocal step
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step(loss)
            step += 1

        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP):
                eager(*batches[step])
        torch.cuda.current_stream().wait_stream(side)
        static_x, static_y = (t.clone() for t in batches[step])
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            static_loss = loss_fn(ddp(static_x), static_y)
            static_loss.backward()
        if mon is not None:
            mon.step(static_loss)  # the captured step: not reported
        step += 1
        for _ in range(GRAPH_REPLAYS):
            static_x.copy_(batches[step][0])
            static_y.copy_(batches[step][1])
            graph.replay()
            opt.step()
            if mon is not None:
                mon.step(static_loss)  # a replay: no hook ran, not reported
            step += 1
        for _ in range(GRAPH_AFTER):
            eager(*batches[step])
        torch.cuda.synchronize()
        params = [p.detach().cpu() for p in model.parameters()]
        return params, (mon.close(timeout=30) if mon is not None else None)

    plain, _ = train(False)
    watched, stats = train(True)
    H.write_json(
        Path(out_dir) / "graph.json",
        {"equal": all(torch.equal(a, b) for a, b in zip(plain, watched)), "stats": stats},
    )


# ---- tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exact_run(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-exact")
    H.spawn(exact_worker, WORLD, module_collector.address, str(out), timeout=300)
    return module_collector, out


def _load(path):
    return json.loads(path.read_text())


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_statistics_equal_exact_values(exact_run, mode, kernels):
    collector, out = exact_run
    name = f"{mode}-{kernels}"
    expected = {int(k): v for k, v in _load(out / f"{name}.expected.json").items()}
    H.check_exact_rows(
        collector.step_rows(f"gpu-{name}"),
        collector.rank_rows(f"gpu-{name}"),
        expected,
        WORLD,
        SKETCH_DIM,
    )
    for rank in range(WORLD):
        info = _load(out / f"{name}.rank{rank}.json")
        assert info["dot_failed"] == []
        assert info["triton_failed"] == []  # the Triton rows ran Triton, not the torch ops
        stats = info["stats"]
        assert stats["recorded"] == STEPS and stats["acked"] == STEPS, stats
        assert stats.get("shim_hook_errors", 0) == 0, stats
        assert stats.get("shim_fingerprint_errors", 0) == 0, stats
        if mode != "bf16":
            # Once DDP's buckets are final, each is sketched in one launch (add_segments).
            assert stats.get("shim_planned_buckets", 0) >= STEPS - 3, stats
        # The aggregation check on the device path (a DeviceSketch of each reduced bucket, read
        # back with the deferred report): every step's check sent, none skipped or failed.
        assert stats.get("shim_integrity_skipped_buckets", 0) == 0, stats
        assert stats.get("shim_integrity_errors", 0) == 0, stats
    sent = sum(
        _load(out / f"{name}.rank{r}.json")["stats"].get("shim_integrity_checks_sent", 0)
        for r in range(WORLD)
    )
    assert sent == STEPS, sent
    checks = collector.query(
        "SELECT step, integrity_error_ratio, integrity_fault FROM step_stats WHERE job = ? "
        "ORDER BY step",
        (f"gpu-{name}",),
    )
    assert [c[0] for c in checks] == list(range(STEPS)), checks
    assert all(r is not None and r <= 1.0 and f == "" for _, r, f in checks), checks


@pytest.fixture(scope="module")
def nudge_run(module_collector, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-nudge")
    H.spawn(nudge_worker, NUDGE_WORLD, module_collector.address, str(out), timeout=300)
    return module_collector, out


def test_gpu_one_ulp_nudge_is_named_at_the_next_check(nudge_run):
    collector, out = nudge_run
    rows = collector.query(
        "SELECT step, rank, replica_ok, param_fingerprint FROM rank_steps WHERE job = ? "
        "ORDER BY step, rank",
        ("gpu-nudge",),
    )
    steps = collector.query(
        "SELECT step, replica_divergent_ranks FROM step_stats WHERE job = ?", ("gpu-nudge",)
    )
    divergent = {s: d or "" for s, d in steps}
    check = (NUDGE_AFTER // PARAM_CHECK_EVERY + 1) * PARAM_CHECK_EVERY
    assert sorted(divergent) == list(range(3 * PARAM_CHECK_EVERY))
    params = {}
    for step, rank, ok, pfp in rows:
        params.setdefault(step, {})[rank] = (ok, pfp)
    for step in range(check):
        assert divergent[step] == "", step
        if step % PARAM_CHECK_EVERY == 0:  # healthy: the same fingerprint on every rank
            assert len({pfp for _, pfp in params[step].values()}) == 1, step
    assert divergent[check] == str(NUDGE_RANK)
    assert params[check][NUDGE_RANK][0] == 0
    assert all(params[check][r][0] == 1 for r in range(NUDGE_WORLD) if r != NUDGE_RANK)
    for rank in range(NUDGE_WORLD):
        stats = _load(out / f"nudge.rank{rank}.json")["stats"]
        assert stats.get("shim_fingerprint_errors", 0) == 0, stats


def test_gpu_steps_never_synchronize(module_collector, tmp_path):
    H.spawn(nosync_worker, 1, module_collector.address, str(tmp_path), timeout=240, backend="nccl")
    out = _load(tmp_path / "nosync.json")
    assert out.pop("dot_failed") == []
    assert out.pop("triton_failed") == []
    for case, r in out.items():
        assert r["errors"] == [], (case, r["errors"])
        stats = r["stats"]
        for k in ("shim_hook_errors", "shim_fingerprint_errors", "shim_step_errors"):
            assert stats.get(k, 0) == 0, (case, stats)
        assert r["busy_ok"] and all(r["busy_ok"]), (case, r["busy_ok"])
        assert r["pinned"] and all(r["pinned"]), (case, r["pinned"])
        assert stats["acked"] == stats["recorded"] > 0, (case, stats)


@pytest.mark.parametrize("dim", [1024, 4096, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_bins_equal_the_torch_ops(dtype, dim):
    from rankscope import _backend
    from rankscope import torch_sketch as ts
    from rankscope._device_sketch import DeviceSketch

    g = torch.Generator(device="cuda").manual_seed(dim)
    base = torch.randn(3_000_011, generator=g, device="cuda").to(dtype)
    base[12345] = 300.0  # an outlier coordinate, as LLM gradients have
    seed = 0x72616E6B73636F70
    # (values, global offset): aligned and whole tiles; a pointer 2 or 4 bytes off 16; an offset
    # inside a hash block; a short piece; a piece larger than one wave of the grid.
    pieces = [
        (base[:1_048_576], 0),
        (base[1:200_001], 77),
        (base[3:70_003], 1_000_005),
        (base[40:41], 5),
        (base[8:], 2_000_000),
    ]
    for values, offset in pieces:
        got = DeviceSketch(dim, seed, "cuda")
        with _backend.forced(kernels=_backend.CUDA, strict=True):
            got.add(values, offset)
        want = DeviceSketch(dim, seed, "cuda")
        with _backend.forced(kernels=_backend.TORCH_OPS, strict=True):
            want.add(values, offset)
        # The float32 summation bound, bin by bin: (terms a bin) * 2^-24 * (sum of |values| in it).
        slots, _ = ts.sketch_slots(offset, values.numel(), seed, dim, "cuda")
        magnitude = torch.zeros(dim, dtype=torch.float64, device="cuda").index_add_(
            0, slots, values.double().abs()
        )
        terms = torch.bincount(slots, minlength=dim).double()
        bound = (terms + 1) * 2.0**-24 * magnitude
        diff = (got.bins - want.bins).abs()
        assert bool((diff <= bound).all()), (dtype, dim, offset, float((diff - bound).max()))
        assert torch.allclose(got.sum_squares, want.sum_squares, rtol=1e-12, atol=0)

    # A bucket (the piece-table kernel, one launch): segments of odd lengths with gaps, their
    # global offsets shuffled, one inside a hash block, one empty.
    from rankscope import fingerprint as fp

    seg = 9_973
    layout = fp.SegmentLayout(
        base.numel(),
        [3 + i * seg for i in range(40)] + [500_001],
        [seg - 5 - (i % 7) for i in range(40)] + [0],
        [(39 - i) * seg * 2 + (i % 3) for i in range(40)] + [17],
    )
    got = DeviceSketch(dim, seed, "cuda")
    with _backend.forced(kernels=_backend.CUDA, strict=True):
        got.add_segments(base, layout)
    want = DeviceSketch(dim, seed, "cuda")
    with _backend.forced(kernels=_backend.TORCH_OPS, strict=True):
        want.add_segments(base, layout)
    magnitude = torch.zeros(dim, dtype=torch.float64, device="cuda")
    terms = torch.zeros(dim, dtype=torch.float64, device="cuda")
    for start, n, offset in zip(layout.starts, layout.counts, layout.global_offsets):
        slots, _ = ts.sketch_slots(offset, n, seed, dim, "cuda")
        magnitude.index_add_(0, slots, base[start : start + n].double().abs())
        terms += torch.bincount(slots, minlength=dim).double()
    bound = (terms + 1) * 2.0**-24 * magnitude
    diff = (got.bins - want.bins).abs()
    assert bool((diff <= bound).all()), (dtype, dim, "segments", float((diff - bound).max()))
    assert torch.allclose(got.sum_squares, want.sum_squares, rtol=1e-12, atol=0)


def test_gpu_cuda_graph_capture_is_chained_not_sketched(module_collector, tmp_path, monkeypatch):
    # PyTorch's DDP-under-graphs recipe: NCCL's async error handling off before the group exists.
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    H.spawn(graph_worker, 1, module_collector.address, str(tmp_path), timeout=240, backend="nccl")
    out = _load(tmp_path / "graph.json")
    assert out["equal"], "rankscope changed training under CUDA graph capture"
    stats = out["stats"]
    assert stats["shim_graph_captured_buckets"] > 0, stats
    assert stats["shim_steps_in_graph_capture"] == 1, stats
    assert stats["shim_steps_without_gradients"] == GRAPH_REPLAYS, stats
    for k in ("shim_hook_errors", "shim_fingerprint_errors", "shim_step_errors"):
        assert stats.get(k, 0) == 0, stats
    rows = module_collector.query(
        "SELECT DISTINCT step FROM rank_steps WHERE job = ? ORDER BY step", ("gpu-graph",)
    )
    eager = list(range(GRAPH_WARMUP)) + [
        GRAPH_WARMUP + 1 + GRAPH_REPLAYS + i for i in range(GRAPH_AFTER)
    ]
    assert [r[0] for r in rows] == eager
