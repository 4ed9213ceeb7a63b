"""Replica fingerprints of one rank (rankscope.torch; the arithmetic is rankscope.fingerprint).

The comm hook chains a callback on each bucket's all-reduce future that folds the *reduced*
bucket into an order-independent 64-bit fingerprint and its exact sum of squares; every
``param_check_every`` steps ``mon.step`` fingerprints the parameters after the optimizer step. The
values go with the step's report, and the collector names the ranks whose fingerprints differ
from the majority. rankscope._backend picks the backend per tensor (its table): CPU tensors take
the C++ kernel (Python numbers); tensors on a device are folded there, by a Triton kernel on a
CUDA device or torch ops (0-d tensors, never synchronized here). A bucket's layout is the bucket
sketcher's (computed and cached there once).

Replica check (docs/DESIGN.md "Replica check: exact or tolerance"): ``"exact"`` compares the
fingerprints bit for bit; ``"tolerance"`` (replicas a framework or mode does not promise to keep
bit-identical) sends each fingerprint with the float summary of the same values
(rankscope.replica_summary: the reduced buckets' in the same callback, the parameters' at a
parameter check), which the collector compares within a tolerance. The summaries are computed
for CPU tensors so far; on a device no fingerprint is sent under this check (counted as
``replica_summary_skipped``, warned once): alone it would be compared bit for bit.

Thread safety: ``bucket_layout`` runs on the autograd thread while backward runs, and
``fold_reduced`` when a collective completes, possibly on a communication thread (it only appends
to lists); ``step_values`` and ``reset`` run on the training thread in ``mon.step``, after every
bucket of the step was reduced.
"""

from collections.abc import Callable

import torch

from rankscope import _backend
from rankscope import fingerprint as _fp
from rankscope import replica_summary as _summary

REPLICA_CHECKS = ("exact", "tolerance")


class ReplicaFingerprints:
    """The step's reduced-gradient fingerprint and the periodic parameter fingerprint.

    ``counters`` and ``warn_once(key, message)`` are the monitor's.
    """

    def __init__(
        self,
        model,
        enabled: bool,
        param_check_every: int,
        counters,
        warn_once: Callable,
        replica_check: str = "exact",
    ):
        if replica_check not in REPLICA_CHECKS:
            raise ValueError(
                f"replica_check must be one of {REPLICA_CHECKS}, got {replica_check!r}"
            )
        self.replica_check = replica_check
        # Which replica set the parameter fingerprint belongs to (StepReport.replica_set): the
        # ranks that send the same value hold replicas of the same values and are compared with
        # each other only. None: the one set of the whole group (DDP). A framework path sets it
        # (FSDP2 HSDP: the rank's shard index, rankscope.frameworks.fsdp2).
        self.replica_set = None
        # The float summaries of the step being closed (tolerance mode, CPU tensors; None
        # otherwise): the parameters' (projections, rounding) at a parameter check, and the
        # reduced gradient's (projections, rounding, precision). What the step's report carries.
        self.param_summary = None
        self.grad_summary = None
        self._counters = counters
        self._warn_once = warn_once
        # Parameter fingerprints: every parameter (frozen ones too), model.parameters() order.
        self._params = []
        self._param_offsets = []
        seen, total = set(), 0
        for p in model.module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            self._params.append(p)
            self._param_offsets.append(total)
            total += p.numel()
        self.enabled = enabled  # fingerprint the reduced gradient of every reported step
        self._param_check_every = param_check_every
        self._last_param_check = None  # step of the last parameter fingerprint
        self._fold_tables = {}  # the parameters' piece tables for fingerprint.fold_many
        # Tests: CPU tensors bypass the C++ kernel and take the device path, as a GPU's would
        # (rankscope._backend's ``native=False``).
        self.bypass_native = False
        # Aggregation integrity (rankscope._integrity.ReducedSketch), set by the monitor: the
        # reduced buckets of the steps this rank checks are sketched here too.
        self.integrity = None
        # Per step: one value per reduced bucket (appended by future callbacks: list.append
        # only).
        self._buckets = 0
        self._incomplete = False  # a bucket of this step could not be fingerprinted
        self._grad_fps = []
        self._reduced_ss = []
        self._grad_partials = []  # tolerance mode: (replica_summary.Partial, precision) a bucket

    def reset(self) -> None:
        """Forgets the step's buckets (the next step starts)."""
        self._buckets = 0
        self._incomplete = False
        self._grad_fps = []
        self._reduced_ss = []
        self._grad_partials = []
        if self.integrity is not None:
            self.integrity.reset()

    @property
    def wants_reduced(self) -> bool:
        """The reduced buckets of the step being accumulated are read (fingerprint or
        aggregation check)."""
        return self.enabled or (self.integrity is not None and self.integrity.due)

    def bucket_layout(self, bucket, sketcher):
        """Where this bucket's parameters lie in its buffer and in the global flat vector (a
        SegmentLayout, from ``sketcher``, the BucketSketcher, which saw the bucket first and
        caches it once DDP's buckets are final), or None when the buffer cannot be folded
        (counted)."""
        layout, why = sketcher.bucket_layout(bucket)
        if layout is None:
            self._skipped(why)
            return None
        self._buckets += 1
        return layout

    def fold_reduced(self, fut, layout):
        """Future callback (after the all-reduce): folds the reduced bucket into the step's
        fingerprint and sum of squares on its device, adds it to the step's reduced sketch when
        this rank checks the aggregation, and passes the value on unchanged."""
        value = fut.value()
        try:
            t = value[0] if isinstance(value, (list, tuple)) else value
            native = layout.native
            if (
                native is not None
                and t.dtype is native[1]
                and t.is_cpu
                and t.numel() == layout.numel
                and t.is_contiguous()
                and self._plain_fold()
            ):
                # The planned CPU bucket, folded as it lies: one C++ call (the bucket sketcher
                # built its vectors once), the same kernels as fold_segments_cpu and, on the
                # steps this rank checks the aggregation, as integrity.add's.
                integrity = self.integrity
                if integrity is not None and integrity.due:
                    f, ss = integrity.fold_planned(native[0], t.data_ptr(), t.dtype)
                else:
                    f, ss = native[0].fingerprint(t.data_ptr())
                self._grad_fps.append(f)
                self._reduced_ss.append(ss)
                return value
            flat = t.detach().reshape(-1)
            if self.integrity is not None:
                self.integrity.add(flat, layout)
            if not self.enabled:
                pass
            elif self._backend_of(flat) == _backend.NATIVE:  # C++: one pass
                f, ss = _fp.fold_segments_cpu(flat, layout)
                self._grad_fps.append(f)
                self._reduced_ss.append(ss)
            else:  # on the device (Triton, or torch ops), no synchronization
                f, ss = _fp.fold_segments_and_squares(flat, layout)
                self._grad_fps.append(f)
                self._reduced_ss.append(ss)
            if self.enabled and self.replica_check == "tolerance" and flat.device.type == "cpu":
                part = _summary.partial_segments(flat, layout)
                self._grad_partials.append((part, _summary.precision(flat.dtype)))
        except Exception as e:  # monitoring must never break training
            self._counters["fingerprint_errors"] += 1
            self._warn_once("fperr", f"rankscope: could not fingerprint a reduced bucket ({e!r})")
        return value

    def step_values(self, step: int, device):
        """(grad fingerprint, param fingerprint, reduced sum of squares) of the step being
        closed: Python numbers when computed on the host (CPU tensors), 0-d tensors on
        ``device`` otherwise, None when not sent. No synchronization."""
        grad_fp = reduced_ss = param_fp = None
        self.param_summary = self.grad_summary = None
        if (
            self.enabled
            and self._buckets
            and not self._incomplete
            and len(self._grad_fps) == self._buckets
        ):
            grad_fp = _fp.add_all(self._grad_fps, device)
            sss = self._reduced_ss
            if all(isinstance(v, float) for v in sss):
                reduced_ss = sum(sss)
            else:
                # Host values (CPU buckets) are added as a scalar: no host-to-device copy.
                host = sum(v for v in sss if isinstance(v, float))
                reduced_ss = (
                    torch.cat(
                        [
                            v.to(device, torch.float64).reshape(-1)
                            for v in sss
                            if isinstance(v, torch.Tensor)
                        ]
                    )
                    .sum()
                    .add_(host)
                )
        if grad_fp is not None and self.replica_check == "tolerance":
            self.grad_summary = self._grad_summary()
        if self._param_check_due(step):
            try:
                parts, on_device, device_offsets = [], [], []
                with torch.no_grad():
                    for p, off in zip(self._params, self._param_offsets):
                        backend = self._backend_of(p)
                        if backend == _backend.NATIVE:
                            parts.append(_fp.fold_cpu(p, off)[0])
                        elif backend != _backend.NONE:
                            on_device.append(p)
                            device_offsets.append(off)
                    parts.extend(_fp.fold_many(on_device, device_offsets, self._fold_tables))
                param_fp = _fp.add_all(parts, device) if parts else 0
                if self.replica_check == "tolerance":
                    self.param_summary = self._summarize(on_device)
                self._last_param_check = step
                self._counters["param_checks"] += 1
            except Exception as e:
                self._counters["fingerprint_errors"] += 1
                self._warn_once(
                    "fpparam", f"rankscope: could not fingerprint the parameters ({e!r})"
                )
        if self.replica_check == "tolerance":
            # A fingerprint goes out with its summary only: alone, the collector would compare
            # it bit for bit, which these replicas do not promise.
            if self.grad_summary is None:
                grad_fp = None
            if self.param_summary is None:
                param_fp = None
        return grad_fp, param_fp, reduced_ss

    def _grad_summary(self):
        """The reduced gradient's (projections, rounding, precision) from the step's buckets, or
        None when a bucket was not summarized (on a device: counted, warned once)."""
        if len(self._grad_partials) != self._buckets:
            self._skipped_summary()
            return None
        total = _summary.Partial()
        for part, _ in self._grad_partials:
            total.add(part)
        projections, rounding = total.finish()
        return projections, rounding, min(p for _, p in self._grad_partials)

    def _skipped_summary(self) -> None:
        self._counters["replica_summary_skipped"] += 1
        self._warn_once(
            "fpsummary",
            "rankscope: the tolerance replica check summarizes CPU tensors only so far; this "
            "rank's replicas on a device are not compared",
        )

    def _summarize(self, on_device):
        """The parameters' float summary (rankscope.replica_summary) over the values the
        fingerprint covers, or None when some lie on a device (counted, warned once)."""
        if any(p.device.type != "cpu" for p in on_device):
            self._skipped_summary()
            return None
        tensors, offsets = [], []
        for p, off in zip(self._params, self._param_offsets):
            if self._backend_of(p) != _backend.NONE:
                tensors.append(p)
                offsets.append(off)
        return _summary.summarize(tensors, offsets)

    def _plain_fold(self) -> bool:
        """A planned reduced bucket can be folded in one C++ call: the fingerprint is on, under
        the exact replica check (no float summary), the C++ kernel not bypassed (tests), and the
        aggregation check, if due, not bypassing it either."""
        integrity = self.integrity
        return (
            self.enabled
            and self.replica_check == "exact"
            and not self.bypass_native
            and (integrity is None or not integrity.due or not integrity.bypass_native)
        )

    def _backend_of(self, t) -> str:
        return _backend.fingerprint(t, native=not self.bypass_native).backend

    def _param_check_due(self, step: int) -> bool:
        every = self._param_check_every
        if not every:
            return False
        last = self._last_param_check
        return last is None or step // every > last // every or step < last

    def _skipped(self, what: str) -> None:
        self._incomplete = True
        self._counters["fingerprint_skipped_buckets"] += 1
        self._warn_once(
            "fpskip",
            f"rankscope: {what} cannot be fingerprinted; the reduced "
            "gradient's replica check is off for such steps",
        )
