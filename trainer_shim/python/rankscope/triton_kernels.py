"""Fused Triton kernels for GPU gradients: the count sketch and the replica fingerprint in one
pass over the tensor each, instead of the ~10 elementwise torch passes of torch_sketch.py and
fingerprint.py (the torch-op path, and the path CI tests on CPU). This module only launches:
which kernel and variant runs for a tensor, and what happens when one fails, is
rankscope._backend's decision (its docstring has the table); errors propagate to it.

How their results relate to the torch-op path (tests/python/test_gpu.py checks both):

* ``fold`` / ``fold_pieces``: the same 64-bit wrapping integer sum, so bit-identical to
  fingerprint.fold / fold_segments. ``fold_pieces`` (_fold_pieces_kernel) is the one kernel for a
  table of pieces: a bucket's segments (with or without the squares), and a parameter check's
  tensors of one dtype in one launch (fingerprint.fold_many: pieces at element offsets of any
  sign from the first tensor). ``fold`` (_fold_kernel) is the same sum for one contiguous tensor
  without a table, kept for its speed on 16-bit values (H100, 2^28 bfloat16 values: 0.258 ms,
  70 % of the copy, against 0.351 ms, 52 %, through pieces; docs/PERFORMANCE.md "Kernels").
* ``sketch_add`` / ``sketch_add_pieces``: the same bins and signs (SketchMix of the block index,
  as torch_sketch.py and agent/include/rankscope/sketch.h), added into per-program float32 rows
  of ``dim`` bins that DeviceSketch folds into float64 (a fixed order) when the bins are read.
  Two variants: one atomic add per value into the program's row, or (DOT) each block's 32
  values shifted into a row of 64 and added by a one-hot matrix product on the tensor cores into
  a [dim/32, 64] register tile flushed into the row at the end (bfloat16 and float16 values are
  exact operands; float32 takes three tf32 products, about float32's precision). Either way a
  bin is within float32 rounding of the torch-op path's float64 sum, and, because atomic adds
  into a row land in any order, not bit-reproducible from run to run at that rounding level. The
  sum of squares adds exact float64 squares in float64, as the torch-op path does, in another
  order.

Nothing here synchronizes the host with the device: partial buffers are allocated on the device
and reduced with torch ops; the segment and offset tables the kernels read come to the device
from pinned memory without blocking (fingerprint.py builds and caches them). The first launch of
each kernel in a process compiles it (seconds).

tests/python/test_triton_interpret.py runs every kernel on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set before this module is imported). For it, loop indices are cast
with ``tl.cast(t, ...)``, not ``t.to(...)`` (an interpreted loop index is a Python int; compiled,
the two are the same IR), and ``_programs`` gives a non-CUDA device a small fixed grid.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch without Triton (e.g. torch 2.2 on Python 3.12): the torch-op path
    triton = None

from rankscope.torch_sketch import SKETCH_MIX_CONSTANTS, flat_contiguous

# SketchMix's constants, the package's one Python definition (rankscope.torch_sketch, from
# agent/include/rankscope/sketch.h), passed to the kernels as arguments: Triton types an argument
# of 2**63 or more as uint64, which the hash's arithmetic needs.
_GOLDEN, _M1, _M2 = SKETCH_MIX_CONSTANTS
_MASK64 = (1 << 64) - 1

_SKETCH_BLOCKS = 64  # hash blocks (of 32 coordinates) per tile
PIECE = 32 * _SKETCH_BLOCKS  # a tile: the most elements one piece of a segment table holds
_FOLD_TILE = 4096  # elements per tile of a contiguous fingerprint
_PROGRAM_FACTOR = 4  # programs of a persistent grid per multiprocessor
_SKETCH_WARPS = None  # warps of a sketch program (None: 4, or 8 for the larger dot tiles)
_PROGRAMS = {}  # (device index, factor) -> programs of a persistent grid


_INTERPRETER_PROGRAMS = 3  # programs of a persistent grid on a non-CUDA device (below)


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        # Reached only under Triton's interpreter (TRITON_INTERPRET=1, which runs the kernels on
        # CPU tensors with numpy, one program after another), whose tests call the launchers
        # directly; rankscope._backend keeps every non-CUDA tensor off Triton otherwise. A small
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


def sketch_partials(device: torch.device, dim: int):
    """The per-program partial sums a DeviceSketch's launches add into: float32 rows of ``dim``
    bins and float64 sums of squares, one per program of the persistent grid, zeroed."""
    programs = _programs(device)
    return (
        torch.zeros((programs, dim), dtype=torch.float32, device=device),
        torch.zeros(programs, dtype=torch.float64, device=device),
    )


def _launch_sketch(kernel, flat, grid_args, units, rows, ss, variant):
    """One launch of a sketch kernel in ``variant`` (a rankscope._backend.Choice: ``variant``
    "atomic" or "dot", ``q``, ``exact_tf32``). Errors propagate: the caller's _backend.run
    decides what follows."""
    dot = variant.variant == "dot"
    kernel[(min(rows.shape[0], units),)](
        flat,
        *grid_args,
        rows,
        ss,
        BLOCKS=_SKETCH_BLOCKS,
        Q=variant.q if dot else 16,
        DOT=dot,
        EXACT_TF32=dot and variant.exact_tf32,
        num_warps=_SKETCH_WARPS or (8 if dot and variant.q >= 64 else 4),
    )


def sketch_add(
    rows: torch.Tensor,
    ss: torch.Tensor,
    values: torch.Tensor,
    offset: int,
    seed: int,
    dim: int,
    variant,
) -> None:
    """Adds the flat view of ``values`` as coordinates [offset, offset + numel) into the
    partial sums ``rows`` and ``ss`` (``sketch_partials``), on the values' device, in one
    launch of ``variant`` (rankscope._backend.sketch_variant). Requires dim >= 32."""
    flat = flat_contiguous(values)
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
        variant,
    )


def sketch_add_pieces(
    rows: torch.Tensor, ss: torch.Tensor, flat: torch.Tensor, table, seed: int, dim: int, variant
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
        variant,
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
    """The segments of a SegmentLayout (or any object with ``starts``, ``counts`` and
    ``global_offsets``; starts may be negative, element offsets from a base) cut where the
    global index crosses a multiple of PIECE, so that a piece lies in one sketch tile and holds
    at most PIECE elements: lists (buffer start, count, global offset)."""
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


def fold_pieces(bits: torch.Tensor, table, values: torch.Tensor = None):
    """The fingerprint of the pieces ``table`` (three int64 device tensors: start, count,
    global offset of each piece of ``piece_table``) of the integer view ``bits`` of a buffer (a
    start is an element offset from ``bits``' first element, of any sign: the pieces may lie in
    other tensors' memory, as a parameter check's do): a 0-d int64 tensor, bit-identical to
    fingerprint.fold_segments. With ``values`` (the same memory as floats), (per-program
    fingerprints [P] int64, per-program float64 sums of squares [P]) instead, from the same
    pass: their sums are the fingerprint and the sum of squares."""
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
