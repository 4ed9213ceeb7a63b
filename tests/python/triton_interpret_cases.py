"""The cases of test_triton_interpret.py: every Triton kernel of rankscope.triton_kernels, run by
Triton's interpreter on CPU tensors, against the torch-op path. Only meaningful in a process
started with TRITON_INTERPRET=1 (test_triton_interpret.py starts one; or by hand:
``TRITON_INTERPRET=1 python -m pytest tests/python/triton_interpret_cases.py``), since Triton
decides at ``@triton.jit`` time, when rankscope.triton_kernels is imported, whether a kernel is
compiled or interpreted."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_triton_interpret.py, with TRITON_INTERPRET=1", allow_module_level=True)

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("rankscope._native", reason="build the trainer shim (rankscope_python)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rankscope import DEFAULT_SKETCH_SEED  # noqa: E402
from rankscope import _backend  # noqa: E402
from rankscope import fingerprint as fp  # noqa: E402
from rankscope import torch_sketch as ts  # noqa: E402
from rankscope._device_sketch import DeviceSketch  # noqa: E402
from rankscope import triton_kernels as tk  # noqa: E402

CPU = torch.device("cpu")
MASK64 = (1 << 64) - 1
U32 = 2.0**-24  # float32's unit roundoff
U64 = 2.0**-53  # float64's
HIGH_SEED = (1 << 63) | 0x5EED  # a seed Triton passes as uint64
FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # what the sketch kernels are made for
ALL_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.int16,
)  # what the fingerprint kernels take (fingerprint.py)

# (count, global offset) of the tensors a sketch case adds one after another into the same
# partial sums: one value; a block boundary (coordinates 45 .. 75); an odd length over five tiles
# of 2,048 (more than the interpreter's 3 programs), from an offset 17 before a tile boundary;
# nothing; block indices past 2**31 (int64 hashing).
SKETCH_SHAPES = ((1, 0), (31, 45), (7001, 3 * tk.PIECE - 17), (0, 64), (3000, (1 << 37) + 45))

# A DDP-bucket-like buffer of 9,000 elements: segments (buffer start, count, global offset) with
# padding between them, global offsets not multiples of 32 and out of order, segments crossing
# one and two PIECE (2,048) boundaries of the global index, an empty one, one past 2**37.
SEGMENTS = (
    (0, 90, 7000),
    (100, 1990, 12000),
    (2100, 4500, 10),
    (8999, 1, 5000),
    (6700, 0, 99),
    (6700, 2200, (1 << 37) + 45),
)
BUFFER = 9000


@triton.jit
def _bfloat16_probe(x_ptr, neg_ptr, one_ptr, dot_ptr):
    """-x, a 0/1 mask cast to bfloat16, and a product with it: what the tensor-core sketch
    does to bfloat16 values (_sketch_tile with DOT), on a 16 x 16 tile."""
    i = tl.arange(0, 16)
    ij = i[:, None] * 16 + i[None, :]
    x = tl.load(x_ptr + ij)
    tl.store(neg_ptr + ij, -x)
    one = (i[:, None] == i[None, :]).to(x.dtype)
    tl.store(one_ptr + ij, one)
    tl.store(dot_ptr + ij, tl.dot(one, x))


def _bfloat16_arithmetic():
    """None if the interpreter computes -x, a bool-to-bfloat16 cast and tl.dot of bfloat16
    values right, else what it gets wrong. Triton 3.9's keeps bfloat16 values as their uint16
    bits (numpy has no bfloat16) and converts them only in casts to and from float32: -x negates
    the integer, a bool becomes the bits 0x0001 (not 1.0's 0x3F80), and tl.dot multiplies bit
    patterns (triton-lang/triton issue 11584; its fix, PR 11585, was declined, "we just don't
    support it yet")."""
    x = (torch.arange(256, dtype=torch.float32).reshape(16, 16) / 8 - 16).to(torch.bfloat16)
    neg, one, dot = torch.empty_like(x), torch.empty_like(x), torch.empty(16, 16)
    try:
        _bfloat16_probe[(1,)](x, neg, one, dot)
    except Exception as e:  # noqa: BLE001 - not even that runs
        return repr(e)[:200]
    wrong = [
        what
        for what, ok in (
            ("-x", torch.equal(neg, -x)),
            ("bool to bfloat16", torch.equal(one, torch.eye(16).bfloat16())),
            ("tl.dot", torch.equal(dot, x.float())),
        )
        if not ok
    ]
    return ", ".join(wrong) or None


BFLOAT16_WRONG = _bfloat16_arithmetic()


def skip_bfloat16_dot(dtype, dot):
    """The tensor-core sketch of bfloat16 values needs bfloat16 arithmetic the interpreter lacks
    (above); float16 runs the same kernel code (DOT, no EXACT_TF32), and test_gpu.py's bf16
    runs with RANKSCOPE_GPU_SKETCH=dot check this variant on a GPU."""
    if dtype == torch.bfloat16 and dot and BFLOAT16_WRONG:
        pytest.skip(
            f"Triton's interpreter gets bfloat16 {BFLOAT16_WRONG} wrong (it keeps "
            "bfloat16 as uint16 bits): the tensor-core sketch of bfloat16 runs on a GPU "
            "only (test_gpu.py); float16 runs the same kernel code here"
        )


@pytest.fixture(autouse=True)
def no_fallback():
    """A kernel that raised must fail its case, not pass it on the torch ops: the launchers are
    called directly here (errors propagate), and where a path could fall back
    (rankscope._backend.run: a tensor-core sketch to the atomic one, Triton to the torch ops)
    the record of it must stay empty."""
    yield
    assert _backend.DOT_FAILED == [], _backend.DOT_FAILED
    assert _backend.TRITON_FAILED == [], _backend.TRITON_FAILED


def values(dtype, n, kind, gen):
    """``n`` values of ``dtype``. "exact": multiples of 1/8 up to 8 in magnitude, exact in every
    float dtype, as are their sums here in float32 and their squares' sums in float64, so both
    paths must agree bit for bit. "random": normal values scaled by 2**-20 .. 2**20 (2**-12 ..
    2**12 for float16), so that sums round. Integer dtypes: any value of the type."""
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (n,), generator=gen, dtype=dtype)
    if kind == "exact":
        return (torch.randint(-64, 65, (n,), generator=gen).double() / 8).to(dtype)
    span = 12 if dtype == torch.float16 else 20
    scale = torch.exp2(torch.randint(-span, span + 1, (n,), generator=gen).double())
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)


def with_specials(x):
    """``x`` with -0.0, infinities, NaN and a subnormal at its start (fingerprints are of bits)."""
    if x.dtype.is_floating_point and x.numel() >= 5:
        tiny = torch.finfo(x.dtype).tiny / 4
        x[:5] = torch.tensor(
            [-0.0, float("inf"), float("-inf"), float("nan"), tiny], dtype=torch.float64
        ).to(x.dtype)
    return x


def layout():
    starts, counts, goffs = zip(*SEGMENTS)
    return fp.SegmentLayout(BUFFER, starts, counts, goffs)


def sums_of_squares(flat, lay):
    return sum(flat[s : s + n].double().square().sum() for s, n in zip(lay.starts, lay.counts))


def check_squares(got, ref, n, exact, what):
    """Both sums add the same float64 squares (exact for 16- and 32-bit floats) in another
    order: within 2 (n + 2) 2**-53 of each other, relatively (the float64 bound of summing n
    terms, for each path); bit for bit when every partial sum is exact."""
    got, ref = float(got), float(ref)
    if exact:
        assert got == ref, (what, got, ref)
    else:
        assert abs(got - ref) <= 2 * (n + 2) * U64 * abs(ref), (what, got, ref)


class BinBounds:
    """Per bin, the sum of |value| and the number of values the torch-op path adds into it
    (its bins and signs, torch_sketch.sketch_slots), for the float32-rounding bound."""

    def __init__(self, dim, seed):
        self.dim, self.seed = dim, seed
        self.abs = torch.zeros(dim, dtype=torch.float64)
        self.count = torch.zeros(dim, dtype=torch.float64)
        self.n = 0

    def add(self, x, offset):
        bins, _ = ts.sketch_slots(offset, x.numel(), self.seed, self.dim)
        self.abs.index_add_(0, bins, x.double().abs())
        self.count.index_add_(0, bins, torch.ones(x.numel(), dtype=torch.float64))
        self.n += x.numel()

    def check(self, got, ref, exact, what):
        """The kernels' bins against the torch ops' float64 bins. exact: bit for bit (same bins,
        same signs, no rounding). Else each bin within (m + 1) 2**-24 of the sum of the |values|
        of its m terms: float32 rounding of m - 1 additions in any order (the kernels add in
        float32; the module docstring's "within float32 rounding of the torch-op path's float64
        sum"), and the largest difference under 1e-5 of the largest bin, gpu_bench.py's check
        of the GPU runs (docs/PERFORMANCE.md: 3.6e-7 float32, 1.7e-8 bfloat16 measured)."""
        assert got.dtype == ref.dtype == torch.float64 and got.shape == ref.shape == (self.dim,)
        if exact:
            wrong = (got != ref).nonzero().flatten()
            assert wrong.numel() == 0, (
                what,
                f"{wrong.numel()} bins differ",
                wrong[:8].tolist(),
                got[wrong[:8]].tolist(),
                ref[wrong[:8]].tolist(),
            )
            return
        err = (got - ref).abs()
        bound = (self.count + 1) * U32 * self.abs
        wrong = (err > bound).nonzero().flatten()
        assert wrong.numel() == 0, (
            what,
            f"{wrong.numel()} bins off",
            wrong[:8].tolist(),
            err[wrong[:8]].tolist(),
            bound[wrong[:8]].tolist(),
        )
        assert float(err.max()) <= 1e-5 * float(ref.abs().max()), what


def variant(monkeypatch, dtype, dim, dot):
    """Forces the atomic or tensor-core sketch kernel (RANKSCOPE_GPU_SKETCH), checks that
    _backend.sketch_variant picks it (Q = dim / 32, EXACT_TF32 for float32, or the atomic
    kernel) and returns that choice, what the launchers take."""
    monkeypatch.setenv("RANKSCOPE_GPU_SKETCH", "dot" if dot else "atomic")
    choice = _backend.sketch_variant(dtype, dim)
    if dot:
        assert choice == _backend.Choice(
            _backend.TRITON, _backend.DOT, dim // 32, dtype == torch.float32
        )
    else:
        assert choice.variant == _backend.ATOMIC
    return choice


# dim 32 and 1,000 (not 32 Q) take the atomic kernel only; 512, 1,024 and 4,096 are the tensor-core
# kernel's Q = 16, 32 and 128 (float32 at 4,096 only when forced, as on a GPU), and the atomic
# kernel's too. float64 values (no tensor-core variant) go through the atomic kernel as float32.
SKETCH_CASES = (
    [(dt, dim, False) for dt in FLOATS for dim in (32, 1000, 512, 1024, 4096)]
    + [(torch.float64, 1000, False)]
    + [(dt, dim, True) for dt in FLOATS for dim in (512, 1024, 4096)]
)


def _case_id(case):
    dtype, dim, dot = case
    return f"{str(dtype)[6:]}-k{dim}-{'dot' if dot else 'atomic'}"


@pytest.mark.parametrize("kind", ["exact", "random"])
@pytest.mark.parametrize("case", SKETCH_CASES, ids=_case_id)
def test_sketch_add(case, kind, monkeypatch):
    """_sketch_kernel (sketch_add): several tensors added into one set of partial sums, folded
    as DeviceSketch folds them, against DeviceSketch's torch ops."""
    dtype, dim, dot = case
    skip_bfloat16_dot(dtype, dot)
    choice = variant(monkeypatch, dtype, dim, dot)
    seed = HIGH_SEED if dim % 3 else DEFAULT_SKETCH_SEED
    gen = torch.Generator().manual_seed(dim)
    rows, ss = tk.sketch_partials(CPU, dim)
    assert rows.shape == (tk._INTERPRETER_PROGRAMS, dim)
    ref = DeviceSketch(dim, seed, CPU)
    bounds = BinBounds(dim, seed)
    for n, offset in SKETCH_SHAPES:
        x = values(dtype, n, kind, gen)
        tk.sketch_add(rows, ss, x, offset, seed, dim, choice)
        ref.add(x, offset)
        bounds.add(x, offset)
    got = rows.sum(0, dtype=torch.float64)
    bounds.check(got, ref.bins, kind == "exact", case)
    check_squares(ss.sum(), ref.sum_squares, bounds.n, kind == "exact", case)


def test_piece_table_cuts_at_piece_boundaries():
    """What _sketch_pieces_kernel relies on: each piece inside one tile of PIECE global
    coordinates, and the pieces covering the segments exactly."""
    lay = layout()
    starts, counts, goffs = tk.piece_table(lay)
    assert len(starts) == 9  # 1 + 2 + 3 + 1 + 0 + 2 pieces in SEGMENTS
    covered = []
    for s, n, g in zip(starts, counts, goffs):
        assert 0 < n and g // tk.PIECE == (g + n - 1) // tk.PIECE, (s, n, g)
        covered.extend(zip(range(s, s + n), range(g, g + n)))
    expected = [(s + i, g + i) for s, n, g in SEGMENTS for i in range(n)]
    assert covered == expected


PIECE_CASES = [
    (dt, dim, dot) for dt in FLOATS for dim, dot in ((1000, False), (1024, True), (4096, True))
]


@pytest.mark.parametrize("kind", ["exact", "random"])
@pytest.mark.parametrize("case", PIECE_CASES, ids=_case_id)
def test_sketch_add_pieces(case, kind, monkeypatch):
    """_sketch_pieces_kernel (sketch_add_pieces, one launch for a bucket, its table from
    SegmentLayout.pieces) against DeviceSketch.add_segments' torch ops; the padding between
    segments holds values that must not count."""
    dtype, dim, dot = case
    skip_bfloat16_dot(dtype, dot)
    choice = variant(monkeypatch, dtype, dim, dot)
    seed = HIGH_SEED if dot else DEFAULT_SKETCH_SEED
    gen = torch.Generator().manual_seed(dim + 1)
    buf = values(dtype, BUFFER, kind, gen)
    lay = layout()
    rows, ss = tk.sketch_partials(CPU, dim)
    tk.sketch_add_pieces(rows, ss, buf, lay.pieces(CPU), seed, dim, choice)
    ref = DeviceSketch(dim, seed, CPU)
    ref.add_segments(buf, lay)
    bounds = BinBounds(dim, seed)
    for s, n, g in SEGMENTS:
        bounds.add(buf[s : s + n], g)
    bounds.check(rows.sum(0, dtype=torch.float64), ref.bins, kind == "exact", case)
    check_squares(ss.sum(), ref.sum_squares, bounds.n, kind == "exact", case)


def test_sketch_of_nothing_adds_nothing():
    """Empty tensors and tables launch nothing (the launchers return first)."""
    rows, ss = tk.sketch_partials(CPU, 512)
    dot = _backend.Choice(_backend.TRITON, _backend.DOT, 16, False)
    tk.sketch_add(rows, ss, torch.zeros(0), 5, DEFAULT_SKETCH_SEED, 512, dot)
    empty = fp.SegmentLayout(10, [3], [0], [7])
    tk.sketch_add_pieces(rows, ss, torch.ones(10), empty.pieces(CPU), DEFAULT_SKETCH_SEED, 512, dot)
    assert not rows.any() and not ss.any()


def test_kernels_are_interpreted():
    """Every kernel is the interpreter's (TRITON_INTERPRET=1 was set before the import), and
    CPU tensors still take the torch ops in the shim."""
    from triton.runtime.interpreter import InterpretedFunction

    for name in (
        "_sketch_kernel",
        "_sketch_pieces_kernel",
        "_fold_kernel",
        "_fold_pieces_kernel",
    ):
        assert isinstance(getattr(tk, name), InterpretedFunction), name
    x = torch.zeros(4)
    assert _backend.sketch(x, 1024, native=False).backend == _backend.TORCH_OPS
    assert _backend.fingerprint(x, native=False).backend == _backend.TORCH_OPS


def _dtype_id(dtype):
    return str(dtype)[6:]


def same(got, ref):
    """Two fingerprints (0-d int64 tensors or ints) as the same 64-bit number."""
    return int(got) & MASK64 == int(ref) & MASK64


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_dtype_id)
def test_fold(dtype):
    """_fold_kernel (fold) against fingerprint.fold's torch ops, bit for bit: nothing, one
    element, 4 tiles of 4,096 and 3 more (programs take 2 or 1 tiles), a global offset past
    2**40."""
    gen = torch.Generator().manual_seed(3)
    for n, offset in ((0, 5), (1, 0), (4 * 4096 + 3, 45), (5000, (1 << 40) + 3)):
        x = with_specials(values(dtype, n, "random", gen))
        got = tk.fold(x.view(fp._BITS_DTYPE[dtype]), offset)
        assert got.dtype == torch.int64 and got.dim() == 0
        assert same(got, fp.fold(x, offset)), (dtype, n, offset)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_dtype_id)
def test_fold_pieces(dtype):
    """_fold_pieces_kernel without SQUARES (fold_pieces: fold_segments of a bucket in one
    launch) against fingerprint.fold_segments' torch ops, bit for bit; padding values do not
    count; a layout of empty segments has fingerprint 0."""
    gen = torch.Generator().manual_seed(4)
    buf = with_specials(values(dtype, BUFFER, "random", gen))
    lay = layout()
    bits = buf.view(fp._BITS_DTYPE[dtype])
    got = tk.fold_pieces(bits, lay.pieces(CPU))
    assert got.dtype == torch.int64 and got.dim() == 0
    assert same(got, fp.fold_segments(buf, lay))
    empty = fp.SegmentLayout(BUFFER, [5, 70], [0, 0], [3, 9])
    assert same(tk.fold_pieces(bits, empty.pieces(CPU)), 0)
    assert same(fp.fold_segments(buf, empty), 0)


@pytest.mark.parametrize("kind", ["exact", "random"])
@pytest.mark.parametrize("dtype", FLOATS + (torch.float64,), ids=_dtype_id)
def test_fold_pieces_with_squares(dtype, kind):
    """_fold_pieces_kernel with SQUARES (fold_pieces with values: the reduced gradient's
    fingerprint and sum of squares in one pass): per-program vectors whose wrapping sum is
    fold_segments' fingerprint bit for bit, and whose float64 sum (the kernel stores each
    program's sum bit for bit through an int64 view) is the segments' float64 sum of squares,
    within float64 summation order (bit for bit on exact data)."""
    gen = torch.Generator().manual_seed(5)
    buf = values(dtype, BUFFER, kind, gen)
    lay = layout()
    f, q = tk.fold_pieces(buf.view(fp._BITS_DTYPE[dtype]), lay.pieces(CPU), values=buf)
    assert f.shape == q.shape == (tk._INTERPRETER_PROGRAMS,)
    assert f.dtype == torch.int64 and q.dtype == torch.float64
    assert same(fp.add_all([f], CPU), fp.fold_segments(buf, lay))
    check_squares(q.sum(), sums_of_squares(buf, lay), sum(lay.counts), kind == "exact", dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_dtype_id)
def test_fold_tensors(dtype):
    """_fold_pieces_kernel over several tensors (fold_many's parameter check: every tensor of a
    dtype in one launch, its table from fingerprint._piece_table) against the sum of
    fingerprint.fold of each, bit for bit: views of one allocation with gaps between them plus a
    tensor of its own (an offset of any sign from the first), counts of 1, 33, 4,097 and 3 tiles
    + 1."""
    gen = torch.Generator().manual_seed(6)
    arena = with_specials(values(dtype, 20000, "random", gen))
    own = values(dtype, 77, "random", gen)
    tensors = [arena[0:1], arena[100:133], own, arena[1000:5097], arena[6000 : 6000 + 3 * 4096 + 1]]
    offsets = [5, 77777, 123, 40, 1 << 33]
    table = fp._piece_table(tensors, offsets, {})
    assert table is not None
    got = tk.fold_pieces(tensors[0].view(fp._BITS_DTYPE[dtype]), table)
    assert got.dtype == torch.int64 and got.dim() == 0
    assert same(got, sum(int(fp.fold(t, g)) for t, g in zip(tensors, offsets)))


def test_shim_entry_points_take_the_kernels(monkeypatch):
    """The shim's entry points with the kernels forced for CPU tensors (only possible here,
    under the interpreter: rankscope._backend.forced(any_device=True)): DeviceSketch.add and
    add_segments (persistent partial sums, folded when the bins are read), fold, fold_segments,
    fold_segments_and_squares and fold_many (one launch for its three tensors) give what they
    give on the torch ops. Forced strictly, so a kernel that raised fails the case instead of
    falling back (and no_fallback checks that nothing was recorded)."""
    gen = torch.Generator().manual_seed(7)
    buf = values(torch.float32, BUFFER, "exact", gen)
    lay = layout()
    inside = torch.zeros(BUFFER, dtype=torch.bool)
    for s, n in zip(lay.starts, lay.counts):
        inside[s : s + n] = True
    buf[~inside] = 0  # DDP's padding: fold_segments_and_squares' torch path takes the norm of all
    tensors = [buf[0:90], buf[100:2090].clone(), buf[2100:6600]]
    offsets = [7000, 12000, 10]
    launched = []

    def run():
        sk = DeviceSketch(1024, DEFAULT_SKETCH_SEED, CPU)
        sk.add(buf[:3001], 45)
        sk.add_segments(buf, lay)
        f, q = fp.fold_segments_and_squares(buf, lay)
        launched.append("many:")
        many = fp.add_all(fp.fold_many(tensors, offsets, {}), CPU)
        launched.append(":many")
        return (
            sk.bins.clone(),
            float(sk.sum_squares),
            int(fp.fold(buf[:5001], 3)),
            int(fp.fold_segments(buf, lay)),
            int(fp.add_all([f], CPU)),
            float(q.sum()),
            int(many),
        )

    monkeypatch.delenv("RANKSCOPE_GPU_SKETCH", raising=False)
    assert _backend.sketch(buf, 1024, native=False).backend == _backend.TORCH_OPS
    reference = run()
    launched.clear()
    for name in ("sketch_add", "sketch_add_pieces", "fold", "fold_pieces"):
        fn = getattr(tk, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            launched.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(tk, name, counted)
    with _backend.forced(kernels=_backend.TRITON, strict=True, any_device=True):
        assert _backend.sketch(buf, 1024, native=False).variant == _backend.DOT
        fused = run()
    assert sorted(set(launched) - {"many:", ":many"}) == [
        "fold",
        "fold_pieces",
        "sketch_add",
        "sketch_add_pieces",
    ]
    many = launched[launched.index("many:") + 1 : launched.index(":many")]
    assert many == ["fold_pieces"], many  # one launch for the three tensors
    assert torch.equal(fused[0], reference[0])
    assert fused[1:5] == reference[1:5] and fused[6] == reference[6]
    # The torch path's sum of squares is a float64 norm, squared: not bit for bit.
    check_squares(fused[5], reference[5], BUFFER, False, "fold_segments_and_squares")
