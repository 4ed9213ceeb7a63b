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

Rounding of the summary itself: s x is exact in float64 (a float32, bfloat16 or float16 value,
and its negation, are float64 numbers); each chunk of at most CHUNK values is summed by halving
(a tree of depth ceil(log2 CHUNK) = 20), and the chunks' sums are added in order into one
accumulator, so every P_j is a chain of at most C = 20 + (number of chunks) additions and its error
is at most C 2^-53 sum_i |x_i| (the classical bound for recursive summation), which R includes.
Every replica computes its summary the same way, so replicas with equal bits have equal summaries.

The reduced gradient is summarized the same way, bucket by bucket (``partial_segments``: a DDP
bucket's segments at their global offsets), and the collector's tolerance for it also covers a
reduction summed in another order on each rank (collector/analysis/replica_tolerance.h).

Cost: about 25 passes of int64 and float64 torch ops over the values (the signs are recomputed
from the indices, never stored): the parameters at each parameter check, the reduced gradient
every step, under the tolerance check only. Torch ops on the tensors' own device, read back to
the host; the monitor computes them for CPU tensors (the device path's deferred reports do not
carry summaries yet: under the tolerance check such a rank sends no fingerprint).
"""

import math

import torch

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


class Partial:
    """The parts of a summary over some of the values, added with ``add``; ``finish`` gives
    (projections, R)."""

    __slots__ = ("projections", "squares", "magnitude", "chunks")

    def __init__(self):
        self.projections = None  # [PROJECTIONS] float64 tensor
        self.squares = 0.0  # sum over the values of (2^(1-p) x)^2
        self.magnitude = 0.0  # sum |x|
        self.chunks = 0

    def add(self, other: "Partial") -> None:
        if other.projections is not None:
            p = other.projections.cpu()
            self.projections = p if self.projections is None else self.projections + p
        self.squares += other.squares
        self.magnitude += other.magnitude
        self.chunks += other.chunks

    def finish(self) -> tuple[list[float], float]:
        if self.projections is None:
            return [0.0] * PROJECTIONS, 0.0
        chain = (CHUNK - 1).bit_length() + self.chunks
        rounding = math.sqrt(self.squares) + chain * 2.0**-53 * self.magnitude
        return [float(v) for v in self.projections.cpu()], rounding


def _chunk_sum(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum_i s_j(g_i) x_i of one chunk (float64 values, int64 indices): [PROJECTIONS]."""
    return _tree_sum(signs(g).mul_(x))


def partial(tensors, offsets) -> Partial:
    """The summary's parts of ``tensors`` (each flattened, at global flat index
    ``offsets[t]``). Tensors on a device are summed there and read back (a synchronization:
    the monitor calls it for CPU tensors only)."""
    out = Partial()
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            flat = t.detach().reshape(-1)
            n = flat.numel()
            if n == 0:
                continue
            values = flat.to(torch.float64)
            unit = 2.0 ** (1 - precision(flat.dtype))
            out.squares += (unit * float(torch.linalg.vector_norm(values))) ** 2
            out.magnitude += float(values.abs().sum())
            for start in range(0, n, CHUNK):
                x = values[start : start + CHUNK]
                g = torch.arange(
                    offset + start, offset + start + x.numel(), dtype=torch.int64, device=x.device
                )
                part = _chunk_sum(x, g).cpu()
                out.projections = part if out.projections is None else out.projections + part
                out.chunks += 1
    return out


def partial_segments(buffer: torch.Tensor, layout) -> Partial:
    """The summary's parts of the segments of a flat ``buffer`` that ``layout`` (a
    fingerprint.SegmentLayout: a DDP bucket's parameters) describes, values outside every
    segment left out: each position's global index and segment mask come from a binary search
    of the segments' starts (a constant number of ops per chunk, whatever the number of
    parameters)."""
    flat = buffer.detach().reshape(-1)
    out = Partial()
    if not layout.counts:
        return out
    device = flat.device
    starts, ends, shift = layout.tensors(device)  # shift = 2 (offset - start)
    order = torch.argsort(starts)
    starts, ends, offset_minus_start = starts[order], ends[order], shift[order] // 2
    unit = 2.0 ** (1 - precision(flat.dtype))
    with torch.no_grad():
        for begin in range(0, flat.numel(), CHUNK):
            x = flat[begin : begin + CHUNK].to(torch.float64)
            pos = torch.arange(begin, begin + x.numel(), dtype=torch.int64, device=device)
            seg = torch.searchsorted(starts, pos, right=True).sub_(1).clamp_(min=0)
            inside = (pos >= starts[seg]) & (pos < ends[seg])
            x = torch.where(inside, x, torch.zeros((), dtype=torch.float64, device=device))
            g = pos.add_(offset_minus_start[seg])
            part = _chunk_sum(x, g).cpu()
            out.projections = part if out.projections is None else out.projections + part
            out.chunks += 1
            out.squares += (unit * float(torch.linalg.vector_norm(x))) ** 2
            out.magnitude += float(x.abs().sum())
    return out


def summarize(tensors, offsets) -> tuple[list[float], float]:
    """(P_0 .. P_{PROJECTIONS-1}, R) of ``tensors`` (each flattened, at global flat index
    ``offsets[t]``), as Python floats."""
    return partial(tensors, offsets).finish()
