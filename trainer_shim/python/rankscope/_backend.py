"""Which backend computes a sketch or a fingerprint of a tensor: the one place in the package that
decides. Every other module asks here (``sketch``, ``fingerprint``, ``reduced_sketch``) and runs
what it is told; a Triton kernel that raises is reported back through ``run``, which remembers the
failure (or raises it, when a variant is forced strictly) and asks again.

Backends:

* ``native``: the C++ kernels (rankscope._native: ``Sketch``, ``fingerprint_segments``), reading a
  CPU tensor's memory in place with the GIL released.
* ``triton``: the fused Triton kernels (rankscope.triton_kernels). The sketch comes in two
  variants: ``atomic`` (one float32 atomic add a value) and ``dot`` (a one-hot product on the
  tensor cores, Q = dim / 32; float32 values as three tf32 products, ``exact_tf32``).
* ``cuda``: the CUDA C++ sketch kernel (trainer_shim/cuda/sketch.cu through
  rankscope._cuda_sketch: bins privatised in shared memory, one launch through the driver API).
  OPT-IN: only with ``RANKSCOPE_GPU_KERNELS=cuda`` (or ``forced(kernels=CUDA)``), until a GPU
  session has measured it; for the sketch only (fingerprints keep the table below). Where it
  cannot run (``_cuda_sketch.unusable``: not a CUDA tensor, another dtype, dim < 32 or too
  large for shared memory, no fatbin in this build, no driver) the choice is the table's below,
  with a warning once; strictly forced, BackendFailed("cuda: <why>"). Its first failure at a
  launch turns it off for the process (``CUDA_FAILED``, warned once), as Triton's does.
* ``torch-ops``: torch operations on the tensor's own device (rankscope.torch_sketch,
  rankscope.fingerprint): the path CI runs, on CPU tensors.
* ``none``: not computed (the caller counts it and the step carries no such value).

The table. "Triton usable": Triton imports, ``RANKSCOPE_GPU_KERNELS`` is not ``torch``, no Triton
kernel failed in this process, and the tensor is on a CUDA device. ``native=False`` is what the
device path asks (rankscope.fingerprint's device functions, DeviceSketch) and what the tests'
``bypass_native`` switch gives CPU tensors (BucketSketcher, ReplicaFingerprints,
``Monitor._bypass_native``): the path a GPU tensor takes, run on the CPU.

=============  ======  ==========================  ===========================  ==================
work           device  dtype                       condition                    backend
=============  ======  ==========================  ===========================  ==================
sketch         cpu     float32, bfloat16, float16  native allowed               native (in place)
sketch         cpu     other                       native allowed               native, after a
                                                                                float32 copy
sketch         cuda    bfloat16, float16           Triton usable, dim 32 Q,     triton dot
                                                   Q a power of two in 16..128
sketch         cuda    float32                     Triton usable, dim 512 or    triton dot,
                                                   1,024 (or 2,048, 4,096 with  exact_tf32
                                                   RANKSCOPE_GPU_SKETCH=dot)
sketch         cuda    any other / other dims      Triton usable, dim >= 32     triton atomic
sketch         cuda    any                         RANKSCOPE_GPU_SKETCH=atomic  triton atomic
                                                   (or the dot kernel failed)
sketch         cuda    any                         dim < 32, or Triton not      torch-ops
                                                   usable
sketch         other   any                         (cpu: native not allowed)    torch-ops
fingerprint    cpu     float32, bfloat16,          native allowed, dense        native
                       float16, float64
fingerprint    cuda    those and int16/32/64       Triton usable, contiguous    triton
fingerprint    any     those and int16/32/64       otherwise                    torch-ops
fingerprint    any     any other dtype                                          none
reduced        cpu     float32, bfloat16, float16  native allowed, contiguous   native
sketch         any     float32, bfloat16,          otherwise (a device, or      as ``sketch`` with
                       float16, float64            ``bypass_native``), dense    native=False
reduced        any     other, or sparse                                         none
sketch
=============  ======  ==========================  ===========================  ==================

(The dot kernel's choice per dtype and dim comes from the H100 figures in docs/PERFORMANCE.md,
"GPU kernels"; the reduced sketch is the aggregation check's, rankscope._integrity.)

Options, read at each decision (a test or bench may change them between steps):

* ``RANKSCOPE_GPU_KERNELS=torch``: the torch ops instead of the Triton kernels.
* ``RANKSCOPE_GPU_SKETCH=atomic`` or ``dot``: that sketch variant (dot only where its dim allows).
* ``forced(...)`` (a context manager, process-wide: bench/gpu_bench.py, the interpreter tests):
  a backend and sketch variant, optionally ``strict`` (a forced variant that cannot run, or a
  kernel that raises, raises ``BackendFailed``, and nothing is remembered: the next choice is
  made as if it never happened) and ``any_device`` (Triton for CPU tensors too, only meaningful
  under Triton's interpreter, TRITON_INTERPRET=1).

Failures, without a strict force: the first error of a dot kernel turns the dot variant off for
the process (the atomic kernel from then on); the first error of any other Triton kernel turns
Triton off for the process (the torch ops from then on). Each is warned once and listed in
``TRITON_FAILED`` / ``DOT_FAILED``. Triton compiles each kernel and a C launcher at its first
launch: a machine without a C compiler, or a GPU Triton cannot target, fails there, before the
kernel wrote anything. A failure after a launch (a CUDA error) is not recoverable here.

Thread safety: the decisions read the environment and the failure lists; the lists only grow
(list.append), and a stale read costs one more failing attempt, recorded once.
"""

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from rankscope import _cuda_sketch as _cs
from rankscope import _native
from rankscope import triton_kernels as _tk

NATIVE = "native"
TRITON = "triton"
TORCH_OPS = "torch-ops"
CUDA = "cuda"  # opt-in: RANKSCOPE_GPU_KERNELS=cuda (the sketch only)
NONE = "none"

ATOMIC = "atomic"
DOT = "dot"

# The dtypes the C++ sketch kernel reads in place, and the fingerprint kernel's.
NATIVE_SKETCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NATIVE_FINGERPRINT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The C++ fingerprint kernel is in this build of rankscope._native.
_NATIVE_FINGERPRINT = hasattr(_native, "fingerprint_segments") and hasattr(_native, "DTYPE_FLOAT64")
# The dtypes a fingerprint is defined for (rankscope.fingerprint: a view as integers).
FINGERPRINT_DTYPES = NATIVE_FINGERPRINT_DTYPES + (torch.int32, torch.int64, torch.int16)

TRITON_FAILED = []  # the first error of a Triton kernel in this process: Triton is off from then
DOT_FAILED = []  # the first error of the tensor-core sketch kernel: the atomic one from then
CUDA_FAILED = []  # the first error of the CUDA sketch kernel: the table's choice from then
_CUDA_UNUSABLE = []  # why an opted-in CUDA kernel could not run, warned once


class Choice(NamedTuple):
    """A backend, and for the Triton sketch its variant and launch parameters (Q: the bins are
    32 Q; ``exact_tf32``: float32 values as three tf32 products)."""

    backend: str
    variant: str | None = None
    q: int = 16
    exact_tf32: bool = False


class BackendFailed(RuntimeError):
    """A strictly forced backend or variant that cannot run here, or raised."""


class _Force(NamedTuple):
    kernels: str | None  # TRITON, TORCH_OPS or CUDA
    sketch: str | None  # ATOMIC or DOT
    strict: bool
    any_device: bool


_FORCED = []  # the stack of ``forced`` contexts; the last one applies


@contextlib.contextmanager
def forced(
    kernels: str | None = None,
    sketch: str | None = None,
    strict: bool = False,
    any_device: bool = False,
):
    """Within the block, device tensors take ``kernels`` (TRITON, TORCH_OPS or CUDA, the last
    for the sketch only; None: the default) and the Triton sketch ``sketch`` (ATOMIC or DOT). ``strict``: what cannot run is
    raised as BackendFailed, never replaced by another backend and never remembered.
    ``any_device``: Triton for CPU tensors too (Triton's interpreter). Process-wide."""
    if kernels not in (None, TRITON, TORCH_OPS, CUDA):
        raise ValueError(f"kernels must be {TRITON!r}, {TORCH_OPS!r} or {CUDA!r}, not {kernels!r}")
    if sketch not in (None, ATOMIC, DOT):
        raise ValueError(f"sketch must be {ATOMIC!r} or {DOT!r}, not {sketch!r}")
    force = _Force(kernels, sketch, strict, any_device)
    _FORCED.append(force)
    try:
        yield
    finally:
        _FORCED.remove(force)


def _force() -> _Force:
    return _FORCED[-1] if _FORCED else _Force(None, None, False, False)


def _triton_usable(t: torch.Tensor, force: _Force):
    """None if ``t`` may take the Triton kernels, else why not."""
    if _tk.triton is None:
        return "Triton does not import"
    if force.kernels == TORCH_OPS:
        return "the torch ops are forced"
    if force.kernels != TRITON and os.environ.get("RANKSCOPE_GPU_KERNELS", "triton") == "torch":
        return "RANKSCOPE_GPU_KERNELS=torch"
    if TRITON_FAILED and not force.strict:
        return f"a Triton kernel failed in this process ({TRITON_FAILED[0][:200]})"
    if not t.is_cuda and not force.any_device:
        return f"a {t.device.type} tensor"
    return None


def _unavailable(force: _Force, why: str) -> Choice:
    if force.strict and force.kernels == TRITON:
        raise BackendFailed(f"triton: {why}")
    return Choice(TORCH_OPS)


def sketch_variant(dtype: torch.dtype, dim: int) -> Choice:
    """The Triton sketch kernel for ``dim`` bins over ``dtype`` values: the dot variant where
    dim is 32 Q with Q a power of two from 16 to 128 (dims 512 .. 4,096), for bfloat16 and
    float16 values, and for float32 values up to dim 1,024 (their three tf32 products make larger
    dims slower than the atomic kernel: docs/PERFORMANCE.md, "GPU kernels"); else the atomic
    one. RANKSCOPE_GPU_SKETCH (or ``forced(sketch=...)``) forces one, the dot variant only where
    the dim allows it (strictly forced elsewhere: BackendFailed)."""
    force = _force()
    choice = force.sketch or os.environ.get("RANKSCOPE_GPU_SKETCH", "auto")
    q = dim // 32
    fits = dim % 32 == 0 and 16 <= q <= 128 and q & (q - 1) == 0 and dtype in NATIVE_SKETCH_DTYPES
    if force.strict and force.sketch == DOT and not fits:
        raise BackendFailed(
            f"dot: needs float32, bfloat16 or float16 values and a dim of 32 Q, Q a power of "
            f"two in 16 .. 128 (got {dtype}, dim {dim})"
        )
    preferred = dtype != torch.float32 or q <= 32
    dot_off = DOT_FAILED and not force.strict
    if fits and not dot_off and choice != ATOMIC and (preferred or choice == DOT):
        return Choice(TRITON, DOT, q, dtype == torch.float32)
    return Choice(TRITON, ATOMIC, 16, False)


def _cuda_sketch(t: torch.Tensor, dim: int, force: _Force):
    """Choice(CUDA) where the CUDA kernel is asked for (forced, or RANKSCOPE_GPU_KERNELS=cuda)
    and can run; None where it is not asked for or cannot run (warned once; strictly forced:
    BackendFailed)."""
    if force.kernels != CUDA and (
        force.kernels is not None or os.environ.get("RANKSCOPE_GPU_KERNELS") != CUDA
    ):
        return None
    if CUDA_FAILED and not force.strict:
        return None  # warned when it failed
    why = _cs.unusable(t, dim)
    if why is None:
        return Choice(CUDA)
    if force.strict and force.kernels == CUDA:
        raise BackendFailed(f"cuda: {why}")
    if not _CUDA_UNUSABLE:
        _CUDA_UNUSABLE.append(why)
        warnings.warn(
            f"rankscope: the CUDA sketch kernel cannot run ({why[:300]}); the GPU path uses "
            "the Triton kernels or torch operations instead",
            RuntimeWarning,
            stacklevel=4,
        )
    return None


def sketch(t: torch.Tensor, dim: int, native: bool = True) -> Choice:
    """How the count sketch of ``t`` (a gradient, or a bucket's buffer) is computed."""
    if native and t.device.type == "cpu":
        return Choice(NATIVE)
    force = _force()
    cuda = _cuda_sketch(t, dim, force)
    if cuda is not None:
        return cuda
    why = _triton_usable(t, force)
    if why is None and dim < 32:
        why = f"dim {dim} < 32 (the kernel wraps a block's 32 bins at most once)"
    if why is not None:
        return _unavailable(force, why)
    return sketch_variant(t.dtype, dim)


def fingerprint(t: torch.Tensor, native: bool = True) -> Choice:
    """How the replica fingerprint of ``t`` is computed (NONE: its dtype has none)."""
    if t.dtype not in FINGERPRINT_DTYPES or t.is_sparse:
        return Choice(NONE)
    if (
        native
        and _NATIVE_FINGERPRINT
        and t.device.type == "cpu"
        and t.dtype in NATIVE_FINGERPRINT_DTYPES
    ):
        return Choice(NATIVE)
    force = _force()
    why = _triton_usable(t, force)
    if why is None and not t.is_contiguous():
        why = "a tensor that is not contiguous"
    if why is not None:
        return _unavailable(force, why)
    return Choice(TRITON)


# The dtypes the aggregation check takes (rankscope._integrity.MANTISSA_BITS).
REDUCED_SKETCH_DTYPES = NATIVE_SKETCH_DTYPES + (torch.float64,)


def reduced_sketch(t: torch.Tensor, dim: int, native: bool = True) -> Choice:
    """How the aggregation check sketches a reduced bucket ``t`` (NONE: not checked; the step
    then sends no reduced sketch). Device tensors take the device path (a DeviceSketch, which
    asks ``sketch`` again at each launch); the choice returned for them says which it is now."""
    if t.dtype not in REDUCED_SKETCH_DTYPES or t.is_sparse:
        return Choice(NONE)
    if native and t.device.type == "cpu":
        if t.dtype in NATIVE_SKETCH_DTYPES and t.is_contiguous():
            return Choice(NATIVE)
        return Choice(NONE)
    return sketch(t, dim, native=False)


def run(choose: Callable[[], Choice], compute: Callable[[Choice], object]):
    """``compute(choose())``. If a Triton choice raises, the failure is remembered (the dot
    variant or Triton off for the process, warned once; ``TRITON_FAILED``, ``DOT_FAILED``) and
    ``choose`` asked again: a failed dot kernel is followed by the atomic one, a failed Triton
    kernel by the torch ops. Strictly forced, the error is raised as BackendFailed instead and
    nothing is remembered."""
    while True:
        choice = choose()
        if choice.backend not in (TRITON, CUDA):
            return compute(choice)
        try:
            return compute(choice)
        except Exception as e:  # noqa: BLE001 - a compiler or launcher error
            _failed(choice, e)


def _failed(choice: Choice, error: Exception) -> None:
    if _force().strict:
        raise BackendFailed(f"{choice.backend} {choice.variant or ''}: {error!r}") from error
    if choice.backend == CUDA:
        failures, what, after = (
            CUDA_FAILED,
            "the CUDA sketch kernel",
            "the GPU path uses the Triton kernels or torch operations from now on",
        )
    elif choice.variant == DOT:
        failures, what, after = DOT_FAILED, "the tensor-core sketch kernel", "using the atomic one"
    else:
        failures, what, after = (
            TRITON_FAILED,
            "the Triton kernels",
            "the GPU path uses torch operations from now on (slower; docs/PERFORMANCE.md)",
        )
    if not failures:  # the first failure is remembered for the process and warned once
        failures.append(repr(error))
        warnings.warn(
            f"rankscope: {what} failed ({repr(error)[:300]}); {after}", RuntimeWarning, stacklevel=3
        )
