"""Fused Triton kernels for GPU gradients: the count sketch and the replica fingerprint in one
pass over the tensor each, instead of the ~10 elementwise torch passes of torch_sketch.py and
fingerprint.py (which stay the fallback, and the path CI tests on CPU).

How their results relate to the torch-op path (tests/python/test_gpu.py checks both):

* ``fold`` / ``fold_segments``: the same 64-bit wrapping integer sum, so bit-identical.
* ``sketch_add``: the same bins and signs (SketchMix of the block index, as torch_sketch.py and
  agent/include/rankscope/sketch.h). Each program adds its coordinates into its own float32 row of
  ``dim`` bins with atomic adds; the rows are then summed in float64 in a fixed order. So a bin is
  a float64 sum of float32 partial sums of at most ``n / programs / dim`` terms on average (the
  C++ kernel also sums segments in float first): within float32 rounding of the torch-op path's
  float64 sums, and, because atomic adds into a row land in any order, not bit-reproducible from
  run to run at that rounding level. The sum of squares adds exact float64 squares in float64,
  as the torch-op path does, in another order.

Nothing here synchronizes the host with the device: partial buffers are allocated on the device
and reduced with torch ops; segment tables are copied from pinned memory without blocking.

Selection: ``RANKSCOPE_GPU_KERNELS=torch`` forces the torch-op path; the default is ``triton``
where Triton imports and the tensor is on a CUDA device.
"""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Debian's torch has no Triton: the torch-op path
    triton = None

# SketchMix constants (torch_sketch.py), as unsigned 64-bit numbers: Triton types a kernel
# argument of 2**63 or more as uint64.
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1

_SKETCH_BLOCKS = 64  # hash blocks (of 32 coordinates) per tile
PIECE = 32 * _SKETCH_BLOCKS  # a tile: the most elements one piece of a segment table holds
_FOLD_TILE = 4096  # elements per tile of a contiguous fingerprint
_PROGRAMS = {}  # device index -> programs of a persistent grid


def enabled(t: torch.Tensor) -> bool:
    """True iff ``t`` takes the Triton kernels (a CUDA tensor, Triton present, not disabled)."""
    return (triton is not None and t.is_cuda
            and os.environ.get("RANKSCOPE_GPU_KERNELS", "triton") != "torch")


def _programs(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _PROGRAMS.get(index)
    if n is None:
        n = _PROGRAMS[index] = 4 * torch.cuda.get_device_properties(index).multi_processor_count
    return n


if triton is not None:

    @triton.jit
    def _sketch_tile(x_ptr, first_block, lo, hi, base, seed, dim, golden, m1, m2, row, ss,
                     BLOCKS: tl.constexpr):
        """Adds the coordinates g in [lo, hi) of hash blocks first_block .. + BLOCKS, read at
        x_ptr[base + g], into the float32 row of ``dim`` bins; returns ss plus their squares."""
        o = tl.arange(0, 32)
        gb = first_block + tl.arange(0, BLOCKS).to(tl.int64)  # global hash blocks
        g = gb[:, None] * 32 + o[None, :]  # [BLOCKS, 32] global coordinates
        mask = (g >= lo) & (g < hi)
        x = tl.load(x_ptr + (base + g), mask=mask, other=0.0).to(tl.float32)
        z = (gb + 1).to(tl.uint64) * golden + tl.cast(seed, tl.uint64)
        z = (z ^ (z >> 30)) * m1
        z = (z ^ (z >> 27)) * m2
        z = z ^ (z >> 31)
        # The start bin, (mix >> 32) % dim, fits 32 bits; dim >= 32, so start + o wraps once.
        start = ((z >> 32).to(tl.uint32) % tl.cast(dim, tl.uint32)).to(tl.int32)
        bins = start[:, None] + o[None, :]
        bins = tl.where(bins >= dim, bins - dim, bins)
        # Sign: bit o (< 32) of the mix, in its low word.
        low = z.to(tl.uint32)
        negative = ((low[:, None] >> o[None, :].to(tl.uint32)) & 1) != 0
        tl.atomic_add(row + bins, tl.where(negative, -x, x), mask=mask, sem="relaxed")
        x64 = x.to(tl.float64)
        return ss + x64 * x64  # a float32's square is exact in float64

    @triton.jit
    def _sketch_kernel(x_ptr, n, offset, first_block, n_tiles, seed, dim, golden, m1, m2,
                       rows_ptr, ss_ptr, BLOCKS: tl.constexpr):
        """Coordinates [offset, offset + n) read at x_ptr[0 .. n): persistent programs take
        tiles of BLOCKS hash blocks, each into its own row of rows_ptr."""
        pid = tl.program_id(0)
        row = rows_ptr + pid.to(tl.int64) * dim
        ss = tl.zeros([BLOCKS, 32], dtype=tl.float64)
        for t in range(pid, n_tiles, tl.num_programs(0)):
            ss = _sketch_tile(x_ptr, first_block + t.to(tl.int64) * BLOCKS, offset, offset + n,
                              -offset, seed, dim, golden, m1, m2, row, ss, BLOCKS)
        tl.store(ss_ptr + pid, tl.sum(tl.sum(ss, axis=1), axis=0))

    @triton.jit
    def _sketch_pieces_kernel(x_ptr, starts_ptr, counts_ptr, goffs_ptr, n_pieces, seed, dim,
                              golden, m1, m2, rows_ptr, ss_ptr, BLOCKS: tl.constexpr):
        """The pieces of a segment table (``pieces``): piece p holds global coordinates
        [goff, goff + count) at x_ptr[start ..], within one aligned tile of BLOCKS blocks."""
        pid = tl.program_id(0)
        row = rows_ptr + pid.to(tl.int64) * dim
        ss = tl.zeros([BLOCKS, 32], dtype=tl.float64)
        for p in range(pid, n_pieces, tl.num_programs(0)):
            start = tl.load(starts_ptr + p)
            goff = tl.load(goffs_ptr + p)
            count = tl.load(counts_ptr + p)
            ss = _sketch_tile(x_ptr, goff // 32, goff, goff + count, start - goff, seed, dim,
                              golden, m1, m2, row, ss, BLOCKS)
        tl.store(ss_ptr + pid, tl.sum(tl.sum(ss, axis=1), axis=0))

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
            idx = t.to(tl.int64) * TILE + lanes
            c = tl.load(bits_ptr + idx, mask=idx < n, other=-1).to(tl.int64) + 1  # 0 if masked
            a += c
            r += a
            m += 1
        w = 2 * (offset + pid.to(tl.int64) * TILE + lanes) + 1
        mc = m * a - r  # sum_m m c, per lane
        total = w * a + (2 * programs * TILE).to(tl.int64) * mc
        tl.store(out_ptr + pid, tl.sum(total, axis=0))

    @triton.jit
    def _fold_pieces_kernel(bits_ptr, starts_ptr, counts_ptr, goffs_ptr, n_pieces, out_ptr,
                            TILE: tl.constexpr):
        """F of the pieces of a segment table: piece (start, count, goff) adds
        sum_lane c (2 (goff + lane) + 1) = (2 goff + 1) sum c + 2 sum lane c."""
        pid = tl.program_id(0)
        lanes = tl.arange(0, TILE)
        per_lane = tl.zeros([TILE], dtype=tl.int64)
        s = tl.zeros([TILE], dtype=tl.int64)
        for p in range(pid, n_pieces, tl.num_programs(0)):
            start = tl.load(starts_ptr + p)
            count = tl.load(counts_ptr + p)
            goff = tl.load(goffs_ptr + p)
            c = tl.load(bits_ptr + start + lanes, mask=lanes < count, other=-1).to(tl.int64) + 1
            per_lane += c
            s += (2 * goff + 1) * c
        total = s + 2 * lanes.to(tl.int64) * per_lane
        tl.store(out_ptr + pid, tl.sum(total, axis=0))


def _rows(device, programs: int, dim: int):
    return (torch.zeros((programs, dim), dtype=torch.float32, device=device),
            torch.empty(programs, dtype=torch.float64, device=device))


def sketch_add(bins: torch.Tensor, sum_squares: torch.Tensor, values: torch.Tensor, offset: int,
               seed: int, dim: int) -> None:
    """Adds the flat view of ``values`` as coordinates [offset, offset + numel) into ``bins``
    (float64 [dim]) and its sum of squares into ``sum_squares`` (float64 0-d), on the values'
    device. Requires dim >= 32."""
    flat = values.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    if n == 0:
        return
    first_block = offset // 32
    n_tiles = ((offset + n - 1) // 32 - first_block) // _SKETCH_BLOCKS + 1
    programs = min(_programs(flat.device), n_tiles)
    rows, ss = _rows(flat.device, programs, dim)
    _sketch_kernel[(programs,)](flat, n, offset, first_block, n_tiles, seed & _MASK64, dim,
                                _GOLDEN, _M1, _M2, rows, ss, BLOCKS=_SKETCH_BLOCKS, num_warps=4)
    bins.add_(rows.sum(0, dtype=torch.float64))
    sum_squares.add_(ss.sum())


def sketch_add_pieces(bins: torch.Tensor, sum_squares: torch.Tensor, flat: torch.Tensor, table,
                      seed: int, dim: int) -> None:
    """``sketch_add`` of the segments of a flat contiguous buffer, given as a ``pieces``
    table: one launch for a whole DDP bucket. Requires dim >= 32."""
    starts, counts, goffs = table
    n_pieces = starts.numel()
    if n_pieces == 0:
        return
    programs = min(_programs(flat.device), n_pieces)
    rows, ss = _rows(flat.device, programs, dim)
    _sketch_pieces_kernel[(programs,)](flat, starts, counts, goffs, n_pieces, seed & _MASK64,
                                       dim, _GOLDEN, _M1, _M2, rows, ss,
                                       BLOCKS=_SKETCH_BLOCKS, num_warps=4)
    bins.add_(rows.sum(0, dtype=torch.float64))
    sum_squares.add_(ss.sum())


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


def pieces(layout, device: torch.device):
    """``piece_table`` as three int64 tensors on ``device``, copied from pinned memory without
    blocking. Returns (tensors, pinned source): keep the source alive with the tensors."""
    host = torch.tensor(list(piece_table(layout)), dtype=torch.int64).pin_memory()
    dev = host.to(device, non_blocking=True)
    return (dev[0], dev[1], dev[2]), host


def fold_pieces(bits: torch.Tensor, table) -> torch.Tensor:
    """The fingerprint of the pieces ``table`` (from ``pieces``) of the flat integer view
    ``bits``: a 0-d int64 tensor, bit-identical to fingerprint.fold_segments."""
    starts, counts, goffs = table
    n_pieces = starts.numel()
    programs = max(1, min(_programs(bits.device), n_pieces))
    out = torch.empty(programs, dtype=torch.int64, device=bits.device)
    _fold_pieces_kernel[(programs,)](bits, starts, counts, goffs, n_pieces, out, TILE=PIECE,
                                     num_warps=4)
    return out.sum()
