"""The count sketch written with torch operations, for gradients that do not live on the CPU.

It reproduces bit for bit the bins and signs of the C++ kernel (agent/include/rankscope/sketch.h,
``SketchHash``), a block count sketch: coordinate ``i`` lies in block ``i >> 5`` at offset
``o = i & 31``; with ``mix`` = output number ``i >> 5`` of SplitMix64 seeded with ``seed``, it goes
to bin ``((mix >> 32) % dim + o) % dim`` with sign ``+1`` if bit ``o`` of ``mix`` is 0, else
``-1``. So there is one mix per 32 coordinates. The arithmetic is uint64 modulo 2**64; torch has no
uint64, so it runs on int64: ``+`` and ``*`` wrap identically in two's complement, and the LOGICAL
right shift is written as an arithmetic shift followed by a mask (bit ``o < 32`` of ``mix`` is the
same under either shift).

Everything stays on the gradient's device: no host copy, no ``.item()``, no synchronization.
Bins accumulate in float64 and the sum of squares in a float64 0-d tensor: the same bins and signs
as the C++ kernel, summed with less rounding (the kernel sums segments in float first, sketch.h
"Rounding"), so the two agree up to rounding, not bit for bit.
Work is done in chunks of ``CHUNK`` coordinates to bound the temporary memory (about 40 bytes a
coordinate of a chunk). On a CUDA device with Triton, ``add`` runs one fused kernel instead
(rankscope.triton_kernels: the same bins and signs, float32 partial sums per program summed in
float64; ``RANKSCOPE_GPU_KERNELS=torch`` keeps these torch ops).
"""

import torch

from rankscope import _native
from rankscope import triton_kernels as _tk

CHUNK = 1 << 22

_MASK64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """The int64 with the same 64-bit pattern as the uint64 ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


# SketchMix's constants, defined once in agent/include/rankscope/sketch.h, as int64 patterns.
_GOLDEN, _M1, _M2 = (_s64(c) for c in _native.SKETCH_MIX_CONSTANTS)


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s`` (0 < s < 64): a new tensor."""
    return torch.bitwise_and(torch.bitwise_right_shift(z, s), (1 << (64 - s)) - 1)


def sketch_mix(index: torch.Tensor, seed: int) -> torch.Tensor:
    """SketchMix(index, seed) for an int64 tensor of indices, as int64 bit patterns."""
    z = index + 1
    z.mul_(_GOLDEN).add_(_s64(seed))
    z.bitwise_xor_(_lsr(z, 30)).mul_(_M1)
    z.bitwise_xor_(_lsr(z, 27)).mul_(_M2)
    z.bitwise_xor_(_lsr(z, 31))
    return z


BLOCK = 32  # coordinates per hash block

_OFFSETS = {}  # device -> arange(BLOCK) as int64


def _block_offsets(device) -> torch.Tensor:
    key = torch.device(device) if device is not None else torch.device("cpu")
    offsets = _OFFSETS.get(key)
    if offsets is None:
        offsets = _OFFSETS[key] = torch.arange(BLOCK, dtype=torch.int64, device=key)
    return offsets


def sketch_slots(offset: int, n: int, seed: int, dim: int, device=None):
    """(bins int64, signs float64) of coordinates [offset, offset + n)."""
    if n <= 0:
        return (
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=torch.float64, device=device),
        )
    first_block = offset // BLOCK
    blocks = torch.arange(
        first_block, (offset + n - 1) // BLOCK + 1, dtype=torch.int64, device=device
    )
    mix = sketch_mix(blocks, seed).unsqueeze_(1)  # one mix per block
    o = _block_offsets(device)
    bins = _lsr(mix, 32).remainder_(dim).add(o).remainder_(dim)  # [blocks, 16]
    signs = torch.bitwise_right_shift(mix, o).bitwise_and_(1).mul_(-2).add_(1).to(torch.float64)
    start = offset - first_block * BLOCK
    return bins.view(-1)[start : start + n], signs.view(-1)[start : start + n]


class TorchSketch:
    """A count sketch accumulated on ``device`` with torch ops (same bins as rankscope._native).

    Thread-compatible: one writer at a time (DDP calls its comm hooks one after another).
    """

    def __init__(self, dim: int, seed: int, device):
        self.dim = int(dim)
        self.seed = int(seed)
        self.device = torch.device(device)
        self._bins = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
        self._sum_squares = torch.zeros((), dtype=torch.float64, device=self.device)
        # The Triton kernels' per-program partial sums (rows of float32 bins, float64 squares),
        # added into by every launch of a step and folded into the float64 totals when read:
        # one launch a bucket, no per-launch allocation or reduction.
        self._partials = None
        self._pending = False

    @property
    def bins(self) -> torch.Tensor:
        """The float64 bins (a tensor on the device; partial sums folded in first)."""
        self._fold()
        return self._bins

    @property
    def sum_squares(self) -> torch.Tensor:
        """The float64 sum of squares, a 0-d tensor on the device."""
        self._fold()
        return self._sum_squares

    def reset(self) -> None:
        self._bins.zero_()
        self._sum_squares.zero_()
        if self._pending:
            for t in self._partials:
                t.zero_()
            self._pending = False

    def _fold(self) -> None:
        if self._pending:
            rows, ss = self._partials
            self._bins.add_(rows.sum(0, dtype=torch.float64))
            self._sum_squares.add_(ss.sum())
            rows.zero_()
            ss.zero_()
            self._pending = False

    def _fused_partials(self):
        if self._partials is None:
            self._partials = _tk.sketch_partials(self.device, self.dim)
        self._pending = True
        return self._partials

    def add(self, values: torch.Tensor, offset: int) -> None:
        """Adds the flat view of ``values`` as coordinates [offset, offset + numel)."""
        flat = values.reshape(-1)
        if self._fused(flat) and _tk.attempt(self._add_fused, flat, offset) is not _tk.FELL_BACK:
            return  # one fused pass on a CUDA device
        n = flat.numel()
        for start in range(0, n, CHUNK):
            chunk = flat[start : start + CHUNK].to(torch.float64)  # the gradient itself if f64
            bins, signs = sketch_slots(
                offset + start, chunk.numel(), self.seed, self.dim, self.device
            )
            self._sum_squares.add_(torch.dot(chunk, chunk))
            self._bins.index_add_(0, bins, signs.mul_(chunk))  # never writes into the gradient

    def add_segments(self, buffer: torch.Tensor, layout) -> None:
        """Adds the segments of ``buffer`` that ``layout`` (a fingerprint.SegmentLayout) describes,
        each at its global offset: on a CUDA device with Triton one launch for the whole buffer
        (a DDP bucket), else ``add`` per segment."""
        flat = buffer.detach().reshape(-1)
        if (
            self._fused(flat)
            and flat.is_contiguous()
            and _tk.attempt(self._add_segments_fused, flat, layout) is not _tk.FELL_BACK
        ):
            return
        for start, n, offset in zip(layout.starts, layout.counts, layout.global_offsets):
            if n:
                self.add(flat[start : start + n], offset)

    def _add_fused(self, flat: torch.Tensor, offset: int) -> None:
        _tk.sketch_add(*self._fused_partials(), flat, offset, self.seed, self.dim)

    def _add_segments_fused(self, flat: torch.Tensor, layout) -> None:
        _tk.sketch_add_pieces(
            *self._fused_partials(), flat, layout.pieces(self.device), self.seed, self.dim
        )

    def _fused(self, flat: torch.Tensor) -> bool:
        # The kernel wraps a block's 32 bins at most once: dim >= 32 (smaller sketches are rare).
        return self.dim >= 32 and _tk.enabled(flat)
