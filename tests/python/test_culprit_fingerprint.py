"""rankscope.fingerprint: order independence, sensitivity to every single-bit flip, bucketing,
and agreement with a pure-Python reference of the definition."""

import random

import pytest

torch = pytest.importorskip("torch")
fp = pytest.importorskip("rankscope.fingerprint")

MASK = (1 << 64) - 1


def reference(values: torch.Tensor, offset: int = 0) -> int:
    """sum (bits_i + 1) * (2 (offset + i) + 1) mod 2**64, in Python integers."""
    itype = {
        torch.float32: torch.int32,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
        torch.float64: torch.int64,
    }[values.dtype]
    bits = values.reshape(-1).view(itype).tolist()
    return sum((b + 1) * (2 * (offset + i) + 1) for i, b in enumerate(bits)) & MASK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_matches_the_definition(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(777, generator=g) * 1e3).to(dtype)
    assert fp.to_uint64(fp.fold(x, 12345)) == reference(x, 12345)


def test_wraps_modulo_2_64():
    x = torch.full((64,), float("-inf"))  # large bit patterns, large weights
    assert fp.to_uint64(fp.fold(x, 1 << 60)) == reference(x, 1 << 60)


def test_order_and_bucketing_do_not_matter():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5000, generator=g)
    whole = fp.to_uint64(fp.fold(x, 0))
    rng = random.Random(3)
    for _ in range(20):
        # Random cuts into chunks, folded in a random order and combined.
        cuts = sorted(rng.sample(range(1, 5000), rng.randint(1, 12)))
        bounds = list(zip([0] + cuts, cuts + [5000]))
        rng.shuffle(bounds)
        acc = torch.zeros((), dtype=torch.int64)
        for a, b in bounds:
            acc = fp.combine(acc, fp.fold(x[a:b], a))
        assert fp.to_uint64(acc) == whole
        # The same chunks laid out in a bucket buffer in that shuffled order (DDP puts
        # parameters in reverse order), with padding between them that must not count.
        parts, starts, counts, offsets, pos = [], [], [], [], 0
        for a, b in bounds:
            parts.append(x[a:b])
            starts.append(pos)
            counts.append(b - a)
            offsets.append(a)
            parts.append(torch.full((3,), 7.0))  # padding
            pos += b - a + 3
        buf = torch.cat(parts)
        layout = fp.SegmentLayout(buf.numel(), starts, counts, offsets)
        assert fp.to_uint64(fp.fold_segments(buf, layout)) == whole


def test_parameters_fold_in_order():
    ps = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    flat = torch.cat([p.reshape(-1) for p in ps])
    assert fp.to_uint64(fp.fold_parameters(ps)) == fp.to_uint64(fp.fold(flat, 0))
    swapped = [ps[1], ps[0], ps[2]]
    assert fp.to_uint64(fp.fold_parameters(swapped)) != fp.to_uint64(fp.fold(flat, 0))


@pytest.mark.parametrize(
    "dtype,width", [(torch.float32, 32), (torch.bfloat16, 16), (torch.float16, 16)]
)
def test_every_single_bit_flip_changes_it(dtype, width):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, generator=g).to(dtype)
    itype = torch.int32 if width == 32 else torch.int16
    base = fp.to_uint64(fp.fold(x, 100))
    seen = {base}
    for i in range(x.numel()):
        for bit in range(width):
            y = x.clone()
            bits = y.view(itype)
            bits[i] ^= (1 << bit) if bit < width - 1 else -(1 << bit)  # the sign bit too
            f = fp.to_uint64(fp.fold(y, 100))
            assert f != base, (i, bit)
            seen.add(f)
    assert len(seen) == 1 + x.numel() * width  # and all flips differ from each other


def test_one_ulp_and_a_swap_change_it():
    x = torch.randn(1000)
    base = fp.to_uint64(fp.fold(x, 0))
    y = x.clone()
    y[500] = torch.nextafter(y[500], torch.tensor(float("inf")))
    assert fp.to_uint64(fp.fold(y, 0)) != base
    z = x.clone()
    z[[3, 4]] = z[[4, 3]]
    assert fp.to_uint64(fp.fold(z, 0)) != base


def test_segment_layout_rejects_a_segment_outside_the_buffer():
    with pytest.raises(ValueError):
        fp.SegmentLayout(10, [5], [6], [0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_cpp_kernel_agrees_with_the_torch_ops(dtype):
    from rankscope import _backend

    if _backend.fingerprint(torch.zeros(1, dtype=dtype)).backend != _backend.NATIVE:
        pytest.skip("rankscope._native without fingerprint_segments")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(10_001, generator=g) * 100).to(dtype)
    f, ss = fp.fold_cpu(x, 77)
    assert f == fp.to_uint64(fp.fold(x, 77)) == reference(x, 77)
    assert ss == pytest.approx(float((x.double() ** 2).sum()), rel=1e-12)
    layout = fp.SegmentLayout(x.numel(), [5000, 0, 9000], [4000, 5000, 1001], [0, 4000, 9000])
    f2, ss2 = fp.fold_segments_cpu(x, layout)
    assert f2 == fp.to_uint64(fp.fold_segments(x, layout))
    assert ss2 == pytest.approx(float((x.double() ** 2).sum()), rel=1e-12)
    if dtype != torch.float64:  # the sketch's dtypes: a bucket's plan folds it in one call
        from rankscope import _native
        from rankscope._bucket_sketcher import NATIVE_DTYPES

        size = x.element_size()
        plan = _native.BucketPlan(
            NATIVE_DTYPES[dtype],
            [s * size for s in layout.starts],
            layout.counts,
            layout.global_offsets,
        )
        assert plan.fingerprint(x.data_ptr()) == (f2, ss2)
        with pytest.raises(ValueError):
            _native.BucketPlan(NATIVE_DTYPES[dtype], [size + 1], [1], [0])
    # Non-contiguous input is folded in its logical order.
    m = x[:10_000].reshape(100, 100).t()
    assert fp.fold_cpu(m, 3)[0] == fp.to_uint64(fp.fold(m.contiguous(), 3))


def test_add_all_mixes_numbers_and_tensors():
    a, b = (1 << 64) - 5, 9
    assert fp.add_all([a, b], "cpu") == 4
    t = fp.add_all([a, torch.tensor(9)], "cpu")
    assert fp.to_uint64(t) == 4


def test_add_all_sums_partial_vectors_and_scalars():
    """The Triton kernels hand per-program partial vectors; add_all sums them with 0-d values
    and host numbers, wrapping."""
    parts = [
        torch.tensor([1, -2, 3], dtype=torch.int64),
        torch.tensor(-(1 << 63)),
        torch.tensor([(1 << 63) - 1]),
        (1 << 64) - 5,
    ]
    expected = (1 - 2 + 3 - (1 << 63) + (1 << 63) - 1 + (1 << 64) - 5) & MASK
    assert fp.to_uint64(fp.add_all(parts, "cpu")) == expected


def test_fold_many_and_fold_segments_and_squares_on_the_torch_path():
    """Off a CUDA device (the path CI runs) fold_many folds each tensor, and
    fold_segments_and_squares is fold_segments with the buffer's float64 sum of squares."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=g) for n in (10, 1, 333)]
    offsets = [0, 10, 11]
    parts = fp.fold_many(tensors, offsets, {})
    assert fp.to_uint64(fp.add_all(parts, "cpu")) == reference(torch.cat(tensors))
    buf = torch.cat(tensors)
    layout = fp.SegmentLayout(buf.numel(), [0, 10, 11], [10, 1, 333], [0, 10, 11])
    f, ss = fp.fold_segments_and_squares(buf, layout)
    assert fp.to_uint64(f) == reference(buf)
    assert float(ss) == pytest.approx(float(buf.double().square().sum()), rel=1e-12)


def test_gpu_sketch_kernel_choice(monkeypatch):
    """Which Triton sketch kernel a dtype and k get (rankscope._backend.sketch_variant; pure
    Python, so it is tested here too): the tensor-core one for 16-bit values at k = 512 .. 4,096
    and float32 up to 1,024, the atomic one otherwise or when forced."""
    from rankscope import _backend as b

    monkeypatch.delenv("RANKSCOPE_GPU_SKETCH", raising=False)
    monkeypatch.setattr(b, "DOT_FAILED", [])

    def dot(dtype, dim):
        c = b.sketch_variant(dtype, dim)
        assert c.backend == b.TRITON
        return (c.q, True, c.exact_tf32) if c.variant == b.DOT else (c.q, False, False)

    assert dot(torch.bfloat16, 1024) == (32, True, False)
    assert dot(torch.float16, 4096) == (128, True, False)
    assert dot(torch.float32, 1024) == (32, True, True)
    assert dot(torch.float32, 4096)[1] is False
    assert dot(torch.bfloat16, 1000)[1] is False  # not 32 times a power of two
    assert dot(torch.bfloat16, 256)[1] is False
    assert dot(torch.bfloat16, 8192)[1] is False
    assert dot(torch.float64, 1024)[1] is False
    monkeypatch.setenv("RANKSCOPE_GPU_SKETCH", "atomic")
    assert dot(torch.bfloat16, 1024)[1] is False
    monkeypatch.setenv("RANKSCOPE_GPU_SKETCH", "dot")
    assert dot(torch.float32, 4096) == (128, True, True)
    # A dot kernel that failed in this process: the atomic one, also when forced.
    monkeypatch.setattr(b, "DOT_FAILED", ["an error"])
    assert dot(torch.float32, 4096)[1] is False
    # forced() outranks the environment.
    with b.forced(sketch=b.ATOMIC):
        monkeypatch.setattr(b, "DOT_FAILED", [])
        assert dot(torch.bfloat16, 1024)[1] is False


# ---- the tolerance replica check's float summary (rankscope.replica_summary) ----------------


def _splitmix64(g: int) -> int:
    z = (g + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@pytest.mark.parametrize("native", [True, False], ids=["cpp-kernel", "torch-ops"])
def test_summary_matches_its_definition(native):
    """P_j = sum_i s_j(g_i) x_i with s_j from bit 60 + j of splitmix64(g), computed in Python
    integers and floats, and R's ulp term, on both paths (the C++ kernel, the torch ops); across
    two tensors at their offsets, one past 2**62 where the int64 arithmetic wraps. Each
    projection is within the summation bound R states (R minus its ulp term)."""
    rs = pytest.importorskip("rankscope.replica_summary")
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3000, generator=g)
    b = torch.randn(7, 11, generator=g).to(torch.bfloat16)
    offsets = [5, (1 << 62) + 17]
    projections, rounding = rs.summarize([a, b], offsets, native=native)
    expected = [0.0] * rs.PROJECTIONS
    ulp_squares = 0.0
    magnitude = 0.0
    for t, off in zip([a, b], offsets):
        unit = 2.0 ** (1 - rs.precision(t.dtype))
        for i, v in enumerate(t.reshape(-1).double().tolist()):
            z = _splitmix64(off + i)
            for j in range(rs.PROJECTIONS):
                expected[j] += -v if (z >> (60 + j)) & 1 else v
            ulp_squares += (unit * v) ** 2
            magnitude += abs(v)
    ulp_term = ulp_squares**0.5
    summation = rounding - ulp_term
    assert 0 < summation <= 2048 * 2.0**-53 * magnitude * (1 + 1e-9)
    for got, want in zip(projections, expected):
        # The reference's own sequential sum errs by up to 3,077 additions' worth.
        assert abs(got - want) <= summation + 3077 * 2.0**-53 * magnitude
    assert {rs.precision(d) for d in (torch.float32, torch.bfloat16, torch.float16)} == {24, 8, 11}
    # The signs are balanced (a fixed pseudo-random pattern, not a constant).
    s = rs.signs(torch.arange(100_000))
    assert s.shape == (rs.PROJECTIONS, 100_000)
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert s.mean(1).abs().max() < 0.02


def test_summary_paths_and_bucket_segments_agree():
    """The C++ kernel and the torch ops, and a bucket's segments (partial_segments, padding left
    out) against the same values as tensors, agree within R."""
    rs = pytest.importorskip("rankscope.replica_summary")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5000, generator=g) * 0.05
    cpp, r = rs.summarize([x], [0])
    ops, _ = rs.summarize([x], [0], native=False)
    assert max(abs(p - q) for p, q in zip(cpp, ops)) <= r
    # A bucket: three parameters at global offsets 100, 0, 3000 with padding between them.
    buffer = torch.randn(5200, generator=g) * 0.05
    layout = fp.SegmentLayout(5200, [0, 2100, 4000], [2000, 1000, 1100], [100, 0, 3000])
    pieces = [buffer[0:2000], buffer[2100:3100], buffer[4000:5100]]
    want, r = rs.summarize(pieces, [100, 0, 3000])
    for native in (True, False):
        got, r_got = rs.partial_segments(buffer, layout, native=native).finish()
        assert max(abs(p - q) for p, q in zip(got, want)) <= r, native
        assert r_got == pytest.approx(r, rel=1e-3)


def test_summary_is_independent_of_chunking_and_sees_a_change():
    """Equal bits give equal summaries whatever the tensors' split (exact values, balanced
    trees aside: within the stated rounding); a one-ulp change moves a projection by at most
    one ulp-sized term, a 1e-3 change of a quarter of the values far more than R."""
    rs = pytest.importorskip("rankscope.replica_summary")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4096, generator=g) * 0.05
    whole, r_whole = rs.summarize([x], [0])
    split, r_split = rs.summarize([x[:1000], x[1000:]], [0, 1000])
    assert max(abs(p - q) for p, q in zip(whole, split)) <= r_whole
    assert r_split == pytest.approx(r_whole, rel=1e-6)
    y = x.clone()
    y[17] = torch.nextafter(y[17], torch.tensor(1.0))
    near, _ = rs.summarize([y], [0])
    assert 0 < max(abs(p - q) for p, q in zip(whole, near)) <= r_whole
    z = x.clone()
    z[1024:2048] *= 1.001
    far, _ = rs.summarize([z], [0])
    assert max(abs(p - q) for p, q in zip(whole, far)) > 100 * r_whole
