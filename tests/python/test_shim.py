"""rankscope.torch without DDP: the sketch's hash and kernels, the package's surface.

The torch-op sketch (for gradients on a GPU) must give exactly the C++ kernel's bins and signs;
run here on CPU tensors, against the kernel through rankscope._native.
"""

import math
import subprocess
import sys
import time
import warnings

import pytest
import torch

from conftest import PYTHON_DIR

_native = pytest.importorskip("rankscope._native")
from rankscope._device_sketch import DeviceSketch  # noqa: E402
from rankscope.torch_sketch import sketch_mix, sketch_slots  # noqa: E402

SEED = _native.DEFAULT_SKETCH_SEED
MASK64 = (1 << 64) - 1


def reference_mix(index: int, seed: int) -> int:
    """SplitMix64 output number `index` for `seed`, in Python integers (sketch.h's formula)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def test_header_test_vectors():
    assert _native.sketch_mix(0, 0) == 0xE220A8397B1DCDAF
    assert _native.sketch_mix(0, SEED) == 0x9609B8E9179AF10C
    assert _native.sketch_mix(12345, SEED) == 0x5FA110022D614E1B
    assert _native.sketch_mix(385, SEED) == 0xFD1FA0A8C3134223  # block 385: 12320-12351
    assert _native.sketch_hash(0, SEED, 1024) == (233, 1.0)
    assert _native.sketch_hash(31, SEED, 1024) == (264, 1.0)
    assert _native.sketch_hash(12345, SEED, 1024) == (193, -1.0)
    assert _native.sketch_hash(12345, SEED, 1000) == (417, -1.0)
    assert _native.sketch_hash(12345, SEED, 7) == (0, -1.0)


def test_hash_is_the_header_rule_in_python_integers():
    """sketch.h: block i >> 5, offset i & 31, base (mix >> 32) % dim, sign bit o of the mix."""
    for dim in (7, 1000, 1024):
        for i in (0, 31, 32, 12345, (1 << 40) + 7):
            mix = reference_mix(i >> 5, SEED)
            o = i & 31
            want = (((mix >> 32) % dim + o) % dim, -1.0 if (mix >> o) & 1 else 1.0)
            assert _native.sketch_hash(i, SEED, dim) == want


@pytest.mark.parametrize("seed", [0, SEED, MASK64, 0x8000000000000000])
@pytest.mark.parametrize("offset", [0, 123_456_789, (1 << 40) + 3, (1 << 63) - 5000])
def test_torch_mix_equals_kernel_mix(seed, offset):
    n = 4096
    kernel = torch.empty(n, dtype=torch.int64)
    _native.fill_mix(kernel.data_ptr(), offset, n, seed)
    ours = sketch_mix(torch.arange(offset, offset + n, dtype=torch.int64), seed)
    assert torch.equal(ours, kernel)
    for i in (0, 1, n - 1):
        assert int(ours[i]) & MASK64 == reference_mix(offset + i, seed)


@pytest.mark.parametrize("dim", [1, 7, 16, 31, 32, 1000, 1024, 65537])
@pytest.mark.parametrize("offset,n", [((1 << 33) + 17, 2000), (0, 1), (5, 40), (32, 16)])
def test_torch_slots_equal_kernel_slots(dim, offset, n):
    bins, signs = sketch_slots(offset, n, SEED, dim)
    assert bins.numel() == signs.numel() == n
    for i in sorted(set(range(0, n, 37)) | {0, n - 1}):
        assert (int(bins[i]), float(signs[i])) == _native.sketch_hash(offset + i, SEED, dim)


# sketch.h "Rounding": the kernel sums each bin's values of a segment in float (in one or two float
# partials: its own, and the one of windows that wrap past the last bin), and the squares of
# a run in float partials of at most 32 terms; the torch path sums everything in float64. Bounds:
# a float sum of m terms errs by at most m * 2^-24 of the sum of their magnitudes (Higham), and
# the sum of squares by at most 33 * 2^-24 of itself.
SQUARES_REL = 33 * 2.0**-24


def float_partial_bound(chunks, dim) -> torch.Tensor:
    """Per bin: (values it received) * 2^-24 * (sum of their magnitudes), over all chunks."""
    count = torch.zeros(dim, dtype=torch.float64)
    magnitude = torch.zeros(dim, dtype=torch.float64)
    for values, offset in chunks:
        bins, _ = sketch_slots(offset, values.numel(), SEED, dim)
        count.index_add_(0, bins, torch.ones(values.numel(), dtype=torch.float64))
        magnitude.index_add_(0, bins, values.double().abs())
    return count * magnitude * 2.0**-24


def kernel_bins(sketch) -> torch.Tensor:
    out = torch.empty(sketch.dim, dtype=torch.float64)
    sketch.copy_bins_to(out.data_ptr())
    return out


DTYPES = {
    torch.float32: _native.DTYPE_FLOAT32,
    torch.bfloat16: _native.DTYPE_BFLOAT16,
    torch.float16: _native.DTYPE_FLOAT16,
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dim", [256, 1000])
def test_torch_path_sketch_equals_kernel_sketch(dtype, dim):
    """The hook's two paths give the same sketch for the same chunks (as a bucket feeds them:
    per-parameter views at their global offsets, in an arbitrary order)."""
    torch.manual_seed(0)
    chunks = [
        (torch.randn(n).to(dtype), off)
        for n, off in [(5000, 70_000), (1, 0), (64_007, 1), (3000, 5_000_000_000)]
    ]
    kernel = _native.Sketch(dim, SEED)
    ours = DeviceSketch(dim, SEED, "cpu")
    for values, offset in chunks:
        assert kernel.add(values.data_ptr(), DTYPES[dtype], values.numel(), offset) == ""
        ours.add(values, offset)
    error = (ours.bins - kernel_bins(kernel)).abs()
    bound = float_partial_bound(chunks, dim)
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0  # the kernel did sum in float: the bound is not vacuous here
    exact_ss = sum(float(v.double().square().sum()) for v, _ in chunks)
    assert float(ours.sum_squares) == pytest.approx(exact_ss, rel=1e-12)
    assert kernel.sum_squares() == pytest.approx(exact_ss, rel=SQUARES_REL)


def test_add_segments_equals_adds_of_the_views():
    """DeviceSketch.add_segments (a DDP bucket with a cached layout) adds each segment of the
    buffer at its global offset, padding excluded: the same bins as add() per view."""
    from rankscope.fingerprint import SegmentLayout

    torch.manual_seed(2)
    buf = torch.randn(20_000)
    layout = SegmentLayout(
        buf.numel(), [0, 5003, 9000], [5000, 3997, 11_000], [70_000, 1, 5_000_000_000]
    )
    whole = DeviceSketch(1000, SEED, "cpu")
    whole.add_segments(buf, layout)
    views = DeviceSketch(1000, SEED, "cpu")
    for start, n, off in zip(layout.starts, layout.counts, layout.global_offsets):
        views.add(buf[start : start + n], off)
    assert torch.equal(whole.bins, views.bins)
    assert float(whole.sum_squares) == float(views.sum_squares)


def test_piece_table_covers_the_segments_within_sketch_tiles():
    """The Triton kernels' segment table (rankscope.triton_kernels.piece_table): the pieces
    cover every segment exactly once, in order, and none crosses a multiple of PIECE."""
    from rankscope import triton_kernels as tk
    from rankscope.fingerprint import SegmentLayout

    piece = tk.PIECE
    layout = SegmentLayout(
        10 * piece, [0, 3, 4 * piece], [1, 3 * piece + 5, 5 * piece], [piece - 1, 7 * piece + 17, 0]
    )
    starts, counts, goffs = tk.piece_table(layout)
    covered = {}
    for s, n, g in zip(starts, counts, goffs):
        assert 0 < n <= piece
        assert g // piece == (g + n - 1) // piece  # within one tile
        for k in range(n):
            assert (s + k) not in covered
            covered[s + k] = g + k
    expected = {}
    for s, n, g in zip(layout.starts, layout.counts, layout.global_offsets):
        expected.update({s + k: g + k for k in range(n)})
    assert covered == expected


def test_add_many_equals_separate_adds_and_is_linear():
    torch.manual_seed(1)
    a, b = torch.randn(10_000), torch.randn(333)
    many = _native.Sketch(512, SEED)
    assert (
        many.add_many(
            [a.data_ptr(), b.data_ptr()],
            [a.numel(), b.numel()],
            [0, a.numel()],
            _native.DTYPE_FLOAT32,
        )
        == ""
    )
    whole = _native.Sketch(512, SEED)
    ab = torch.cat([a, b])
    whole.add(ab.data_ptr(), _native.DTYPE_FLOAT32, ab.numel(), 0)
    torch.testing.assert_close(kernel_bins(many), kernel_bins(whole), rtol=1e-12, atol=1e-12)
    values = torch.empty(512, dtype=torch.float32)
    many.copy_to(values.data_ptr())
    torch.testing.assert_close(values, kernel_bins(many).float())
    assert many.sum_squares() == whole.sum_squares()  # the same chunks, ascending: the same bits
    assert math.isclose(many.sum_squares(), float(ab.double().square().sum()), rel_tol=SQUARES_REL)


def test_hot_path_reports_errors_instead_of_raising():
    s = _native.Sketch(16, SEED)
    assert "dtype" in s.add(0, 9, 1, 0)
    assert s.add(0, _native.DTYPE_FLOAT32, 0, 0) == ""  # nothing to add
    assert "same length" in s.add_many([1, 2], [1], [0, 0], _native.DTYPE_FLOAT32)
    with pytest.raises(ValueError):
        _native.Sketch(0, SEED)


def test_agent_rejects_bad_options_and_never_blocks_without_collector():
    with pytest.raises(ValueError, match="job"):
        _native.Agent(collector="127.0.0.1:1", job="bad job name!", rank=0, world_size=1)
    agent = _native.Agent(
        collector="127.0.0.1:1",
        job="nobody-listens",
        rank=0,
        world_size=1,
        sketch_dim=8,
        max_backoff_s=0.2,
    )
    sketch = _native.Sketch(8, SEED)
    for step in range(100):
        assert agent.record_sketch(step, 1.0, 2.0, sketch) == ""
    wrong = torch.zeros(4)
    assert "sketch" in agent.record_raw(100, 1.0, 2.0, wrong.data_ptr(), 4)
    stats = agent.stats()
    assert stats["recorded"] == 100 and stats["invalid"] == 1 and not stats["connected"]
    assert agent.control() is None
    t0 = time.monotonic()
    assert agent.close(0.05) != ""  # nothing could be acked
    assert time.monotonic() - t0 < 5
    assert agent.stats()["dropped"] == 100  # what was never acked is counted as lost


def test_import_from_build_tree_in_a_fresh_interpreter():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import rankscope.torch as rst, rankscope; "
            "print(rankscope.__version__, rst.attach.__name__)",
        ],
        env={"PYTHONPATH": str(PYTHON_DIR), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "attach" in out.stdout


def test_attach_refuses_a_plain_module():
    import rankscope.torch as rst

    with pytest.raises(TypeError, match="DistributedDataParallel"):
        rst.attach(torch.nn.Linear(2, 2), job="x")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_sketch_never_writes_into_the_gradient(dtype):
    g = torch.randn(1000, dtype=dtype)
    before = g.clone()
    DeviceSketch(64, SEED, "cpu").add(g, 5)
    assert torch.equal(g, before)


@pytest.fixture
def single_rank_group():
    """A one-rank gloo process group in this process (for attach's argument checks)."""
    import torch.distributed as dist
    from conftest import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_attach_needs_a_job_and_takes_one_hook(single_rank_group, monkeypatch):
    import rankscope.torch as rst

    monkeypatch.delenv("RANKSCOPE_JOB", raising=False)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="RANKSCOPE_JOB"):
        rst.attach(ddp, collector="127.0.0.1:1")
    mon = rst.attach(ddp, collector="127.0.0.1:1", job="one-hook", dormant=True)
    assert not mon.enabled and mon.world_size == 1 and mon.num_coordinates == 20
    with pytest.raises(RuntimeError, match="comm_hook"):
        rst.attach(ddp, collector="127.0.0.1:1", job="one-hook")
    # Dormant: training works, nothing is recorded.
    for _ in range(3):
        ddp(torch.randn(2, 4)).sum().backward()
        mon.step(torch.tensor(1.0))
    assert mon.stats()["recorded"] == 0 and mon.stats().get("shim_buckets", 0) == 0
    mon.close(timeout=0)


def test_a_second_backward_before_step_restarts_the_sketch(single_rank_group):
    """Accumulating without no_sync(): each backward all-reduces; the report covers the last
    one (what DDP averaged), not the sum of both."""
    import rankscope.torch as rst

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    mon = rst.attach(ddp, collector="127.0.0.1:1", job="two-backwards")
    x = torch.randn(4, 8)
    ddp(x).square().sum().backward()
    ddp(x).square().sum().backward()  # grads accumulate: the bucket now holds 2x the gradient
    expected = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ddp.parameters()))
    assert mon._cpu_sketch.sum_squares() == pytest.approx(expected**2, rel=1e-6)
    assert mon.counters["backward_restarts"] == 1
    mon.close(timeout=0)


def test_a_model_cast_after_wrapping_is_named_by_the_shim(single_rank_group):
    """pytorch#104336: a DDP model moved or cast after it was wrapped gets new gradient
    accumulators; DDP's hooks stay on the old ones, so no bucket is all-reduced again. The shim
    sees steps that reduced, then steps that do not, and says what that means, once."""
    import warnings

    import rankscope.torch as rst

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    mon = rst.attach(ddp, collector="127.0.0.1:1", job="cast-after-wrap")
    for _ in range(2):
        ddp(torch.randn(2, 4)).sum().backward()
        mon.step(torch.tensor(1.0))
    assert mon.counters["steps_without_gradients"] == 0
    ddp.to(torch.float64)
    ddp.to(torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ddp(torch.randn(2, 4)).sum().backward()
            mon.step(torch.tensor(1.0))
    named = [w for w in caught if "moved or cast" in str(w.message)]
    assert len(named) == 1 and "pytorch#104336" in str(named[0].message), caught
    assert "step 2" in str(named[0].message)
    assert mon.counters["steps_without_gradients"] == 3
    mon.close(timeout=0)


def test_a_bad_loss_never_breaks_the_training_loop(single_rank_group):
    import rankscope.torch as rst

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    mon = rst.attach(ddp, collector="127.0.0.1:1", job="bad-loss")
    ddp(torch.randn(2, 4)).sum().backward()
    with pytest.warns(RuntimeWarning, match="could not report step 0"):
        mon.step(torch.ones(3))  # not a scalar
    assert mon.counters["step_errors"] == 1 and mon.step_number == 1
    mon.close(timeout=0)


def test_sketch_budget_and_encoding_give_k():
    """attach's sketch_dim / sketch_bytes / sketch_encoding (issue 15): the default is 4 KiB of
    int8 bins; sketch_dim alone keeps its float32 meaning."""
    import rankscope.torch as rst

    assert rst.sketch_dim_for(None, None, None) == (4096, "int8")
    assert rst.sketch_dim_for(1024, None, None) == (1024, "float32")
    assert rst.sketch_dim_for(1024, None, "int8") == (1024, "int8")
    assert rst.sketch_dim_for(None, 4096, "float16") == (2048, "float16")
    assert rst.sketch_dim_for(None, 2048, None) == (2048, "int8")
    assert rst.sketch_dim_for(None, 8192, "float32") == (2048, "float32")
    with pytest.raises(ValueError, match="not both"):
        rst.sketch_dim_for(1024, 4096, "int8")
    with pytest.raises(ValueError, match="not a positive multiple of 4"):
        rst.sketch_dim_for(None, 4098, "float32")
    with pytest.raises(ValueError, match="sketch_encoding must be one of"):
        rst.sketch_dim_for(None, 4096, "bfloat16")


@pytest.mark.parametrize("encoding", ["float16", "int8"])
def test_native_packing_round_trips_within_its_bound(encoding):
    values = [float(i % 13 - 6) * 0.37 for i in range(257)]
    bins, scale = _native.pack_sketch(values, encoding)
    assert len(bins) == 257 * _native.SKETCH_BYTES_PER_BIN[encoding]
    decoded = _native.unpack_sketch(bins, encoding, scale)
    bound = scale / 2 if encoding == "int8" else max(abs(v) for v in values) * 2**-11
    assert max(abs(a - b) for a, b in zip(decoded, values)) <= bound
    with pytest.raises(ValueError):
        _native.Agent(
            collector="127.0.0.1:1", job="x", rank=0, world_size=1, sketch_encoding="bfloat16"
        )


def test_a_failing_triton_kernel_turns_triton_off_and_the_torch_ops_take_over(monkeypatch):
    """Where Triton imports but cannot run (no C compiler for its launcher, a GPU it cannot
    target), the first failure turns the Triton kernels off for the process, with one warning,
    and the sketch and fingerprints come from the torch ops, the same values
    (rankscope._backend.run). Simulated on the CPU: the kernels are forced on for CPU tensors
    (forced(any_device=True)), where, compiled, they fail before any launch."""
    from rankscope import _backend
    from rankscope import fingerprint as fp

    if _backend._tk.triton is None:
        pytest.skip("Triton does not import here: nothing can fail")
    monkeypatch.setattr(_backend, "TRITON_FAILED", [])
    monkeypatch.setattr(_backend, "DOT_FAILED", [])
    torch.manual_seed(3)
    g = torch.randn(5000)
    layout = fp.SegmentLayout(5000, [0, 2000], [2000, 3000], [7, 4000])
    reference = DeviceSketch(256, SEED, "cpu")
    reference.add(g, 11)
    with _backend.forced(kernels=_backend.TRITON, any_device=True):
        with pytest.warns(RuntimeWarning, match="Triton kernels failed"):
            sketch = DeviceSketch(256, SEED, "cpu")
            sketch.add(g, 11)
        assert len(_backend.TRITON_FAILED) == 1
        assert torch.equal(sketch.bins, reference.bins)
        # Later calls take the torch ops at once (no second warning).
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            sketch.add_segments(g, layout)
        reference.add_segments(g, layout)
        assert torch.equal(sketch.bins, reference.bins)
        assert len(_backend.TRITON_FAILED) == 1

        monkeypatch.setattr(_backend, "TRITON_FAILED", [])
        with pytest.warns(RuntimeWarning):
            assert fp.to_uint64(fp.fold(g, 3)) == fp.to_uint64(fp.fold(g, 3))
        for failed in ([], ["x"]):  # the first call fails over, the second starts off
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                monkeypatch.setattr(_backend, "TRITON_FAILED", list(failed))
                f, ss = fp.fold_segments_and_squares(g, layout)
                assert _backend.TRITON_FAILED
                assert int(f) == int(fp.fold_segments(g, layout))
                monkeypatch.setattr(_backend, "TRITON_FAILED", list(failed))
                parts = fp.fold_many([g[:10], g[10:]], [0, 10], {})
                assert _backend.TRITON_FAILED
                assert fp.to_uint64(fp.add_all(parts, "cpu")) == fp.to_uint64(fp.fold(g, 0))


def test_a_strictly_forced_variant_that_fails_raises_and_is_not_remembered(monkeypatch):
    """What bench/gpu_bench.py relies on: forced(strict=True) raises the kernel's error (or
    why a variant cannot apply) as BackendFailed, never times another backend in its place, and
    leaves the process's choices as they were (no Triton or dot kernel marked failed)."""
    from rankscope import _backend

    if _backend._tk.triton is None:
        pytest.skip("Triton does not import here")
    monkeypatch.setattr(_backend, "TRITON_FAILED", [])
    monkeypatch.setattr(_backend, "DOT_FAILED", [])
    g = torch.randn(3000)
    for variant in (_backend.ATOMIC, _backend.DOT):
        with _backend.forced(kernels=_backend.TRITON, sketch=variant, strict=True, any_device=True):
            with pytest.raises(_backend.BackendFailed, match=f"triton {variant}"):
                DeviceSketch(1024, SEED, "cpu").add(g, 0)
    with _backend.forced(kernels=_backend.TRITON, sketch=_backend.DOT, strict=True):
        with pytest.raises(_backend.BackendFailed, match="dim 1000"):
            _backend.sketch_variant(torch.float32, 1000)
        with pytest.raises(_backend.BackendFailed, match="a cpu tensor"):
            _backend.sketch(g, 1024, native=False)
    assert _backend.TRITON_FAILED == [] and _backend.DOT_FAILED == []
    # Outside the force, the default choice is unchanged: a CPU tensor takes the torch ops.
    assert _backend.sketch(g, 1024, native=False) == _backend.Choice(_backend.TORCH_OPS)


def test_backend_table():
    """rankscope._backend's table, the rows that hold on any machine (CPU tensors; a CUDA
    tensor's rows through the dtype and dim rules of sketch_variant)."""
    from rankscope import _backend as b

    cpu = torch.zeros(4)
    assert b.sketch(cpu, 1024) == b.Choice(b.NATIVE)
    assert b.sketch(cpu.double(), 1024) == b.Choice(b.NATIVE)  # after a float32 copy
    assert b.sketch(cpu, 1024, native=False) == b.Choice(b.TORCH_OPS)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert b.fingerprint(cpu.to(dtype)) == b.Choice(b.NATIVE)
        assert b.fingerprint(cpu.to(dtype), native=False) == b.Choice(b.TORCH_OPS)
    for dtype in (torch.int16, torch.int32, torch.int64):
        assert b.fingerprint(cpu.to(dtype)) == b.Choice(b.TORCH_OPS)
    assert b.fingerprint(cpu.to(torch.uint8)) == b.Choice(b.NONE)
    assert b.fingerprint(cpu.to(torch.bool)) == b.Choice(b.NONE)
    assert b.reduced_sketch(cpu, 1024) == b.Choice(b.NATIVE)
    assert b.reduced_sketch(cpu.double(), 1024) == b.Choice(b.NONE)
    assert b.reduced_sketch(torch.zeros(4, 4).t(), 1024) == b.Choice(b.NONE)
    assert b.reduced_sketch(cpu.to(torch.int32), 1024) == b.Choice(b.NONE)
    # The device path (a GPU's, or the tests' bypass_native): float64 too, through the torch ops.
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert b.reduced_sketch(cpu.to(dtype), 1024, native=False) == b.Choice(b.TORCH_OPS)
    # The Triton sketch variants per dtype and dim: test_culprit_fingerprint.py.


def test_effective_mantissa_bits_cover_the_float32_partial_sums():
    """The precision the aggregation check sends (rankscope._integrity.effective_mantissa_bits,
    docs/DESIGN.md "Aggregation integrity"): with sketches summed in float32 partial bins of m
    values from values rounded to v bits (the Triton kernels), the largest p' <= p whose 2^-2p'
    covers the reduction's 2^-2p plus 2^-48 m / 3 plus (2/3) 2^-2v, up to SLACK; p itself on the
    float64 paths (m = 0, exact values: the torch ops and the C++ kernel)."""
    from rankscope._device_sketch import DeviceSketch
    from rankscope._integrity import SLACK, effective_mantissa_bits

    for bits in (8, 11, 24, 53):
        assert effective_mantissa_bits(bits, 0) == bits
        for value_bits in (0, 22, 24):
            previous = bits
            for terms in (0, 1, 6, 100, 1850, 10**6, 10**12):
                p = effective_mantissa_bits(bits, terms, value_bits)
                need = 2.0 ** (-2 * bits) + 2.0**-48 * terms / 3
                if value_bits:
                    need += 2.0 ** (-2 * value_bits) * 2 / 3
                case = (bits, terms, value_bits, p)
                assert 1 <= p <= previous, case
                assert SLACK * 2.0 ** (-2 * p) >= need, case
                assert p == bits or SLACK * 2.0 ** (-2 * (p + 1)) < need, case
                previous = p
    # bfloat16 gradients keep their 8 bits on the tensor cores (the added terms are tiny), and
    # float32 ones on a large model lose what the partial sums cost.
    assert effective_mantissa_bits(8, 2000, 22) == 8
    assert effective_mantissa_bits(24, 1850, 0) < 24
    sketch = DeviceSketch(1024, SEED, "cpu")  # the torch ops: float64 from exact values
    sketch.add(torch.randn(5000), 3)
    assert sketch.float32_terms == 0 and sketch.value_bits == 0


def test_sketch_mix_constants_match_the_cpp_header():
    """SketchMix's constants: one definition per language, checked against the C++ header's
    (agent/include/rankscope/sketch.h): the Python one (rankscope.torch_sketch, through
    rankscope._native), the int64 patterns of the torch ops, and the arguments the Triton
    kernels get (rankscope.triton_kernels)."""
    import re
    from pathlib import Path

    from rankscope import torch_sketch as ts
    from rankscope import triton_kernels as tk

    root = Path(__file__).resolve().parents[2]
    header = (root / "agent/include/rankscope/sketch.h").read_text()
    found = dict(re.findall(r"kSketchMix(Golden|M1|M2) = (0x[0-9A-Fa-f]+)ULL;", header))
    assert sorted(found) == ["Golden", "M1", "M2"], found
    expected = tuple(int(found[k], 16) for k in ("Golden", "M1", "M2"))
    assert tuple(_native.SKETCH_MIX_CONSTANTS) == expected
    assert ts.SKETCH_MIX_CONSTANTS == expected
    assert tuple(c & MASK64 for c in (ts._GOLDEN, ts._M1, ts._M2)) == expected
    assert (tk._GOLDEN, tk._M1, tk._M2) == expected


def test_torch_sketch_is_a_deprecated_name_of_device_sketch():
    """The class that also runs the Triton kernels is DeviceSketch; its old public name still
    works, with a DeprecationWarning."""
    from rankscope import torch_sketch

    with pytest.warns(DeprecationWarning, match="DeviceSketch"):
        cls = torch_sketch.TorchSketch
    assert cls is DeviceSketch
    with pytest.raises(AttributeError):
        torch_sketch.NoSuchThing  # noqa: B018
