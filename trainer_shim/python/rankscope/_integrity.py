"""Aggregation integrity, the rank's side (rankscope.torch; docs/DESIGN.md "Aggregation
integrity"): on the steps it checks, this rank sketches the *reduced* gradient with the same hash,
seed and k as the local sketch, in the all-reduce callback that already reads every reduced bucket
for the replica fingerprint (rankscope._replica), and sends it with the step's report; the
collector compares it with the mean of the ranks' local sketches.

Which rank checks which step: with ``every`` = N, the steps whose number is a multiple of N,
rotating over the group: step s is checked by rank ``(s // N) % world``. Every rank derives the
same schedule from the step number, without communication; each checked step costs one rank one
more sketch pass over the reduced gradient.

Where the reduced sketch is computed (rankscope._backend.reduced_sketch): CPU buckets go to the C++
kernel (the local sketch's ``_native.Sketch``, GIL released); buckets on a device (and CPU buckets
under the tests' ``bypass_native``) to a DeviceSketch on that device (a Triton kernel on a CUDA
device, else torch ops), launched in the all-reduce's future callback, so after the reduction and
on its stream: nothing synchronizes the host. A step with a device part is read back with the
local sketch by rankscope._deferred (``Reduced.device``), the same copy, at a later ``mon.step``.
A bucket of a dtype the check does not take is counted as ``integrity_skipped_buckets`` and that
step sends no reduced sketch.

Frameworks that reduce outside DDP's comm hook hand their reduced gradient over themselves: FSDP1
NO_SHARD's hook adds each unit's all-reduced flat gradient (``add`` with a key:
rankscope.frameworks.fsdp1), DeepSpeed ZeRO-0 each parameter's reduced ``.grad`` before its
optimizer step (``add_tensors``: rankscope.frameworks.deepspeed), FSDP2 with a shard group of one
rank each parameter's accumulated reduced ``.grad`` at the end of every backward that reduced,
the step's last such read replacing the earlier ones (``reset`` then ``add_tensors``:
rankscope.frameworks.fsdp2).

Thread safety: ``begin_step`` and ``take`` run on the training thread in ``mon.step``; ``add``
in the all-reduce's future callbacks, possibly on several communication threads at once (a lock
serializes the adds); ``reset`` on the autograd thread when a backward restarts. The two sides
never overlap (``mon.step`` runs after every bucket of the step was reduced).
"""

import math
import threading
from typing import NamedTuple

import torch

from rankscope import _backend, _native
from rankscope._device_sketch import DeviceSketch
from rankscope._options import INTEGRITY_EVERY as INTEGRITY_EVERY

# Significand bits of the dtypes a reduction runs in (the collector's tolerance uses 2^-p).
MANTISSA_BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}

_NATIVE = {
    torch.float32: _native.DTYPE_FLOAT32,
    torch.bfloat16: _native.DTYPE_BFLOAT16,
    torch.float16: _native.DTYPE_FLOAT16,
}


def check_rank(step: int, every: int, world: int):
    """The rank of the group that checks ``step``, or None when the step is not checked."""
    if every <= 0 or world <= 0 or step % every:
        return None
    return (step // every) % world


# How much of the added variance effective_mantissa_bits may leave to lambda's margin.
SLACK = 9 / 8


def effective_mantissa_bits(bits: int, float32_terms: int, value_bits: int = 0) -> int:
    """The precision p to send with a reduced sketch whose sketches (the local ones and the
    reduced one) were summed in float32 partial bins of about ``float32_terms`` values each, with
    values rounded to ``value_bits`` significant bits on their way in (0: exact) (the Triton
    kernels: DeviceSketch.float32_terms, .value_bits): the largest p <= ``bits`` with
    ``SLACK * 2^-2p >= 2^-2bits + 2^-48 * terms / 3 + (2/3) 2^-2 value_bits``.

    Why that covers it (docs/DESIGN.md "Aggregation integrity"): a float32 running sum of m values
    of random sign rounds each partial sum S_j by at most 2^-24 |S_j|, error variance about
    2^-48 m / 6 times the bin's square, and a value rounded to v bits errs by at most 2^-v of
    itself, variance 2^-2v / 3 of its square; summed over the bins of the reduced sketch s and
    the local ones x_r (the mean divides each by W): (m/6 2^-48 + 2^-2v / 3) (||s||^2 +
    sum_r ||x_r||^2 / W^2) <= (2^-48 m / 3 + (2/3) 2^-2v) sum_r ||g_r||^2 (||s||^2 <=
    sum_r ||g_r||^2 / W, and a sketch keeps a vector's squared norm in expectation). The
    collector's reduction term is u^2 sum_r ||g_r||^2 with u = 2^-p, so lowering p by this much
    adds that bound. SLACK (9/8) keeps p where the added terms are under an eighth of the
    reduction's own: p is a whole number, and one bit less would double tau for a 1 % wider
    bound (bfloat16 gradients on the tensor cores); an eighth of the variance moves tau by under
    6 %, inside lambda's margin (the clean steps' worst ratio is 0.27). The torch-op and C++
    paths sum in float64 from exact values (``bits`` unchanged)."""
    if float32_terms <= 0 and value_bits <= 0:
        return bits
    variance = 2.0 ** (-2 * bits) + 2.0**-48 * max(float32_terms, 0) / 3
    if value_bits > 0:
        variance += 2.0 ** (-2 * value_bits) * 2 / 3
    return max(1, min(bits, math.floor(-0.5 * math.log2(variance / SLACK))))


class Reduced(NamedTuple):
    """The reduced sketch of a step this rank checks: its CPU part (a ``_native.Sketch``, or None
    when no bucket was on the CPU), its device part (a DeviceSketch, or None), and the precision
    to send (mantissa bits of the coarsest bucket dtype, before effective_mantissa_bits)."""

    cpu: object
    device: DeviceSketch | None
    bits: int


class ReducedSketch:
    """The reduced gradient's count sketch of the steps this rank checks."""

    def __init__(self, dim: int, seed: int, rank: int, world: int, every: int, counters):
        self._dim = dim
        self._seed = seed
        self._rank = rank
        self._world = world
        self.every = every
        self._counters = counters
        self._lock = threading.Lock()
        self._sketch = _native.Sketch(dim, seed, 1) if every > 0 else None
        self._devices = {}  # device -> DeviceSketch (the device path's reduced sketch)
        # Tests: CPU buckets bypass the C++ kernel and take the device path (DeviceSketch with
        # torch ops), as a GPU's would (Monitor._bypass_native).
        self.bypass_native = False
        self._due = False
        self._complete = True
        self._bits = 0
        self._on_cpu = False  # a bucket of this step went to the C++ kernel
        self._device = None  # the DeviceSketch this step's device buckets went to
        self._keys = set()  # the keys ``add`` was given this step

    @property
    def due(self) -> bool:
        """This rank checks the step being accumulated."""
        return self._due

    def disable(self) -> None:
        """Never check (a framework whose reduced gradient is not the whole mean gradient)."""
        self.every = 0
        self._due = False

    def set_dim(self, dim: int) -> None:
        self._dim = dim
        self._devices = {}
        if self._sketch is not None:
            self._sketch = _native.Sketch(dim, self._seed, 1)

    def begin_step(self, step: int) -> None:
        """The step numbered ``step`` starts: is it this rank's to check?"""
        self._due = check_rank(step, self.every, self._world) == self._rank
        self.reset()

    def reset(self) -> None:
        """Forgets what the step added (a new step, or a backward that restarted)."""
        if self._sketch is not None:
            with self._lock:
                if self._on_cpu:
                    self._sketch.reset()
                if self._device is not None:
                    self._device.reset()  # on the device, ordered before the next step's adds
                self._complete = True
                self._bits = 0
                self._on_cpu = False
                self._device = None
                self._keys = set()

    def add(self, flat: torch.Tensor, layout, key=None) -> None:
        """Adds the reduced bucket ``flat`` (laid out as ``layout``, a SegmentLayout) to the
        step's reduced sketch. ``key`` names a buffer a framework may reduce more than once a
        step (an FSDP1 unit under accumulation without ``no_sync``: each reduction then holds the
        earlier ones' sum too, so adding it again would count them twice): a second reduction
        of one key leaves the step unchecked (``integrity_repeated_reductions``)."""
        if not self._due:
            return
        if key is not None:
            with self._lock:
                repeated = key in self._keys
                self._keys.add(key)
                if repeated:
                    self._complete = False
            if repeated:
                self._counters["integrity_repeated_reductions"] += 1
                return
        choice = _backend.reduced_sketch(flat, self._dim, native=not self.bypass_native)
        if choice.backend == _backend.NONE:
            self._skipped()
            return
        if choice.backend == _backend.NATIVE:
            base, size = flat.data_ptr(), flat.element_size()
            addrs = [base + s * size for s in layout.starts]
            self._add_native(flat.dtype, addrs, layout.counts, layout.global_offsets)
            return
        self._add_device(flat, lambda sketch: sketch.add_segments(flat, layout))

    def fold_planned(self, plan, base: int, dtype):
        """A planned CPU bucket (``plan``, a ``_native.BucketPlan``, of the buffer at ``base``
        of ``dtype``): added to the step's reduced sketch and folded into its replica fingerprint
        in one C++ call (``BucketPlan.fingerprint``); returns (fingerprint, sum of squares). The
        caller checked that this rank is due, the kernel not bypassed, and the dtype native."""
        with self._lock:
            self._on_cpu = True
            self._note_bits(dtype)
            return plan.fingerprint(base, self._sketch)

    def add_tensors(self, tensors, offsets, reduction_dtype=None) -> None:
        """Adds reduced gradients given one tensor a parameter (``tensors[i]`` dense, at global
        flat offset ``offsets[i]``; None entries skipped): a framework that reduces outside the
        comm hook (DeepSpeed ZeRO-0). ``reduction_dtype``: the dtype the framework reduced in,
        when it may be coarser than the tensors' own."""
        if not self._due:
            return
        if reduction_dtype is not None:
            if reduction_dtype not in MANTISSA_BITS:
                self._skipped()
                return
            with self._lock:
                self._note_bits(reduction_dtype)
        native = {}  # dtype -> (addresses, counts, offsets)
        copies = []  # contiguous copies the C++ kernel reads (kept alive until it has)
        for t, off in zip(tensors, offsets):
            if t is None or t.numel() == 0:
                continue
            if not t.is_contiguous():
                t = t.contiguous()
                copies.append(t)
            choice = _backend.reduced_sketch(t, self._dim, native=not self.bypass_native)
            if choice.backend == _backend.NONE:
                self._skipped()
                return
            if choice.backend == _backend.NATIVE:
                addrs, counts, offs = native.setdefault(t.dtype, ([], [], []))
                addrs.append(t.data_ptr())
                counts.append(t.numel())
                offs.append(off)
            else:
                self._add_device(t, lambda sketch, t=t, off=off: sketch.add(t, off))
        for dtype, (addrs, counts, offs) in native.items():
            self._add_native(dtype, addrs, counts, offs)
        del copies

    def _add_native(self, dtype, addrs, counts, offsets) -> None:
        with self._lock:
            err = self._sketch.add_many(addrs, counts, offsets, _NATIVE[dtype])
            self._on_cpu = True
            self._note_bits(dtype)
            if err:
                self._complete = False
        if err:
            self._counters["integrity_errors"] += 1

    def _add_device(self, t: torch.Tensor, add) -> None:
        """``add(DeviceSketch)`` on ``t``'s device: launched there, no synchronization."""
        with self._lock:
            sketch = self._devices.get(t.device)
            failed = False
            if self._device is not None and self._device.device != t.device:
                failed = True  # buckets on two devices: not one report's payload
            else:
                try:
                    if sketch is None:
                        sketch = DeviceSketch(self._dim, self._seed, t.device)
                        self._devices[t.device] = sketch
                    self._device = sketch
                    add(sketch)
                except Exception:  # monitoring must never break training; this step unchecked
                    failed = True
                self._note_bits(t.dtype)
            if failed:
                self._complete = False
        if failed:
            self._counters["integrity_errors"] += 1

    def _note_bits(self, dtype) -> None:
        # Buckets of several dtypes: the coarsest one bounds the reduction's rounding.
        bits = MANTISSA_BITS[dtype]
        self._bits = bits if not self._bits else min(self._bits, bits)

    def fail(self) -> None:
        """The step's reduced gradient could not be read whole: it sends no reduced sketch
        (counted as ``integrity_errors``)."""
        with self._lock:
            self._complete = False
        self._counters["integrity_errors"] += 1

    def unread(self) -> None:
        """The step's reduced gradient was not at a point the framework path can read it (FSDP2:
        a backward that left its reductions to a later finalization): the step sends no reduced
        sketch unless a later read of the same step replaces this one (``reset`` then adds);
        counted as ``integrity_unread``."""
        with self._lock:
            self._complete = False
        self._counters["integrity_unread"] += 1

    def _skipped(self) -> None:
        with self._lock:
            self._complete = False
        self._counters["integrity_skipped_buckets"] += 1

    def take(self):
        """The step's ``Reduced`` sketch to send with its report, or None when this rank does
        not check it, a bucket was skipped or failed, or nothing was added."""
        if not self._due or not self._complete or not self._bits:
            return None
        if not self._on_cpu and self._device is None:
            return None
        self._counters["integrity_checks_sent"] += 1
        return Reduced(self._sketch if self._on_cpu else None, self._device, self._bits)
