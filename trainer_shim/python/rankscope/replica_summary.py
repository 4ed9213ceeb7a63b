"""The float summary sent beside the parameter fingerprint when replicas are compared with a
tolerance (docs/DESIGN.md "Replica check: exact or tolerance"; the collector's side is
collector/analysis/replica_tolerance.h).

For the parameters x (every value at its global flat index g, the fingerprint's numbering) the
summary is

    P_j = sum_i s_j(g_i) x_i            (j = 0 .. PROJECTIONS - 1, float64)
    R   = sqrt(sum_t (2^(1 - p_t) ||x_t||)^2) + C 2^-53 sum_i |x_i|

with s_j(g) = -1 where bit 60 + j of splitmix64(g) is set, else +1 (splitmix64: z = g +
0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9; z = (z ^ z >> 27) *
0x94D049BB133111EB; z ^ z >> 31, all mod 2^64, logical shifts), p_t the precision (significand
bits) of tensor t's dtype, and C the length of the longest chain of float64 additions that makes a
P_j (below). Two replicas whose values differ by d have P_j differences sum_i s_j(g_i) d_i: over
the fixed pseudo-random signs a sum of mean 0 and variance ||d||^2. A value's ulp is at most
2^(1 - p) |x| (normal numbers), so replicas that differ by at most k ulps in every value have
||d|| <= k R: what the collector's tolerance is built on.

Rounding of the summary itself: s x is exact in float64 (any float value, and its negation, is a
float64 number). The C++ kernel (CPU tensors, rankscope._native.replica_summary_segments) adds
blocks of 1,024 values in order and the blocks' sums pairwise; the torch-op path sums chunks of
at most CHUNK values by halving (a tree of depth 20) and adds the chunks' sums in order. Either
way every P_j is a chain of at most C additions, C = (the path's chain) + (the partial sums added
after it), and its error is at most C 2^-53 sum_i |x_i| (the classical bound for recursive
summation), which R includes. The two paths differ within that bound, not bit for bit; the ranks
of a job run the same one.
Every replica computes its summary the same way, so replicas with equal bits have equal summaries.

The reduced gradient is summarized the same way, bucket by bucket (``partial_segments``: a DDP
bucket's segments at their global offsets), and the collector's tolerance for it also covers a
reduction summed in another order on each rank (collector/analysis/replica_tolerance.h).

Cost (the signs are recomputed from the indices, never stored): the C++ kernel, one scalar pass,
~22 ns a value on the shared 2-core machine (docs/PERFORMANCE.md "Replica tolerance"); the
torch-op path about 25 passes of int64 and float64 ops. The parameters at each parameter check,
the reduced gradient every step, under the tolerance check only. The monitor computes them for
CPU tensors (the device path's deferred reports do not carry summaries yet: under the tolerance
check such a rank sends no fingerprint).
"""

import math

import torch

from rankscope import _native

PROJECTIONS = 4
CHUNK = 1 << 20

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """The int64 with the bit pattern of the uint64 ``c``."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """z >> k as a logical shift of the uint64 bit pattern (torch's is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def signs(indices: torch.Tensor) -> torch.Tensor:
    """s_j(g) for int64 global indices ``indices`` (n values): a [PROJECTIONS, n] float64 tensor
    of +1 and -1."""
    z = indices.to(torch.int64) + _GOLDEN  # int64 arithmetic wraps as uint64 would
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    z = z ^ _lsr(z, 31)
    shifts = torch.arange(60, 60 + PROJECTIONS, dtype=torch.int64, device=z.device)
    bits = (z.unsqueeze(0) >> shifts.unsqueeze(1)) & 1
    return bits.to(torch.float64).mul_(-2.0).add_(1.0)


def _tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Row sums of a [rows, n] float64 tensor by halving (zeros pad n to a power of two; adding
    them is exact): each sum is a tree of depth ceil(log2 n)."""
    n = t.shape[1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        t = torch.nn.functional.pad(t, (0, width - n))
    while width > 1:
        width //= 2
        t = t[:, :width] + t[:, width:]
    return t[:, 0]


def precision(dtype: torch.dtype) -> int:
    """p: the significand bits of a floating dtype (24 float32, 8 bfloat16, 11 float16, 53
    float64); 53 for an integer dtype (its values are exact in float64)."""
    if dtype.is_floating_point:
        return 1 - round(math.log2(torch.finfo(dtype).eps))  # eps = 2^(1 - p)
    return 53


_NATIVE_CODES = {}
if hasattr(_native, "replica_summary_segments"):
    _NATIVE_CODES = {
        torch.float32: _native.DTYPE_FLOAT32,
        torch.bfloat16: _native.DTYPE_BFLOAT16,
        torch.float16: _native.DTYPE_FLOAT16,
        torch.float64: _native.DTYPE_FLOAT64,
    }


class Partial:
    """The parts of a summary over some of the values, added with ``add``; ``finish`` gives
    (projections, R). ``chain`` bounds the float64 additions behind each projection."""

    __slots__ = ("projections", "squares", "magnitude", "chain")

    def __init__(self):
        self.projections = None  # [PROJECTIONS] float64 CPU tensor
        self.squares = 0.0  # sum over the values of (2^(1-p) x)^2
        self.magnitude = 0.0  # sum |x|
        self.chain = 0

    def add(self, other: "Partial") -> None:
        """Adds ``other``'s values: one more addition after the longer of the two chains."""
        if other.projections is None:
            return
        if self.projections is None:
            self.projections = other.projections.clone()
            self.chain = other.chain
        else:
            self.projections += other.projections
            self.chain = max(self.chain, other.chain) + 1
        self.squares += other.squares
        self.magnitude += other.magnitude

    def finish(self) -> tuple[list[float], float]:
        if self.projections is None:
            return [0.0] * PROJECTIONS, 0.0
        rounding = math.sqrt(self.squares) + self.chain * 2.0**-53 * self.magnitude
        return [float(v) for v in self.projections], rounding


def _native_ok(flat: torch.Tensor, native: bool) -> bool:
    return native and flat.device.type == "cpu" and flat.dtype in _NATIVE_CODES


def _native_partial(flat: torch.Tensor, starts, counts, offsets) -> Partial:
    """The C++ kernel (rankscope._native.replica_summary_segments) over segments of ``flat``
    (a contiguous CPU tensor): blocks of 1,024 values in order, the blocks' sums pairwise."""
    projections, squares, magnitude, chain = _native.replica_summary_segments(
        flat.data_ptr(), _NATIVE_CODES[flat.dtype], starts, counts, offsets
    )
    out = Partial()
    out.projections = torch.tensor(projections, dtype=torch.float64)
    out.squares = (2.0 ** (1 - precision(flat.dtype))) ** 2 * squares
    out.magnitude = magnitude
    out.chain = int(chain)
    return out


def _chunk_sum(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_i s_j(g_i) x_i of one chunk (float64 values, int64 indices): [PROJECTIONS]."""
    return _tree_sum(signs(g).mul_(x))


def _torch_partial(pieces) -> Partial:
    """The torch-op path over ``pieces``, (float64 values, int64 global indices) chunk pairs of
    at most CHUNK values: each chunk summed by halving, the chunks' sums added in order."""
    out = Partial()
    chunks = 0
    for x, g in pieces:
        part = _chunk_sum(x, g).cpu()
        out.projections = part if out.projections is None else out.projections + part
        chunks += 1
        out.magnitude += float(x.abs().sum())
    out.chain = (CHUNK - 1).bit_length() + chunks
    return out


def partial(tensors, offsets, native: bool = True) -> Partial:
    """The summary's parts of ``tensors`` (each flattened, at global flat index
    ``offsets[t]``): CPU tensors of float32, bfloat16, float16 and float64 through the C++
    kernel (``native``), others with torch ops on their device, read back (a synchronization:
    the monitor calls it for CPU tensors only)."""
    out = Partial()
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            flat = t.detach().reshape(-1)
            n = flat.numel()
            if n == 0:
                continue
            if _native_ok(flat, native):
                out.add(_native_partial(flat.contiguous(), [0], [n], [int(offset)]))
                continue
            values = flat.to(torch.float64)
            unit = 2.0 ** (1 - precision(flat.dtype))
            pieces = []
            for start in range(0, n, CHUNK):
                x = values[start : start + CHUNK]
                g = torch.arange(
                    offset + start, offset + start + x.numel(), dtype=torch.int64, device=x.device
                )
                pieces.append((x, g))
            part = _torch_partial(pieces)
            part.squares = (unit * float(torch.linalg.vector_norm(values))) ** 2
            out.add(part)
    return out


def partial_segments(buffer: torch.Tensor, layout, native: bool = True) -> Partial:
    """The summary's parts of the segments of a flat ``buffer`` that ``layout`` (a
    fingerprint.SegmentLayout: a DDP bucket's parameters) describes, values outside every
    segment left out: through the C++ kernel for a CPU buffer (``native``), else with torch ops,
    each position's global index and segment mask from a binary search of the segments' starts
    (a constant number of ops per chunk, whatever the number of parameters)."""
    flat = buffer.detach().reshape(-1)
    if not layout.counts:
        return Partial()
    if _native_ok(flat, native):
        return _native_partial(
            flat.contiguous(), layout.starts, layout.counts, layout.global_offsets
        )
    device = flat.device
    starts, ends, shift = layout.tensors(device)  # shift = 2 (offset - start)
    order = torch.argsort(starts)
    starts, ends, offset_minus_start = starts[order], ends[order], shift[order] // 2
    unit = 2.0 ** (1 - precision(flat.dtype))
    squares = 0.0
    pieces = []
    with torch.no_grad():
        for begin in range(0, flat.numel(), CHUNK):
            x = flat[begin : begin + CHUNK].to(torch.float64)
            pos = torch.arange(begin, begin + x.numel(), dtype=torch.int64, device=device)
            seg = torch.searchsorted(starts, pos, right=True).sub_(1).clamp_(min=0)
            inside = (pos >= starts[seg]) & (pos < ends[seg])
            x = torch.where(inside, x, torch.zeros((), dtype=torch.float64, device=device))
            pieces.append((x, pos.add_(offset_minus_start[seg])))
            squares += (unit * float(torch.linalg.vector_norm(x))) ** 2
        out = _torch_partial(pieces)
    out.squares = squares
    return out


def summarize(tensors, offsets, native: bool = True) -> tuple[list[float], float]:
    """(P_0 .. P_{PROJECTIONS-1}, R) of ``tensors`` (each flattened, at global flat index
    ``offsets[t]``), as Python floats."""
    return partial(tensors, offsets, native).finish()
