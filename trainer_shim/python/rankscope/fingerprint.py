"""Order-independent 64-bit replica fingerprints, computed on the tensor's device.

For a flat vector whose element ``i`` has global flat index ``g_i`` and bit pattern ``bits_i``
(the value viewed as int32; int16 for bfloat16/float16; int64 for float64; sign-extended to
int64), the fingerprint is

    F = sum_i (bits_i + 1) * (2 * g_i + 1)   mod 2**64

in int64 two's-complement arithmetic (``+`` and ``*`` wrap as uint64 would). Properties:

* order independence: a sum, so any split into chunks or buckets, in any order, gives the same F
  (fingerprints of disjoint parts are combined with ``combine``, a wrapping add);
* sensitivity: ``2 g + 1`` is odd, so multiplying by it is a bijection mod 2**64; changing one
  element's bits (one ulp, one flipped bit) changes its term and therefore F. Two simultaneous
  changes can cancel only by a 2**-64-rare coincidence;
* position: the weight ties each value to its global index, so swapping two values changes F.

The device functions (``fold``, ``fold_segments``, ``fold_segments_and_squares``, ``fold_many``)
run torch integer ops on the tensor's device, or one fused Triton kernel with the same integer sum
(rankscope.triton_kernels, bit-identical), as rankscope._backend decides (its table): no host
copy, no synchronization. The result is a 0-d int64 tensor; ``to_uint64`` turns a host value into the unsigned number sent to
the collector. A bucket of a DDP gradient buffer is folded with ``fold_segments`` in a constant
number of kernels (two cumulative sums), whatever the number of parameters in it.

CPU tensors of float32, bfloat16, float16 and float64 take the C++ kernel instead
(``rankscope._native.fingerprint_segments``: one pass, no temporaries, the GIL released), which
also returns the exact sum of squares; its results are plain Python numbers (``fold_cpu``,
``fold_segments_cpu``). The two implementations agree bit for bit (tests).
"""

from collections.abc import Sequence

import torch

from rankscope import _backend
from rankscope import triton_kernels as _tk
from rankscope.torch_sketch import flat_contiguous

_MASK64 = (1 << 64) - 1

# dtype -> the integer dtype of the same width whose view gives the value's bits.
_BITS_DTYPE = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
    torch.int16: torch.int16,
}


_NATIVE_CODES = {}
try:
    from rankscope import _native

    _NATIVE_CODES = {
        torch.float32: _native.DTYPE_FLOAT32,
        torch.bfloat16: _native.DTYPE_BFLOAT16,
        torch.float16: _native.DTYPE_FLOAT16,
        torch.float64: _native.DTYPE_FLOAT64,
    }
except (ImportError, AttributeError):  # the torch-op path still works
    _native = None


def supported(dtype: torch.dtype) -> bool:
    """A fingerprint is defined for ``dtype`` (rankscope._backend.FINGERPRINT_DTYPES)."""
    return dtype in _backend.FINGERPRINT_DTYPES


def _device_choice(t: torch.Tensor):
    """What the device functions run for ``t``: Triton or the torch ops (never the C++ kernel,
    which fold_cpu and fold_segments_cpu call)."""
    return _backend.fingerprint(t, native=False)


def fold_cpu(values: torch.Tensor, offset: int):
    """(F as uint64 int, sum of squares as float) of a CPU tensor with the C++ kernel."""
    flat = flat_contiguous(values)
    return _native.fingerprint_segments(
        flat.data_ptr(), _NATIVE_CODES[flat.dtype], [0], [flat.numel()], [offset]
    )


def fold_segments_cpu(buffer: torch.Tensor, layout: "SegmentLayout"):
    """(F as uint64 int, sum of squares over the segments as float) with the C++ kernel."""
    if buffer.numel() != layout.numel:
        raise ValueError(f"buffer has {buffer.numel()} elements, layout {layout.numel}")
    flat = flat_contiguous(buffer)
    return _native.fingerprint_segments(
        flat.data_ptr(),
        _NATIVE_CODES[flat.dtype],
        layout.starts,
        layout.counts,
        layout.global_offsets,
    )


def as_tensor(value, device) -> torch.Tensor:
    """A fingerprint (uint64 int or 0-d int64 tensor) as a 0-d int64 tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    v = int(value) & _MASK64
    return torch.tensor(v - (1 << 64) if v >= (1 << 63) else v, dtype=torch.int64, device=device)


def add_all(values, device):
    """The wrapping sum of fingerprints (ints and/or 0-d tensors): an int if all are ints (no
    device work), else a 0-d int64 tensor on ``device``."""
    ints = [v for v in values if not isinstance(v, torch.Tensor)]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    host = sum(int(v) for v in ints) & _MASK64
    if not tensors:
        return host
    # 0-d values, or per-program partial vectors of the Triton kernels: the sum of all.
    total = torch.cat([t.to(device).reshape(-1) for t in tensors]).sum()
    # A scalar add: no host-to-device copy (the int64 with the same bit pattern).
    return total.add_(host - (1 << 64) if host >= (1 << 63) else host)


def to_uint64(value) -> int:
    """The unsigned 64-bit number with the bit pattern of an int64 (a Python int or 0-d tensor
    on the CPU)."""
    return int(value) & _MASK64


def _terms(flat: torch.Tensor) -> torch.Tensor:
    """bits + 1 as int64 (a new tensor)."""
    bits = flat.view(_BITS_DTYPE[flat.dtype])
    if bits.dtype == torch.int64:
        return bits.add(1)
    return bits.to(torch.int64).add_(1)


def fold(values: torch.Tensor, offset: int) -> torch.Tensor:
    """F of ``values`` (flattened, contiguous or not) as global indices [offset, offset + n).
    A 0-d int64 tensor on the values' device."""
    flat = flat_contiguous(values)
    n = flat.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)

    def compute(choice):
        if choice.backend == _backend.TRITON:  # one fused pass, the same integer sum
            return _tk.fold(flat.view(_BITS_DTYPE[flat.dtype]), offset)
        return _fold_torch_ops(flat, offset=offset)

    return _backend.run(lambda: _device_choice(flat), compute)


class SegmentLayout:
    """Where the parameters of one flat buffer (a DDP gradient bucket) lie: element ``starts``
    in the buffer, ``counts`` elements each, at global flat indices ``global_offsets``. Holds the
    small index tensors ``fold_segments`` needs, per device. ``native`` is set by the bucket
    sketcher once a final CPU bucket has a ``_native.BucketPlan``: (plan, dtype), so that the
    reduced bucket's fingerprint is one C++ call (``BucketPlan.fingerprint``), its vectors built
    once; None otherwise."""

    __slots__ = ("numel", "starts", "counts", "global_offsets", "_device_tensors", "native")

    def __init__(
        self,
        numel: int,
        starts: Sequence[int],
        counts: Sequence[int],
        global_offsets: Sequence[int],
    ):
        if not (len(starts) == len(counts) == len(global_offsets)):
            raise ValueError("starts, counts and global_offsets differ in length")
        for s, n in zip(starts, counts):
            if s < 0 or n < 0 or s + n > numel:
                raise ValueError(f"segment [{s}, {s + n}) outside a buffer of {numel}")
        self.numel = int(numel)
        self.starts = [int(s) for s in starts]
        self.counts = [int(n) for n in counts]
        self.global_offsets = [int(o) for o in global_offsets]
        self._device_tensors = {}
        self.native = None

    def tensors(self, device):
        t = self._device_tensors.get(device)
        if t is None:
            starts = torch.tensor(self.starts, dtype=torch.int64)
            ends = starts + torch.tensor(self.counts, dtype=torch.int64)
            shift = 2 * (torch.tensor(self.global_offsets, dtype=torch.int64) - starts)
            t = (_to_device(starts, device), _to_device(ends, device), _to_device(shift, device))
            self._device_tensors[device] = t
        return t

    def pieces(self, device):
        """The segments cut into the Triton kernels' pieces (triton_kernels.piece_table), as
        three int64 tensors on ``device`` (buffer start, count, global offset; cached)."""
        key = ("pieces", device)
        t = self._device_tensors.get(key)
        if t is None:
            rows = _to_device(torch.tensor(_tk.piece_table(self), dtype=torch.int64), device)
            t = self._device_tensors[key] = (rows[0], rows[1], rows[2])
        return t


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a small CPU tensor) on ``device``. To a CUDA device it is copied from pinned memory
    without blocking (a plain copy from pageable memory would synchronize the host with the
    device); the caching host allocator keeps the pinned block until that copy is done."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def fold_segments(buffer: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """F of the segments of ``buffer`` described by ``layout`` (elements outside every segment,
    e.g. padding, do not count). With p the position in the buffer and shift = 2 (o_k - s_k),
    segment k contributes sum c_p (2 p + 1) + shift_k sum c_p over its positions; both sums come
    from prefix sums, so the cost is a constant number of kernels per buffer."""
    flat = buffer.detach().reshape(-1)
    if flat.numel() != layout.numel:
        raise ValueError(f"buffer has {flat.numel()} elements, layout {layout.numel}")
    device = flat.device
    if not layout.counts:
        return torch.zeros((), dtype=torch.int64, device=device)
    if not flat.is_contiguous():
        flat = flat.contiguous()

    def compute(choice):
        if choice.backend == _backend.TRITON:  # one fused pass, the same integer sum
            return _tk.fold_pieces(flat.view(_BITS_DTYPE[flat.dtype]), layout.pieces(device))
        return _fold_torch_ops(flat, layout)

    return _backend.run(lambda: _device_choice(flat), compute)


def _fold_torch_ops(flat: torch.Tensor, layout: SegmentLayout = None, offset: int = 0):
    """F with torch ops, the one torch-op implementation: with p the position in ``flat`` and
    c_p = bits_p + 1, segment k (start s_k, global offset o_k) adds
    sum_p c_p (2 p + 1) + 2 (o_k - s_k) sum_p c_p over its positions. Without ``layout`` the
    whole of ``flat`` is one segment at global ``offset`` (two sums); with one, both sums of
    every segment come from two prefix sums (a constant number of kernels per buffer)."""
    device = flat.device
    n = flat.numel()
    c = _terms(flat)
    w = torch.arange(1, 2 * n, 2, dtype=torch.int64, device=device)
    if layout is None:
        csum = c.sum()
        return c.mul_(w).sum().add_(csum.mul_(2 * offset))
    cs1 = torch.zeros(layout.numel + 1, dtype=torch.int64, device=device)
    torch.cumsum(c, 0, out=cs1[1:])
    cs2 = torch.zeros(layout.numel + 1, dtype=torch.int64, device=device)
    torch.cumsum(c.mul_(w), 0, out=cs2[1:])
    starts, ends, shift = layout.tensors(device)
    seg = cs2[ends].sub_(cs2[starts]).add_(shift.mul(cs1[ends].sub_(cs1[starts])))
    return seg.sum()


def fold_segments_and_squares(buffer: torch.Tensor, layout: SegmentLayout):
    """(F, sum of squares) of the segments of a float ``buffer``, on its device: on a CUDA
    device with Triton one pass (per-program partial vectors, int64 and float64, whose sums are
    the values: ``add_all`` and a sum take them as they are), else fold_segments and a float64
    norm of the whole buffer (padding is zeros)."""
    flat = buffer.detach().reshape(-1)
    if flat.numel() != layout.numel:
        raise ValueError(f"buffer has {flat.numel()} elements, layout {layout.numel}")

    def compute(choice):
        if choice.backend == _backend.TRITON and layout.counts:
            bits = flat.view(_BITS_DTYPE[flat.dtype])
            return _tk.fold_pieces(bits, layout.pieces(flat.device), values=flat)
        norm = torch.linalg.vector_norm(flat, 2, dtype=torch.float64)
        if choice.backend == _backend.TRITON:  # no segments: nothing to fold
            return torch.zeros((), dtype=torch.int64, device=flat.device), norm * norm
        return _fold_torch_ops(flat, layout), norm * norm

    return _backend.run(lambda: _device_choice(flat), compute)


def fold_many(tensors, offsets, cache: dict) -> list:
    """Fingerprints (0-d int64 tensors) whose wrapping sum is F of ``tensors`` (not CPU ones),
    each at its global offset: where rankscope._backend picks Triton, one launch per device and
    dtype (triton_kernels.fold_pieces over the tensors' pieces), else ``fold`` each. ``cache``
    keeps each group's piece table per set of addresses (a model's parameters stay where they
    are)."""
    groups, parts = {}, []
    for t, off in zip(tensors, offsets):
        t = t.detach()
        if t.numel() and _device_choice(t).backend == _backend.TRITON:
            ts, offs = groups.setdefault((t.device, t.dtype), ([], []))
            ts.append(t)
            offs.append(off)
        else:
            parts.append(fold(t, off))
    for ts, offs in groups.values():
        table = _piece_table(ts, offs, cache)

        def compute(choice, ts=ts, offs=offs, table=table):
            if choice.backend == _backend.TRITON and table is not None:
                return [_tk.fold_pieces(ts[0].view(_BITS_DTYPE[ts[0].dtype]), table)]
            return [fold(t, off) for t, off in zip(ts, offs)]

        parts.extend(_backend.run(lambda ts=ts: _device_choice(ts[0]), compute))
    return parts


def _piece_table(tensors, offsets, cache: dict):
    """triton_kernels.fold_pieces' table for ``tensors`` (one dtype, one device): each tensor at
    its element offset from the first (of any sign), cut into pieces (triton_kernels.piece_table),
    as three int64 tensors on the device; cached by addresses and sizes. None when an address is
    not a whole number of elements from the first's."""
    base, size = tensors[0], tensors[0].element_size()
    key = tuple((t.data_ptr(), t.numel()) for t in tensors)
    table = cache.get(key)
    if table is None:
        starts = []
        for t in tensors:
            delta = t.data_ptr() - base.data_ptr()
            if delta % size:
                return None
            starts.append(delta // size)
        segments = _Segments(starts, [t.numel() for t in tensors], offsets)
        rows = _to_device(torch.tensor(_tk.piece_table(segments), dtype=torch.int64), base.device)
        if len(cache) >= 8:  # parameters that keep moving: keep the newest tables only
            cache.clear()
        table = cache[key] = (rows[0], rows[1], rows[2])
    return table


class _Segments:
    """Segments for triton_kernels.piece_table whose starts may be negative (element offsets from
    a base tensor, not positions in one buffer: not a SegmentLayout)."""

    __slots__ = ("starts", "counts", "global_offsets")

    def __init__(self, starts, counts, global_offsets):
        self.starts, self.counts, self.global_offsets = starts, counts, global_offsets


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """F of the union of two disjoint index sets (a wrapping add)."""
    return a + b.to(a.device)


def fold_parameters(params, offsets=None) -> torch.Tensor:
    """F of the concatenation of ``params`` (flat index order = the given order), on the first
    parameter's device; parameters on other devices are folded where they are and added."""
    total = None
    offset = 0
    for i, p in enumerate(params):
        off = offset if offsets is None else offsets[i]
        part = fold(p, off)
        total = part if total is None else combine(total, part)
        offset = off + p.numel()
    if total is None:
        return torch.zeros((), dtype=torch.int64)
    return total
