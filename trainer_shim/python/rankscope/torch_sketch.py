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
coordinate of a chunk).

This module is the torch-op backend of the sketch (``add``); the sketch object that holds the
bins on a device and asks rankscope._backend whether these ops or a Triton kernel run is
rankscope._device_sketch.DeviceSketch (``TorchSketch`` here is its deprecated old name).
It is also the package's one Python definition of SketchMix's constants
(``SKETCH_MIX_CONSTANTS``), read from the C++ header's through rankscope._native;
tests/python/test_shim.py checks them against the header's text.
"""

import torch

from rankscope import _native

CHUNK = 1 << 22

_MASK64 = (1 << 64) - 1

# SketchMix's constants (agent/include/rankscope/sketch.h: kSketchMixGolden, kSketchMixM1,
# kSketchMixM2) as unsigned 64-bit numbers: the one Python definition (triton_kernels.py passes
# them to its kernels).
SKETCH_MIX_CONSTANTS = tuple(int(c) for c in _native.SKETCH_MIX_CONSTANTS)


def flat_contiguous(values: torch.Tensor) -> torch.Tensor:
    """``values`` detached and viewed as one flat contiguous tensor (a copy only when its memory
    is not already one run, as a strided view's): what every kernel of the package reads."""
    flat = values.detach().reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _s64(x: int) -> int:
    """The int64 with the same 64-bit pattern as the uint64 ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


# The same constants as int64 bit patterns, for torch's int64 arithmetic.
_GOLDEN, _M1, _M2 = (_s64(c) for c in SKETCH_MIX_CONSTANTS)


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


def add(
    bins: torch.Tensor, sum_squares: torch.Tensor, values: torch.Tensor, offset: int, seed: int
):
    """Adds the flat view of ``values`` as coordinates [offset, offset + numel) into the float64
    ``bins`` and the 0-d float64 ``sum_squares``, with torch ops on their device (never writes
    into ``values``)."""
    flat = values.reshape(-1)
    n = flat.numel()
    dim = bins.numel()
    for start in range(0, n, CHUNK):
        chunk = flat[start : start + CHUNK].to(torch.float64)  # the gradient itself if f64
        slots, signs = sketch_slots(offset + start, chunk.numel(), seed, dim, bins.device)
        sum_squares.add_(torch.dot(chunk, chunk))
        bins.index_add_(0, slots, signs.mul_(chunk))


def __getattr__(name):
    if name == "TorchSketch":  # the old name of DeviceSketch, which also runs Triton kernels
        import warnings

        from rankscope._device_sketch import DeviceSketch

        warnings.warn(
            "rankscope.torch_sketch.TorchSketch is deprecated: it is "
            "rankscope._device_sketch.DeviceSketch (it runs the Triton kernels where they apply)",
            DeprecationWarning,
            stacklevel=2,
        )
        return DeviceSketch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
