"""Deferred device reports (rankscope.torch): a step whose sketch, loss, fingerprints or reduced
sketch (the aggregation check's) lie on a device is copied into pinned host memory without
blocking, and handed to the agent at a later ``mon.step`` once a CUDA event says the copy is done.
Nothing here calls ``.item()`` on a device tensor or synchronizes a device, except
``drain(block=True)`` (``flush``, ``close``, and a full queue of ``MAX_PENDING`` reports).

Thread safety: training thread only (``mon.step``, ``flush``, ``close``).
"""

import collections
import math
from collections.abc import Callable

import torch

from rankscope import fingerprint as _fp

# Reports on a device that are waiting for their host copy before the agent gets them.
MAX_PENDING = 64

# Marks a replica value that travels in a pending report's device payload.
_IN_PAYLOAD = object()


def host_loss(loss) -> float:
    """A loss given as None, a number or a CPU tensor, as a float (NaN for None)."""
    if loss is None:
        return float("nan")
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().reshape(()))  # a CPU tensor: no device synchronization
    return float(loss)


class _Pending:
    """A report whose values are being copied from a device to pinned host memory."""

    __slots__ = (
        "step",
        "host",
        "event",
        "cpu_bins",
        "cpu_sum_squares",
        "loss",
        "step_time",
        "batch",
        "fp_host",
        "fp_present",
        "loss_absent",
        "buckets",
        "dim",
        "reduced_bits",
        "reduced_cpu_bins",
        "replica_set",
    )

    def __init__(
        self,
        step,
        host,
        event,
        cpu_bins,
        cpu_sum_squares,
        loss,
        step_time,
        batch,
        fp_host=None,
        fp_present=(None, None, None),
    ):
        self.fp_host = fp_host  # int64 [grad fingerprint, param fingerprint, reduced ss bits]
        # Per slot of fp_host: None (not sent), _IN_PAYLOAD (read from fp_host), or the value
        # itself when it was computed on the host (a CPU bucket or parameter).
        self.fp_present = fp_present
        self.step = step
        self.host = host
        self.event = event
        self.cpu_bins = cpu_bins
        self.cpu_sum_squares = cpu_sum_squares
        self.loss = loss
        self.step_time = step_time
        self.batch = batch
        self.loss_absent = False
        self.buckets = None  # float32 squared norm per bucket (host), or None
        self.dim = 0  # the sketch_dim of its step (a control may change it): set by add
        # The aggregation check's reduced sketch (rankscope._integrity), on the steps this rank
        # checks: its bins ride in ``host`` after the local ones; 0 bits: none.
        self.reduced_bits = 0
        self.reduced_cpu_bins = None  # float64 bins of its CPU buckets (host), or None
        self.replica_set = None  # the parameter fingerprint's replica set (None: the group)


class DeferredReports:
    """The queue of reports waiting for their device-to-host copies, oldest first.

    ``agent`` is the rank's ``_native.Agent``; ``counters`` is the monitor's. The
    ``after_record(err)`` given to ``add`` and ``drain`` is called with what each
    ``agent.record_raw`` returned.
    """

    def __init__(self, agent, counters):
        self._agent = agent
        self._counters = counters
        self._pending = collections.deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self,
        step: int,
        device,
        sketch,
        dim: int,
        cpu_sketch,
        loss,
        fingerprints: Callable,
        step_time,
        batch,
        after_record: Callable[[str], None],
        bucket_sq=None,
        reduced=None,
        replica_set=None,
    ) -> None:
        """Starts copying one step's report from ``device``: ``sketch`` (the DeviceSketch on
        ``device``, or None), ``cpu_sketch`` (added when not empty: a model split across CPU and
        a device), ``loss`` (a tensor on ``device`` travels in the payload; anything else is
        read now), ``fingerprints()`` (ReplicaFingerprints.step_values on ``device``),
        ``bucket_sq`` (the squared norm per bucket on ``device``, or None) and ``reduced`` (the
        aggregation check's rankscope._integrity.Reduced, or None: its device bins travel in
        the same payload, after the reduction on the device's stream order); ``replica_set``
        goes with the parameter fingerprint (ReplicaFingerprints.replica_set)."""
        # Long: one step's payload is laid out, filled and copied in one place, in the order the
        # reader (``_land``) takes it apart: sketch bins, loss, squared norm, the reduced bins; a
        # split would pass the layout between functions.
        payload = torch.empty(
            dim + 2 + (dim if reduced is not None else 0), dtype=torch.float64, device=device
        )
        reduced_cpu_bins = None
        if reduced is not None:
            if reduced.device is not None:
                payload[dim + 2 :].copy_(reduced.device.bins)
            else:
                payload[dim + 2 :].zero_()
            if reduced.cpu is not None:
                reduced_cpu_bins = torch.empty(dim, dtype=torch.float64)
                reduced.cpu.copy_bins_to(reduced_cpu_bins.data_ptr())
        if sketch is not None:
            payload[:dim].copy_(sketch.bins)
            payload[dim].copy_(sketch.sum_squares)
        else:
            payload[: dim + 1].zero_()
        loss_value = None
        if isinstance(loss, torch.Tensor) and loss.device == device:
            payload[dim + 1].copy_(loss.detach().reshape(()))
        else:
            loss_value = host_loss(loss)
        cpu_bins, cpu_ss = None, 0.0
        if cpu_sketch.sum_squares() != 0.0:  # a model split across CPU and a device
            cpu_bins = torch.empty(dim, dtype=torch.float64)
            cpu_sketch.copy_bins_to(cpu_bins.data_ptr())
            cpu_ss = cpu_sketch.sum_squares()
        values = fingerprints()
        # Device tensors ride in a small int64 payload copied with the sketch; values already
        # on the host (Python numbers) are kept as they are: no host-to-device copy.
        present = tuple(_IN_PAYLOAD if isinstance(v, torch.Tensor) else v for v in values)
        fp_payload = None
        if any(v is _IN_PAYLOAD for v in present):
            fp_payload = torch.zeros(3, dtype=torch.int64, device=device)
            grad_fp, param_fp, reduced_ss = values
            if present[0] is _IN_PAYLOAD:
                fp_payload[0].copy_(grad_fp)
            if present[1] is _IN_PAYLOAD:
                fp_payload[1].copy_(param_fp)
            if present[2] is _IN_PAYLOAD:
                fp_payload[2:].copy_(reduced_ss.to(torch.float64).reshape(1).view(torch.int64))
        buckets_host = None
        if device.type == "cuda":
            if bucket_sq is not None:
                buckets_host = torch.empty(bucket_sq.numel(), dtype=torch.float32, pin_memory=True)
                buckets_host.copy_(bucket_sq, non_blocking=True)
            host = torch.empty(payload.numel(), dtype=torch.float64, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            fp_host = None
            if fp_payload is not None:
                fp_host = torch.empty(3, dtype=torch.int64, pin_memory=True)
                fp_host.copy_(fp_payload, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # no portable event: copied when drained (a later step), which waits there
            host, fp_host, event = payload, fp_payload, None
            buckets_host = None if bucket_sq is None else bucket_sq.clone()
        pending = _Pending(
            step, host, event, cpu_bins, cpu_ss, loss_value, step_time, batch, fp_host, present
        )
        pending.loss_absent = loss is None  # mon.step() without a loss: a pipeline stage
        pending.buckets = buckets_host
        pending.dim = dim
        pending.replica_set = replica_set
        if reduced is not None:
            pending.reduced_bits = reduced.bits
            pending.reduced_cpu_bins = reduced_cpu_bins
        self._pending.append(pending)
        if len(self._pending) > MAX_PENDING:
            self._counters["pending_overflow_waits"] += 1
            self.drain(after_record, block=True, limit=1)

    def drain(
        self, after_record: Callable[[str], None], block: bool, limit: int | None = None
    ) -> None:
        """Hands the reports whose copies are done to the agent, oldest first, up to ``limit``
        of them; with ``block``, waits for each copy instead of stopping at the first pending
        one."""
        done = 0
        while self._pending and (limit is None or done < limit):
            p = self._pending[0]
            if p.event is not None:
                if not block and not p.event.query():
                    return
                p.event.synchronize()
            host = p.host if p.event is not None else p.host.to("cpu")
            dim = p.dim
            bins = host[:dim]
            ss = float(host[dim]) + p.cpu_sum_squares
            if p.cpu_bins is not None:
                bins = bins + p.cpu_bins
            loss = float(host[dim + 1]) if p.loss is None else p.loss
            floats = bins.to(torch.float32).contiguous()
            reduced = None
            if p.reduced_bits:
                rbins = host[dim + 2 : 2 * dim + 2]
                if p.reduced_cpu_bins is not None:
                    rbins = rbins + p.reduced_cpu_bins
                reduced = rbins.to(torch.float32).contiguous()
            fps = list(p.fp_present)
            if p.fp_host is not None:
                fp_host = p.fp_host if p.event is not None else p.fp_host.to("cpu")
                if fps[0] is _IN_PAYLOAD:
                    fps[0] = fp_host[0]
                if fps[1] is _IN_PAYLOAD:
                    fps[1] = fp_host[1]
                if fps[2] is _IN_PAYLOAD:
                    fps[2] = float(fp_host[2:].view(torch.float64)[0])
            if fps[0] is not None:
                fps[0] = _fp.to_uint64(fps[0])
            if fps[1] is not None:
                fps[1] = _fp.to_uint64(fps[1])
            if fps[2] is not None:
                fps[2] = math.sqrt(max(float(fps[2]), 0.0))
            err = self._agent.record_raw(
                p.step,
                loss,
                math.sqrt(max(ss, 0.0)),
                floats.data_ptr(),
                floats.numel(),
                p.step_time,
                p.batch,
                reduced_grad_fingerprint=fps[0],
                param_fingerprint=fps[1],
                replica_set=None if fps[1] is None else p.replica_set,
                reduced_grad_norm=fps[2],
                loss_absent=p.loss_absent,
                bucket_norms=[]
                if p.buckets is None
                else p.buckets.to("cpu", torch.float32).sqrt().tolist(),
                reduced_sketch_address=0 if reduced is None else reduced.data_ptr(),
                reduced_grad_mantissa_bits=p.reduced_bits,
            )
            after_record(err)
            self._pending.popleft()
            done += 1
