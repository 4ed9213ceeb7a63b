"""Aggregation integrity, the rank's side (rankscope.torch; docs/DESIGN.md "Aggregation
integrity"): on the steps it checks, this rank sketches the *reduced* gradient with the same hash,
seed and k as the local sketch, in the all-reduce callback that already reads every reduced bucket
for the replica fingerprint (rankscope._replica), and sends it with the step's report; the
collector compares it with the mean of the ranks' local sketches.

Which rank checks which step: with ``every`` = N, the steps whose number is a multiple of N,
rotating over the group: step s is checked by rank ``(s // N) % world``. Every rank derives the
same schedule from the step number, without communication; each checked step costs one rank one
more sketch pass over the reduced gradient.

CPU buckets go to the C++ kernel (the local sketch's ``_native.Sketch``, GIL released); buckets
on a device are not checked yet (rankscope._backend.reduced_sketch says "none"; counted as
``integrity_skipped_buckets``, and that step sends no reduced sketch).

Thread safety: ``begin_step`` and ``take`` run on the training thread in ``mon.step``; ``add``
in the all-reduce's future callbacks, possibly on several communication threads at once (a lock
serializes the adds); ``reset`` on the autograd thread when a backward restarts. The two sides
never overlap (``mon.step`` runs after every bucket of the step was reduced).
"""

import threading

import torch

from rankscope import _backend, _native
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


class ReducedSketch:
    """The reduced gradient's count sketch of the steps this rank checks."""

    def __init__(self, dim: int, seed: int, rank: int, world: int, every: int, counters):
        self._seed = seed
        self._rank = rank
        self._world = world
        self.every = every
        self._counters = counters
        self._lock = threading.Lock()
        self._sketch = _native.Sketch(dim, seed, 1) if every > 0 else None
        self._due = False
        self._complete = True
        self._bits = 0

    @property
    def due(self) -> bool:
        """This rank checks the step being accumulated."""
        return self._due

    def disable(self) -> None:
        """Never check (a framework whose reduced gradient is not the whole mean gradient)."""
        self.every = 0
        self._due = False

    def set_dim(self, dim: int) -> None:
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
                self._sketch.reset()
                self._complete = True
                self._bits = 0

    def add(self, flat: torch.Tensor, layout) -> None:
        """Adds the reduced bucket ``flat`` (laid out as ``layout``, a SegmentLayout) to the
        step's reduced sketch."""
        if not self._due:
            return
        if _backend.reduced_sketch(flat).backend != _backend.NATIVE:
            with self._lock:
                self._complete = False
            self._counters["integrity_skipped_buckets"] += 1
            return
        dtype = _NATIVE[flat.dtype]
        base, size = flat.data_ptr(), flat.element_size()
        addrs = [base + s * size for s in layout.starts]
        with self._lock:
            err = self._sketch.add_many(addrs, layout.counts, layout.global_offsets, dtype)
            bits = MANTISSA_BITS[flat.dtype]
            # Buckets of several dtypes: the coarsest one bounds the reduction's rounding.
            self._bits = bits if not self._bits else min(self._bits, bits)
            if err:
                self._complete = False
        if err:
            self._counters["integrity_errors"] += 1

    def take(self):
        """(sketch, mantissa bits) to send with the step's report, or (None, 0) when this rank
        does not check it or a bucket was skipped."""
        if not self._due or not self._complete or not self._bits:
            return None, 0
        self._counters["integrity_checks_sent"] += 1
        return self._sketch, self._bits
