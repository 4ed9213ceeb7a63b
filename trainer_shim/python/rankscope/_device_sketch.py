"""The count sketch of gradients that the C++ kernel does not read (they lie on a device, or a
test bypasses the kernel): ``DeviceSketch``, one per device, holding float64 bins and the sum of
squares on that device.

Each ``add`` asks rankscope._backend which backend runs (its table): on a CUDA device with Triton
a fused kernel (rankscope.triton_kernels, the atomic or the tensor-core variant: float32 partial
sums per program, folded into the float64 totals when the bins are read), else the torch ops of
rankscope.torch_sketch (float64 throughout). The same bins and signs as the C++ kernel either
way; nothing synchronizes the host with the device.

Thread-compatible: one writer at a time (DDP calls its comm hooks one after another).
"""

import torch

from rankscope import _backend
from rankscope import _cuda_sketch as _cs
from rankscope import torch_sketch as _ts
from rankscope import triton_kernels as _tk


class DeviceSketch:
    """A count sketch accumulated on ``device`` (same bins as rankscope._native's kernel)."""

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

        def compute(choice):
            if choice.backend == _backend.CUDA:
                rows, ss = self._fused_partials()
                _cs.sketch_add(rows[0], ss, flat, offset, self.seed, self.dim)
            elif choice.backend == _backend.TRITON:
                _tk.sketch_add(*self._fused_partials(), flat, offset, self.seed, self.dim, choice)
            else:
                _ts.add(self._bins, self._sum_squares, flat, offset, self.seed)

        _backend.run(lambda: _backend.sketch(flat, self.dim, native=False), compute)

    def add_segments(self, buffer: torch.Tensor, layout) -> None:
        """Adds the segments of ``buffer`` that ``layout`` (a fingerprint.SegmentLayout) describes,
        each at its global offset: with a Triton kernel one launch for the whole buffer (a DDP
        bucket), else the torch ops per segment."""
        flat = buffer.detach().reshape(-1)
        if not flat.is_contiguous():  # a DDP bucket's buffer always is
            flat = flat.contiguous()

        def compute(choice):
            if choice.backend == _backend.CUDA:
                rows, ss = self._fused_partials()
                table = layout.pieces(self.device)
                _cs.sketch_add_pieces(rows[0], ss, flat, table, self.seed, self.dim)
                return
            if choice.backend == _backend.TRITON:
                table = layout.pieces(self.device)
                _tk.sketch_add_pieces(
                    *self._fused_partials(), flat, table, self.seed, self.dim, choice
                )
                return
            for start, n, offset in zip(layout.starts, layout.counts, layout.global_offsets):
                if n:
                    _ts.add(
                        self._bins, self._sum_squares, flat[start : start + n], offset, self.seed
                    )

        _backend.run(lambda: _backend.sketch(flat, self.dim, native=False), compute)
