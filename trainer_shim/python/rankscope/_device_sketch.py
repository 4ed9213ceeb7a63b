"""The count sketch of gradients that the C++ kernel does not read (they lie on a device, or a
test bypasses the kernel): ``DeviceSketch``, one per device, holding float64 bins and the sum of
squares on that device.

Each ``add`` asks rankscope._backend which backend runs (its table): on a CUDA device with Triton
a fused kernel (rankscope.triton_kernels, the atomic or the tensor-core variant: float32 partial
sums per program, folded into the float64 totals when the bins are read), else the torch ops of
rankscope.torch_sketch (float64 throughout). The same bins and signs as the C++ kernel either
way; nothing synchronizes the host with the device.

Float32 partial sums: the Triton kernels add each program's values into a float32 row before the
rows are folded in float64, so a bin carries the rounding of a float32 sum of about
``float32_terms`` values (the busiest program's tiles times a tile's values per bin), and a value
enters that sum rounded to ``value_bits`` significant bits where the kernel cannot take it exactly
(22: float32 values on the tensor cores as three tf32 products; 24: float64 values cast to
float32; 0: exact, as bfloat16, float16 and, in the atomic kernel, float32 values are). The CUDA
kernel (rankscope._cuda_sketch, opt-in) adds a step's values into one float32 row: counted as
all of a bin's values in one running sum, an upper bound. The aggregation check widens its tolerance by both (rankscope._integrity.effective_mantissa_bits);
the torch-op path sums in float64 (0 terms, exact values).

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
        # Tiles the busiest program added into its float32 row since the last reset, and the
        # coarsest rounding of a value on its way in (0: none).
        self._tiles = 0
        self._cuda_values = 0  # values the CUDA kernel added into its one float32 row
        self.value_bits = 0

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

    @property
    def float32_terms(self) -> int:
        """About how many values one float32 partial bin summed since the last reset (the
        busiest program's tiles times a tile's values per bin; the CUDA kernel's one row: all
        the values of a bin, as if summed one after another, an upper bound of its warp-private
        and per-block sums); 0 on the torch-op path."""
        triton = -(-self._tiles * _tk.PIECE // self.dim)
        return max(triton, -(-self._cuda_values // self.dim))

    def reset(self) -> None:
        self._bins.zero_()
        self._sum_squares.zero_()
        self._tiles = 0
        self._cuda_values = 0
        self.value_bits = 0
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

    def _launched(self, tiles: int, dtype, choice) -> None:
        """Counts one Triton launch (``choice``) of ``tiles`` tiles of ``dtype`` values over the
        persistent grid's programs."""
        if tiles > 0:
            programs = min(self._partials[0].shape[0], tiles)
            self._tiles += -(-tiles // programs)
        bits = 0
        if choice.variant == _backend.DOT and choice.exact_tf32:
            bits = 22  # hi + lo tf32 parts of a float32 value: 2 x 11 significant bits
        elif dtype == torch.float64:
            bits = 24  # cast to float32
        if bits and (not self.value_bits or bits < self.value_bits):
            self.value_bits = bits

    def add(self, values: torch.Tensor, offset: int) -> None:
        """Adds the flat view of ``values`` as coordinates [offset, offset + numel)."""
        flat = values.reshape(-1)

        def compute(choice):
            if choice.backend == _backend.CUDA:
                rows, ss = self._fused_partials()
                _cs.sketch_add(rows[0], ss, flat, offset, self.seed, self.dim)
                self._cuda_values += flat.numel()
            elif choice.backend == _backend.TRITON:
                _tk.sketch_add(*self._fused_partials(), flat, offset, self.seed, self.dim, choice)
                n = flat.numel()
                if n:
                    tiles = ((offset + n - 1) // 32 - offset // 32) // (_tk.PIECE // 32) + 1
                    self._launched(tiles, flat.dtype, choice)
            else:
                _ts.add(self._bins, self._sum_squares, flat, offset, self.seed)

        _backend.run(lambda: _backend.sketch(flat, self.dim, native=False), compute)

    def add_segments(self, buffer: torch.Tensor, layout) -> None:
        """Adds the segments of ``buffer`` that ``layout`` (a fingerprint.SegmentLayout) describes,
        each at its global offset: with a Triton kernel one launch for the whole buffer (a DDP
        bucket), else the torch ops per segment."""
        flat = _ts.flat_contiguous(buffer)  # a DDP bucket's buffer is already

        def compute(choice):
            if choice.backend == _backend.CUDA:
                rows, ss = self._fused_partials()
                table = layout.pieces(self.device)
                _cs.sketch_add_pieces(rows[0], ss, flat, table, self.seed, self.dim)
                self._cuda_values += sum(layout.counts)
                return
            if choice.backend == _backend.TRITON:
                table = layout.pieces(self.device)
                _tk.sketch_add_pieces(
                    *self._fused_partials(), flat, table, self.seed, self.dim, choice
                )
                self._launched(table[0].numel(), flat.dtype, choice)
                return
            for start, n, offset in zip(layout.starts, layout.counts, layout.global_offsets):
                if n:
                    _ts.add(
                        self._bins, self._sum_squares, flat[start : start + n], offset, self.seed
                    )

        _backend.run(lambda: _backend.sketch(flat, self.dim, native=False), compute)
