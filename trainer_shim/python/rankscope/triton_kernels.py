"""Fused Triton kernels for GPU gradients: the count sketch and the replica fingerprint in one
pass over the tensor each, instead of the ~10 elementwise torch passes of torch_sketch.py and
fingerprint.py (which stay the fallback, and the path CI tests on CPU).

How their results relate to the torch-op path (tests/python/test_gpu.py checks both):

* ``fold`` / ``fold_segments``: the same 64-bit wrapping integer sum, so bit-identical.
* ``sketch_add`` / ``sketch_add_pieces``: the same bins and signs (SketchMix of the block index,
  as torch_sketch.py and agent/include/rankscope/sketch.h), added into per-program float32 rows
  of ``dim`` bins that TorchSketch folds into float64 (a fixed order) when the bins are read. Two
  kernels: one atomic add per value into the program's row, or (DOT) each block's 32 values
  shifted into a row of 64 and added by a one-hot matrix product on the tensor cores into a
  [dim/32, 64] register tile flushed into the row at the end (bfloat16 and float16 values are
  exact operands; float32 takes three tf32 products, about float32's precision). Either way a
  bin is within float32 rounding of the torch-op path's float64 sum, and, because atomic adds
  into a row land in any order, not bit-reproducible from run to run at that rounding level. The
  sum of squares adds exact float64 squares in float64, as the torch-op path does, in another
  order.

Nothing here synchronizes the host with the device: partial buffers are allocated on the device
and reduced with torch ops; the segment and offset tables the kernels read come to the device
from pinned memory without blocking (fingerprint.py builds and caches them).

Selection: ``RANKSCOPE_GPU_KERNELS=torch`` forces the torch-op path; the default is Triton where
it imports and the tensor is on a CUDA device. The sketch kernel is chosen per dtype and dim
(``_variant``, from the H100 figures in docs/PERFORMANCE.md); ``RANKSCOPE_GPU_SKETCH=atomic`` or
``dot`` forces one. The first launch of each kernel in a process compiles it (seconds).

tests/python/test_triton_interpret.py runs every kernel on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set before this module is imported). For it, loop indices are cast
with ``tl.cast(t, ...)``, not ``t.to(...)`` (an interpreted loop index is a Python int; compiled,
the two are the same IR), and ``_programs`` gives a non-CUDA device a small fixed grid.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch without Triton (e.g. torch 2.2 on Python 3.12): the torch-op path
    triton = None

from rankscope import _native

# SketchMix's constants (agent/include/rankscope/sketch.h), as unsigned 64-bit numbers: Triton
# types a kernel argument of 2**63 or more as uint64.
_GOLDEN, _M1, _M2 = _native.SKETCH_MIX_CONSTANTS
_MASK64 = (1 << 64) - 1

_SKETCH_BLOCKS = 64  # hash blocks (of 32 coordinates) per tile
PIECE = 32 * _SKETCH_BLOCKS  # a tile: the most elements one piece of a segment table holds
_FOLD_TILE = 4096  # elements per tile of a contiguous fingerprint
_PROGRAM_FACTOR = 4  # programs of a persistent grid per multiprocessor
_SKETCH_WARPS = None  # warps of a sketch program (None: 4, or 8 for the larger dot tiles)
_PROGRAMS = {}  # (device index, factor) -> programs of a persistent grid


_FAILED = []  # the first error a Triton kernel raised in this process: Triton is off from then


def enabled(t: torch.Tensor) -> bool:
    """True iff ``t`` takes the Triton kernels (a CUDA tensor, Triton present, not disabled by
    RANKSCOPE_GPU_KERNELS=torch or by an earlier failure)."""
    return (
        triton is not None
        and not _FAILED
        and t.is_cuda
        and os.environ.get("RANKSCOPE_GPU_KERNELS", "triton") != "torch"
    )


def disable(error: Exception) -> None:
    """Turns the Triton kernels off for this process after ``error``, which a kernel raised
    before it ran (Triton compiles each kernel and a C launcher at the first launch: a machine
    without a C compiler, or a GPU Triton cannot target, fails there), with one warning; callers
    then take the torch ops. A failure after a launch (a CUDA error) is not recoverable here."""
    if not _FAILED:
        _FAILED.append(repr(error))
        import warnings

        warnings.warn(
            f"rankscope: the Triton kernels failed ({repr(error)[:300]}); the GPU path "
            "uses torch operations from now on (slower; docs/PERFORMANCE.md)",
            RuntimeWarning,
            stacklevel=2,
        )


FELL_BACK = object()  # what ``attempt`` returns when the kernel could not run


def attempt(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or FELL_BACK after ``disable`` when it raised (Triton cannot run
    here): the caller then takes the torch ops."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a compiler or launcher error
        disable(e)
        return FELL_BACK


_INTERPRETER_PROGRAMS = 3  # programs of a persistent grid on a non-CUDA device (below)


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        # Reached only under Triton's interpreter (TRITON_INTERPRET=1, which runs the kernels on
        # CPU tensors with numpy, one program after another), whose tests call the launchers
        # directly; ``enabled`` keeps every non-CUDA tensor on the torch ops otherwise. A small
        # fixed grid, odd, so that programs take uneven shares of the tiles.
        return _INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _PROGRAM_FACTOR)
    n = _PROGRAMS.get(key)
    if n is None:
        n = _PROGRAMS[key] = (
            _PROGRAM_FACTOR * torch.cuda.get_device_properties(index).multi_processor_count
        )
    return n


if triton is not None:

    @triton.jit
    def _sketch_tile(
        x_ptr,
        first_block,
        lo,
        hi,
        base,
        seed,
        dim,
        golden,
        m1,
        m2,
        row,
        acc,
        ss,
        BLOCKS: tl.constexpr,
        Q: tl.constexpr,
        DOT: tl.constexpr,
        EXACT_TF32: tl.constexpr,
    ):
        """Sketches the coordinates g in [lo, hi) of hash blocks first_block .. + BLOCKS, read
        at x_ptr[base + g]. Returns (acc, ss + their squares in float64).

        DOT False: each signed value is atomically added into the float32 ``row`` of ``dim``
        bins (acc is passed through). DOT True (dim = 32 Q): with start = 32 q + r, block b's
        32 values land in bins 32 q_b + j, j = r_b .. r_b + 31 (mod dim); each block's values
        are shifted by r_b into a row of 64 (a gather), and a one-hot [Q, BLOCKS] matrix of the
        q_b times those rows, on the tensor cores, adds them into acc [Q, 64] (acc[q, j] is bin
        32 q + j mod dim). One-hot entries are exact; bfloat16 and float16 values are exact
        operands; float32 values take three tf32 products (EXACT_TF32, about float32's
        precision). Accumulation is float32, in a fixed order."""
        o = tl.arange(0, 32)
        gb = first_block + tl.arange(0, BLOCKS).to(tl.int64)  # global hash blocks
        g = gb[:, None] * 32 + o[None, :]  # [BLOCKS, 32] global coordinates
        mask = (g >= lo) & (g < hi)
        xr = tl.load(x_ptr + (base + g), mask=mask, other=0.0)
        z = (gb + 1).to(tl.uint64) * golden + tl.cast(seed, tl.uint64)
        z = (z ^ (z >> 30)) * m1
        z = (z ^ (z >> 27)) * m2
        z = z ^ (z >> 31)
        # The start bin, (mix >> 32) % dim, fits 32 bits.
        start = ((z >> 32).to(tl.uint32) % tl.cast(dim, tl.uint32)).to(tl.int32)
        # Sign: bit o (< 32) of the mix, in its low word.
        low = z.to(tl.uint32)
        negative = ((low[:, None] >> o[None, :].to(tl.uint32)) & 1) != 0
        if DOT:
            v = tl.where(negative, -xr, xr)
            j = tl.arange(0, 64)
            src = j[None, :] - (start & 31)[:, None]  # [BLOCKS, 64]
            inside = (src >= 0) & (src < 32)
            w = tl.gather(v, tl.where(inside, src, 0), axis=1)
            w = tl.where(inside, w, tl.zeros_like(w))
            onehot = (tl.arange(0, Q)[:, None] == (start >> 5)[None, :]).to(w.dtype)
            if EXACT_TF32:
                acc = tl.dot(onehot, w, acc, input_precision="tf32x3")
            else:
                acc = tl.dot(onehot, w, acc)
        else:
            x = xr.to(tl.float32)
            bins = start[:, None] + o[None, :]  # dim >= 32: wraps at most once
            bins = tl.where(bins >= dim, bins - dim, bins)
            tl.atomic_add(row + bins, tl.where(negative, -x, x), mask=mask, sem="relaxed")
        x64 = xr.to(tl.float64)
        return acc, ss + x64 * x64  # a float's square is exact in float64

    @triton.jit
    def _sketch_flush(row, acc, dim, Q: tl.constexpr, DOT: tl.constexpr):
        if DOT:
            bins = (tl.arange(0, Q)[:, None] * 32 + tl.arange(0, 64)[None, :]) % dim
            tl.atomic_add(row + bins, acc, sem="relaxed")

    @triton.jit
    def _sketch_kernel(
        x_ptr,
        n,
        offset,
        first_block,
        n_tiles,
        seed,
        dim,
        golden,
        m1,
        m2,
        rows_ptr,
        ss_ptr,
        BLOCKS: tl.constexpr,
        Q: tl.constexpr,
        DOT: tl.constexpr,
        EXACT_TF32: tl.constexpr,
    ):
        """Coordinates [offset, offset + n) read at x_ptr[0 .. n): persistent programs take
        tiles of BLOCKS hash blocks, each into its own row of rows_ptr."""
        pid = tl.program_id(0)
        row = rows_ptr + pid.to(tl.int64) * dim
        acc = tl.zeros([Q, 64], dtype=tl.float32)
        ss = tl.zeros([BLOCKS, 32], dtype=tl.float64)
        for t in range(pid, n_tiles, tl.num_programs(0)):
            acc, ss = _sketch_tile(
                x_ptr,
                first_block + tl.cast(t, tl.int64) * BLOCKS,
                offset,
                offset + n,
                -offset,
                seed,
                dim,
                golden,
                m1,
                m2,
                row,
                acc,
                ss,
                BLOCKS,
                Q,
                DOT,
                EXACT_TF32,
            )
        _sketch_flush(row, acc, dim, Q, DOT)
        tl.atomic_add(ss_ptr + pid, tl.sum(tl.sum(ss, axis=1), axis=0), sem="relaxed")

    @triton.jit
    def _sketch_pieces_kernel(
        x_ptr,
        starts_ptr,
        counts_ptr,
        goffs_ptr,
        n_pieces,
        seed,
        dim,
        golden,
        m1,
        m2,
        rows_ptr,
        ss_ptr,
        BLOCKS: tl.constexpr,
        Q: tl.constexpr,
        DOT: tl.constexpr,
        EXACT_TF32: tl.constexpr,
    ):
        """The pieces of a segment table (``pieces``): piece p holds global coordinates
        [goff, goff + count) at x_ptr[start ..], within one aligned tile of BLOCKS blocks."""
        pid = tl.program_id(0)
        row = rows_ptr + pid.to(tl.int64) * dim
        acc = tl.zeros([Q, 64], dtype=tl.float32)
        ss = tl.zeros([BLOCKS, 32], dtype=tl.float64)
        for p in range(pid, n_pieces, tl.num_programs(0)):
            start = tl.load(starts_ptr + p)
            goff = tl.load(goffs_ptr + p)
            count = tl.load(counts_ptr + p)
            acc, ss = _sketch_tile(
                x_ptr,
                goff // 32,
                goff,
                goff + count,
                start - goff,
                seed,
                dim,
                golden,
                m1,
                m2,
                row,
                acc,
                ss,
                BLOCKS,
                Q,
                DOT,
                EXACT_TF32,
            )
        _sketch_flush(row, acc, dim, Q, DOT)
        tl.atomic_add(ss_ptr + pid, tl.sum(tl.sum(ss, axis=1), axis=0), sem="relaxed")

    @triton.jit
    def _fold_kernel(bits_ptr, n, offset, n_tiles, out_ptr, TILE: tl.constexpr):
        """F of bits_ptr[0 .. n) at global indices offset + i. Program pid takes tiles
        t = pid + m * G (m = 0 .. M-1), so element (m, lane) has weight
        2 (offset + pid TILE + lane) + 1 + 2 G TILE m; per lane it keeps A = sum_m c and
        R = sum of the running A (no multiply in the loop): sum_m m c = M A - R."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        lanes = tl.arange(0, TILE)
        a = tl.zeros([TILE], dtype=tl.int64)
        r = tl.zeros([TILE], dtype=tl.int64)
        m = 0
        for t in range(pid, n_tiles, programs):
            idx = tl.cast(t, tl.int64) * TILE + lanes
            c = tl.load(bits_ptr + idx, mask=idx < n, other=-1).to(tl.int64) + 1  # 0 if masked
            a += c
            r += a
            m += 1
        w = 2 * (offset + pid.to(tl.int64) * TILE + lanes) + 1
        mc = m * a - r  # sum_m m c, per lane
        total = w * a + (2 * programs * TILE).to(tl.int64) * mc
        tl.store(out_ptr + pid, tl.sum(total, axis=0))

    @triton.jit
    def _fold_pieces_kernel(
        bits_ptr,
        vals_ptr,
        starts_ptr,
        counts_ptr,
        goffs_ptr,
        n_pieces,
        out_ptr,
        TILE: tl.constexpr,
        SQUARES: tl.constexpr,
    ):
        """F of the pieces of a segment table (bits_ptr: the values' bits as integers): piece
        (start, count, goff) adds sum_lane c (2 (goff + lane) + 1) = (2 goff + 1) sum c +
        2 sum lane c, c = bits + 1. Writes program pid's F at out[pid] and, with SQUARES, the
        float64 sum of the squares of the values (vals_ptr: the same memory as floats), bit for
        bit, at out[programs + pid]."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        lanes = tl.arange(0, TILE)
        per_lane = tl.zeros([TILE], dtype=tl.int64)
        s = tl.zeros([TILE], dtype=tl.int64)
        sq = tl.zeros([TILE], dtype=tl.float64)
        for p in range(pid, n_pieces, programs):
            start = tl.load(starts_ptr + p)
            count = tl.load(counts_ptr + p)
            goff = tl.load(goffs_ptr + p)
            c = tl.load(bits_ptr + start + lanes, mask=lanes < count, other=-1).to(tl.int64) + 1
            per_lane += c
            s += (2 * goff + 1) * c
            if SQUARES:  # the same lines again, from L1
                x = tl.load(vals_ptr + start + lanes, mask=lanes < count, other=0.0)
                x64 = x.to(tl.float64)
                sq += x64 * x64
        total = s + 2 * lanes.to(tl.int64) * per_lane
        tl.store(out_ptr + pid, tl.sum(total, axis=0))
        if SQUARES:
            tl.store(out_ptr + programs + pid, tl.sum(sq, axis=0).to(tl.int64, bitcast=True))

    @triton.jit
    def _fold_tensors_kernel(
        base_ptr, table_ptr, n_tensors, out_ptr, TILE: tl.constexpr, BITS: tl.constexpr
    ):
        """F of several tensors of one dtype in one launch: row i of the table is (element
        offset from base_ptr, count, global offset). Every program takes its share of every
        tensor's tiles."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        lanes = tl.arange(0, TILE)
        acc = tl.zeros([TILE], dtype=tl.int64)
        for i in range(0, n_tensors):
            off = tl.load(table_ptr + 3 * i)
            n = tl.load(table_ptr + 3 * i + 1)
            goff = tl.load(table_ptr + 3 * i + 2)
            for t in range(pid, (n + TILE - 1) // TILE, programs):
                idx = tl.cast(t, tl.int64) * TILE + lanes
                mask = idx < n
                x = tl.load(base_ptr + off + idx, mask=mask, other=0)
                c = tl.where(mask, x.to(BITS, bitcast=True).to(tl.int64) + 1, 0)
                acc += c * (2 * (goff + idx) + 1)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))


_DOT_FAILED = []  # the tensor-core kernel's compile error, once it failed


def _variant(dtype: torch.dtype, dim: int):
    """(Q, DOT, EXACT_TF32) for a sketch of ``dim`` bins over ``dtype`` values. The tensor-core
    kernel where dim is 32 Q with Q a power of two from 16 to 128 (dims 512 .. 4,096) for
    bfloat16 and float16 values, and for float32 values up to dim 1,024 (their three tf32
    products make larger dims slower than the atomic kernel: docs/PERFORMANCE.md, "GPU
    kernels"); else one atomic add a value. RANKSCOPE_GPU_SKETCH=atomic or =dot forces one
    (dot where the dim allows), and a dot kernel that failed to compile here is not tried
    again."""
    q = dim // 32
    choice = os.environ.get("RANKSCOPE_GPU_SKETCH", "auto")
    allowed = (
        dim % 32 == 0
        and 16 <= q <= 128
        and q & (q - 1) == 0
        and not _DOT_FAILED
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    preferred = dtype != torch.float32 or q <= 32
    if allowed and choice != "atomic" and (preferred or choice == "dot"):
        return q, True, dtype == torch.float32
    return 16, False, False


def sketch_partials(device: torch.device, dim: int):
    """The per-program partial sums a TorchSketch's launches add into: float32 rows of ``dim``
    bins and float64 sums of squares, one per program of the persistent grid, zeroed."""
    programs = _programs(device)
    return (
        torch.zeros((programs, dim), dtype=torch.float32, device=device),
        torch.zeros(programs, dtype=torch.float64, device=device),
    )


def _launch_sketch(kernel, flat, grid_args, units, rows, ss, dim):
    programs = min(rows.shape[0], units)
    q, dot, exact = _variant(flat.dtype, dim)
    try:
        kernel[(programs,)](
            flat,
            *grid_args,
            rows,
            ss,
            BLOCKS=_SKETCH_BLOCKS,
            Q=q,
            DOT=dot,
            EXACT_TF32=exact,
            num_warps=_SKETCH_WARPS or (8 if dot and q >= 64 else 4),
        )
    except Exception as e:  # noqa: BLE001 - a compiler error: the atomic kernel from now on
        if not dot:
            raise
        _DOT_FAILED.append(repr(e))
        import warnings

        warnings.warn(
            f"rankscope: the tensor-core sketch kernel failed ({e!r}); using the atomic one",
            RuntimeWarning,
            stacklevel=2,
        )
        kernel[(programs,)](
            flat,
            *grid_args,
            rows,
            ss,
            BLOCKS=_SKETCH_BLOCKS,
            Q=16,
            DOT=False,
            EXACT_TF32=False,
            num_warps=4,
        )


def sketch_add(
    rows: torch.Tensor, ss: torch.Tensor, values: torch.Tensor, offset: int, seed: int, dim: int
) -> None:
    """Adds the flat view of ``values`` as coordinates [offset, offset + numel) into the
    partial sums ``rows`` and ``ss`` (``sketch_partials``), on the values' device, in one
    launch. Requires dim >= 32."""
    flat = values.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    if n == 0:
        return
    first_block = offset // 32
    n_tiles = ((offset + n - 1) // 32 - first_block) // _SKETCH_BLOCKS + 1
    _launch_sketch(
        _sketch_kernel,
        flat,
        (n, offset, first_block, n_tiles, seed & _MASK64, dim, _GOLDEN, _M1, _M2),
        n_tiles,
        rows,
        ss,
        dim,
    )


def sketch_add_pieces(
    rows: torch.Tensor, ss: torch.Tensor, flat: torch.Tensor, table, seed: int, dim: int
) -> None:
    """``sketch_add`` of the segments of a flat contiguous buffer, given as a ``pieces``
    table: one launch for a whole DDP bucket. Requires dim >= 32."""
    starts, counts, goffs = table
    n_pieces = starts.numel()
    if n_pieces == 0:
        return
    _launch_sketch(
        _sketch_pieces_kernel,
        flat,
        (starts, counts, goffs, n_pieces, seed & _MASK64, dim, _GOLDEN, _M1, _M2),
        n_pieces,
        rows,
        ss,
        dim,
    )


def fold(bits: torch.Tensor, offset: int) -> torch.Tensor:
    """The fingerprint of the flat contiguous integer view ``bits`` (fingerprint._terms' input)
    at global indices [offset, offset + n): a 0-d int64 tensor, bit-identical to
    fingerprint.fold."""
    n = bits.numel()
    n_tiles = (n + _FOLD_TILE - 1) // _FOLD_TILE
    programs = max(1, min(_programs(bits.device), n_tiles))
    out = torch.empty(programs, dtype=torch.int64, device=bits.device)
    _fold_kernel[(programs,)](bits, n, offset, n_tiles, out, TILE=_FOLD_TILE, num_warps=4)
    return out.sum()


def piece_table(layout):
    """The segments of a SegmentLayout cut where the global index crosses a multiple of PIECE,
    so that a piece lies in one sketch tile: lists (buffer start, count, global offset)."""
    starts, counts, goffs = [], [], []
    for s, n, g in zip(layout.starts, layout.counts, layout.global_offsets):
        end = g + n
        while g < end:
            cut = min(end, (g // PIECE + 1) * PIECE)
            starts.append(s)
            counts.append(cut - g)
            goffs.append(g)
            s += cut - g
            g = cut
    return starts, counts, goffs


_BITS = {}  # torch dtype -> the Triton integer type of its bits (filled below)
if triton is not None:
    _BITS = {
        torch.float32: tl.int32,
        torch.bfloat16: tl.int16,
        torch.float16: tl.int16,
        torch.float64: tl.int64,
        torch.int32: tl.int32,
        torch.int64: tl.int64,
        torch.int16: tl.int16,
    }


def fold_pieces(bits: torch.Tensor, table, values: torch.Tensor = None):
    """The fingerprint of the pieces ``table`` (three int64 device tensors: buffer start, count,
    global offset of each piece of ``piece_table``) of the flat contiguous integer view ``bits``
    of a buffer: a 0-d int64 tensor, bit-identical to fingerprint.fold_segments. With ``values``
    (the same buffer as floats), (per-program fingerprints [P] int64, per-program float64 sums
    of squares [P]) instead, from the same pass: their sums are the fingerprint and the sum of
    squares."""
    starts, counts, goffs = table
    n_pieces = starts.numel()
    programs = max(1, min(_programs(bits.device), n_pieces))
    squares = values is not None
    out = torch.zeros(2 * programs if squares else programs, dtype=torch.int64, device=bits.device)
    _fold_pieces_kernel[(programs,)](
        bits,
        values if squares else bits,
        starts,
        counts,
        goffs,
        n_pieces,
        out,
        TILE=PIECE,
        SQUARES=squares,
        num_warps=4,
    )
    if squares:
        return out[:programs], out[programs:].view(torch.float64)
    return out.sum()


def fold_tensors(
    base: torch.Tensor, table: torch.Tensor, n_tensors: int, largest: int
) -> torch.Tensor:
    """The fingerprint of ``n_tensors`` contiguous tensors of ``base``'s dtype on its CUDA
    device in one launch: row i of ``table`` (an int64 device tensor) is (element offset from
    ``base``, count, global offset); ``largest`` is the largest count. A 0-d int64 tensor,
    bit-identical to the sum of fingerprint.fold of each."""
    programs = max(1, min(_programs(base.device), (largest + _FOLD_TILE - 1) // _FOLD_TILE))
    out = torch.empty(programs, dtype=torch.int64, device=base.device)
    _fold_tensors_kernel[(programs,)](
        base, table, n_tensors, out, TILE=_FOLD_TILE, BITS=_BITS[base.dtype], num_warps=4
    )
    return out.sum()
