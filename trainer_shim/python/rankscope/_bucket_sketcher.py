"""The bucket sketcher: what the DDP comm hook does with each gradient bucket *before* the
all-reduce (rankscope.torch).

Every parameter's local gradient is added into this rank's count sketch at the parameter's global
flat offset (fixed once from ``module.named_parameters()``, identical on every rank; DDP rebuilds
its buckets after the first iteration, so nothing is keyed by bucket index until they are final),
and the exact sum of squares is accumulated. CPU gradients go to the C++ kernel straight from the
tensor's memory (float32, bfloat16, float16; other dtypes are converted to float32 first), with
the GIL released. Gradients on another device are sketched there by a DeviceSketch
(rankscope._device_sketch: a fused Triton kernel on a CUDA device, else torch operations that
reproduce the kernel's hash exactly), one sketch per device; rankscope._backend decides which
(its docstring has the table).

Bucket layouts: where each gradient of a bucket lies in its buffer and in the global flat vector
(a fingerprint.SegmentLayout) is computed here (``bucket_layout``), for the sketch and for the
replica fingerprints (rankscope._replica asks for it), and cached once per bucket when DDP's
buckets are final, with what the sketch's fast path needs (a ``_native.BucketPlan`` for the C++
kernel, the layout itself for DeviceSketch.add_segments): from then on a bucket is added in one
call.

The sketcher also tracks which parameters this step has sketched: a parameter seen twice means a
second synchronized backward ran before ``mon.step()``, and the step starts over (``reset``, then
``on_restart`` for the rest of the monitor's per-step state).

Where in the model: the sketcher also sums each parameter group's squared local gradient norm
(rankscope._buckets: the groups and their names, fixed at attach); ``bucket_norms`` reads them at
the step. A planned CPU bucket gets them from the C++ sketch kernel's own pass (each segment's
sum of squares into its group's float64 sum: the BucketPlan knows each segment's group; the
precision is rankscope/sketch.h's "call's squares", within float rounding of the float32 torch
norm it replaces), so it costs no torch call. Elsewhere (the first, unplanned steps, and the
device path) it is one ``torch._foreach_norm`` per bucket on the gradient's device (no host
copy, no synchronization), one more read of each gradient beside the sketch's. A failure there
turns the per-bucket norms off (warned once), never the sketch.

Thread safety: used from the autograd thread while backward runs (``add_bucket``) and from the
training thread in ``mon.step`` (everything else); the two never overlap.
"""

import bisect
import math
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch

from rankscope import _backend, _native
from rankscope import fingerprint as _fp
from rankscope._buckets import DEFAULT_MAX_BUCKETS, group_parameters
from rankscope._torch_compat import foreach_norms
from rankscope._device_sketch import DeviceSketch
from rankscope.fingerprint import SegmentLayout

# The dtypes the C++ kernel reads in place.
NATIVE_DTYPES = {
    torch.float32: _native.DTYPE_FLOAT32,
    torch.bfloat16: _native.DTYPE_BFLOAT16,
    torch.float16: _native.DTYPE_FLOAT16,
}


class _Bucket(NamedTuple):
    """A final bucket's cached layout: its buffer (address, numel), where its gradients lie
    (``layout``), and the sketch's plan for it (a ``_native.BucketPlan``, the layout for a
    DeviceSketch, or None: the slow path every step)."""

    base: int
    numel: int
    layout: SegmentLayout
    plan: object


def bucket_layout(buf, params, grads, offset_of):
    """(SegmentLayout, None) of where ``grads`` (of ``params``) lie in the bucket buffer
    ``buf`` and in the global flat vector (``offset_of(p)``), or (None, why it has none)."""
    if not _fp.supported(buf.dtype) or buf.is_sparse:
        return None, f"a {buf.dtype} gradient bucket"
    base, size = buf.data_ptr(), buf.element_size()
    starts, counts, offsets = [], [], []
    for p, g in zip(params, grads):
        n = g.numel()
        if n == 0:
            continue
        off = offset_of(p)
        delta = g.data_ptr() - base
        if (
            off is None
            or g.dtype != buf.dtype
            or not g.is_contiguous()
            or delta % size
            or delta < 0
            or delta // size + n > buf.numel()
        ):
            return None, "a gradient that is not a dense view of its bucket"
        starts.append(delta // size)
        counts.append(n)
        offsets.append(off)
    return SegmentLayout(buf.numel(), starts, counts, offsets), None


def buckets_are_final(ddp) -> bool:
    """True once DDP will not rebuild its buckets any more: it rebuilt them (after the first
    iteration), or it never will (find_unused_parameters without static_graph)."""
    if ddp is None:
        return False
    if getattr(ddp, "_has_rebuilt_buckets", False):
        return True
    return bool(getattr(ddp, "find_unused_parameters", False)) and not getattr(
        ddp, "static_graph", False
    )


class BucketSketcher:
    """One rank's sketch of the local gradient of the step being accumulated.

    ``counters`` (a Counter) and ``warn_once(key, message)`` are the monitor's; ``on_restart()``
    is called after ``reset()`` when a backward restarts within a step.
    """

    def __init__(
        self,
        model,
        dim: int,
        seed: int,
        counters,
        warn_once: Callable,
        on_restart: Callable,
        threads: int = 1,
        max_buckets: int = DEFAULT_MAX_BUCKETS,
    ):
        self._counters = counters
        self._warn_once = warn_once
        self._on_restart = on_restart
        # Global flat offsets, by parameter, in module order (identical on every rank).
        self._offset_by_id = {}
        self._offset_by_ptr = {}
        total = 0
        param_names, param_starts = [], []
        for name, p in model.module.named_parameters():
            if not p.requires_grad or id(p) in self._offset_by_id:
                continue
            self._offset_by_id[id(p)] = total
            if p.numel() > 0:
                self._offset_by_ptr[p.data_ptr()] = total
                param_names.append(name)
                param_starts.append(total)
            total += p.numel()
        self.num_coordinates = total

        # Where in the model: the parameter groups (rankscope._buckets), each parameter's group
        # by its global offset, and per device the step's squared norm of each group.
        self.bucket_names = []
        self._param_starts = param_starts
        self._param_bucket = []
        if max_buckets > 0 and param_names:
            self.bucket_names, self._param_bucket = group_parameters(param_names, max_buckets)
        self._bucket_sq = {}  # device -> float32 tensor, one squared norm per bucket
        self._torch_norms = False  # this step added to _bucket_sq (else it holds zeros)
        self._norm_index = {}  # bucket index -> (len(grads), kept positions, group indices)

        self.dim = dim
        self._seed = seed
        self._threads = threads  # CPU sketch threads (rankscope/striped_sketch.h)
        self.cpu_sketch = _native.Sketch(dim, seed, threads)
        self.device_sketches = {}  # device -> DeviceSketch
        # Tests: CPU tensors bypass the C++ kernel and take the device path (DeviceSketch),
        # as a GPU's would (rankscope._backend's ``native=False``).
        self.bypass_native = False
        # Per bucket index: a _Bucket, filled only once DDP has rebuilt its buckets (after
        # that, index, buffer and layout stay fixed).
        self._ddp_ref = weakref.ref(model)
        self.plans_final = False
        self._plans = {}

        # A parameter sketched twice in a step means a backward restarted (DDP: the buckets hold
        # the accumulated gradient); a framework that reduces every micro-batch clears this, and
        # then its micro-batch gradients add up in the sketch.
        self.restart_on_repeat = True

        # Per-step state.
        self.got_grads = False
        self.seen_params = set()  # global offsets of the parameters sketched this step
        self.t_first_hook = None  # time.monotonic() of the step's first bucket

    def offset_of(self, p):
        """The parameter's global flat offset, or None if it was not in the module at attach."""
        off = self._offset_by_id.get(id(p))
        if off is None and p.numel() > 0:
            off = self._offset_by_ptr.get(p.data_ptr())
        return off

    def add_bucket(self, bucket) -> None:
        """Adds the bucket's local gradients to the step's sketch (raises on a torch error)."""
        if self.plans_final:
            # Fast path: DDP's buckets are final, and this one's plan is known.
            buf = bucket.buffer()
            entry = self._plans.get(bucket.index())
            if (
                entry is not None
                and entry.plan is not None
                and entry.base == buf.data_ptr()
                and entry.numel == buf.numel()
            ):
                # A bucket's parameters are marked by its first offset: buckets are final, so
                # no other bucket holds that parameter.
                self._note_bucket((entry.layout.global_offsets[0],))
                plan = entry.plan
                self._counters["planned_buckets"] += 1
                if isinstance(plan, SegmentLayout):  # the device path: one launch a bucket
                    self._device_sketch(buf.device).add_segments(buf, plan)
                    self._add_bucket_norms(bucket)
                else:  # one C++ call: the sketch and the per-group norms in one pass
                    self.cpu_sketch.add_plan(plan, entry.base)
                return
        else:
            self.plans_final = buckets_are_final(self._ddp_ref())
        params = bucket.parameters()
        grads = bucket.gradients()
        offsets = [self.offset_of(p) for p in params]
        self._note_bucket([o for o in offsets if o is not None])
        if not grads:
            return
        if self._sketch_backend(grads[0]) == _backend.NATIVE:
            self._add_cpu(offsets, grads)
        else:
            self._add_on_device(offsets, grads)
        if self.plans_final:
            self.bucket_layout(bucket)  # cached with the sketch's plan for the next steps
        self._add_bucket_norms(bucket, offsets, grads)

    def _sketch_backend(self, t) -> str:
        return _backend.sketch(t, self.dim, native=not self.bypass_native).backend

    def bucket_layout(self, bucket):
        """(SegmentLayout, None) of where the bucket's gradients lie, or (None, why it has
        none): cached per bucket once DDP's buckets are final (with the sketch's plan for
        it), computed at each call before that."""
        buf = bucket.buffer()
        entry = self._plans.get(bucket.index()) if self.plans_final else None
        if entry is not None and entry.base == buf.data_ptr() and entry.numel == buf.numel():
            return entry.layout, None
        layout, why = bucket_layout(buf, bucket.parameters(), bucket.gradients(), self.offset_of)
        if layout is not None and self.plans_final:
            plan = self._plan(buf, layout)
            if isinstance(plan, _native.BucketPlan):  # the reduced fingerprint's, too
                layout.native = (plan, buf.dtype)
            self._plans[bucket.index()] = _Bucket(buf.data_ptr(), buf.numel(), layout, plan)
        return layout, why

    def bucket_of_offset(self, offset: int) -> int:
        """The bucket (index into ``bucket_names``) of the parameter holding global coordinate
        ``offset``."""
        return self._param_bucket[bisect.bisect_right(self._param_starts, offset) - 1]

    def _add_bucket_norms(self, bucket, offsets=None, grads=None) -> None:
        """Adds each gradient's squared norm into its parameter group's (a chunk of a parameter,
        as FSDP's, counts for the group of the parameter it starts in)."""
        if not self.bucket_names:
            return
        try:
            if grads is None:
                grads = bucket.gradients()
            cached = self._norm_index.get(bucket.index()) if self.plans_final else None
            if cached is None or cached[0] != len(grads):
                if offsets is None:
                    offsets = [self.offset_of(p) for p in bucket.parameters()]
                keep = [
                    k
                    for k, (o, g) in enumerate(zip(offsets, grads))
                    if o is not None and g.numel() > 0 and not g.is_sparse
                ]
                index = None
                if keep:
                    index = torch.tensor(
                        [self.bucket_of_offset(offsets[k]) for k in keep],
                        dtype=torch.long,
                        device=grads[keep[0]].device,
                    )
                cached = (len(grads), keep, index)
                if self.plans_final:
                    self._norm_index[bucket.index()] = cached
            _, keep, index = cached
            if not keep:
                return
            chosen = [grads[k] for k in keep]
            norms = foreach_norms(chosen, torch.float32)
            acc = self._bucket_sq.get(chosen[0].device)
            if acc is None:
                acc = self._bucket_sq[chosen[0].device] = torch.zeros(
                    len(self.bucket_names), dtype=torch.float32, device=chosen[0].device
                )
            acc.index_add_(0, index, torch.stack(norms).square())
            self._torch_norms = True
        except Exception as e:  # the norms must never cost the sketch
            self._counters["bucket_norm_errors"] += 1
            self._warn_once(
                "bucket_norms",
                f"rankscope: per-bucket gradient norms failed ({e!r}); they are off from now on",
            )
            self.bucket_names = []
            self._bucket_sq = {}

    def bucket_sq(self, device):
        """The step's squared norm per bucket on ``device`` (a tensor), or None. On the CPU it
        includes what the C++ kernel summed for the planned buckets."""
        if not self.bucket_names:
            return None
        t = self._bucket_sq.get(device)
        native = self._native_bucket_sq() if torch.device(device).type == "cpu" else None
        if native is None:
            return t
        native = native.to(torch.float32)
        return native if t is None else t + native

    def _native_bucket_sq(self):
        """The C++ kernel's per-group squared norms of the step (float64, one per bucket
        name), or None when no planned CPU bucket added any."""
        sq = self.cpu_sketch.group_squares()
        if not sq:
            return None
        out = torch.zeros(len(self.bucket_names), dtype=torch.float64)
        out[: len(sq)] = torch.tensor(sq, dtype=torch.float64)
        return out

    def bucket_norms(self) -> list:
        """The step's local gradient norm per bucket, on the host (CPU gradients; a model on a
        device reads them through DeferredReports), or [] when not measured."""
        if not self.bucket_names:
            return []
        if not self._torch_norms:
            # Planned CPU buckets only (the usual step once DDP's buckets are final): the C++
            # kernel's sums as they are, no torch call.
            sq = self.cpu_sketch.group_squares()
            if not sq and not self._bucket_sq:
                return []
            sq = list(sq) + [0.0] * (len(self.bucket_names) - len(sq))
            return [math.sqrt(x) for x in sq]
        total = self._native_bucket_sq()
        for t in self._bucket_sq.values():
            t = t.to("cpu", torch.float64)
            total = t if total is None else total + t
        return total.sqrt().tolist()

    def reset(self) -> None:
        """Empties the sketches and forgets the step's buckets (the next step starts)."""
        self.cpu_sketch.reset()
        for s in self.device_sketches.values():
            s.reset()
        if self._torch_norms:
            for t in self._bucket_sq.values():
                t.zero_()
            self._torch_norms = False
        self.seen_params.clear()
        self.got_grads = False
        self.t_first_hook = None

    def set_dim(self, dim: int) -> None:
        """Switches to a new sketch size (a control message): new, empty sketches."""
        self.dim = dim
        self.cpu_sketch = _native.Sketch(dim, self._seed, self._threads)
        self.device_sketches = {}

    def _note_bucket(self, offsets) -> None:
        """Marks the parameters (by global offset) whose gradients this step has sketched. If
        one comes again, a second synchronized backward ran before mon.step() (accumulation
        without no_sync()): the buckets now hold the newest, accumulated gradient, which is what
        DDP all-reduces, so the sketch starts over."""
        seen = self.seen_params
        if self.restart_on_repeat and any(o in seen for o in offsets):
            self._counters["backward_restarts"] += 1
            self.reset()
            self._on_restart()
        seen.update(offsets)
        self._counters["buckets"] += 1
        if not self.got_grads:
            self.got_grads = True
            self.t_first_hook = time.monotonic()

    def _add_cpu(self, offsets, grads) -> None:
        """The C++ kernel, reading each gradient where it lies (one call, GIL released)."""
        addrs, ns, offs, keep = [], [], [], []
        dtype = grads[0].dtype
        for off, g in zip(offsets, grads):
            if off is None:
                self._unknown_param()
                continue
            n = g.numel()
            if n == 0:
                continue
            if g.is_sparse:
                self._warn_once("sparse", "rankscope: sparse gradients are not sketched")
                continue
            if g.dtype != dtype or g.dtype not in NATIVE_DTYPES:
                # Rare: a dtype the kernel does not read, or a mixed bucket. Convert and add now.
                g = g.to(torch.float32).contiguous()
                err = self.cpu_sketch.add(g.data_ptr(), _native.DTYPE_FLOAT32, n, off)
                if err:
                    self._native_error(err)
                continue
            if not g.is_contiguous():
                g = g.contiguous()
                keep.append(g)
            addrs.append(g.data_ptr())
            ns.append(n)
            offs.append(off)
        if addrs:
            err = self.cpu_sketch.add_many(addrs, ns, offs, NATIVE_DTYPES[dtype])
            if err:
                self._native_error(err)
        del keep

    def _add_on_device(self, offsets, grads) -> None:
        """The device path (DeviceSketch: Triton or torch ops, on the gradient's device): no
        host copy."""
        sketch = self._device_sketch(grads[0].device)
        for off, g in zip(offsets, grads):
            if off is None:
                self._unknown_param()
                continue
            if g.numel() == 0:
                continue
            if g.is_sparse:
                self._warn_once("sparse", "rankscope: sparse gradients are not sketched")
                continue
            sketch.add(g, off)

    def _device_sketch(self, device) -> DeviceSketch:
        sketch = self.device_sketches.get(device)
        if sketch is None:
            sketch = self.device_sketches[device] = DeviceSketch(self.dim, self._seed, device)
        return sketch

    def _plan(self, buf, layout):
        """The sketch's fast-path plan for a final bucket: a BucketPlan for the C++ kernel, the
        layout for a DeviceSketch, or None (a dtype the sketch plans do not take, or no
        gradient in it)."""
        if buf.dtype not in NATIVE_DTYPES or not layout.counts:
            return None
        if self._sketch_backend(buf) != _backend.NATIVE:
            return layout
        size = buf.element_size()
        groups = []
        if self.bucket_names:  # each segment's squares to its parameter group's norm
            groups = [self.bucket_of_offset(o) for o in layout.global_offsets]
        return _native.BucketPlan(
            NATIVE_DTYPES[buf.dtype],
            [s * size for s in layout.starts],
            layout.counts,
            layout.global_offsets,
            groups,
        )

    def _unknown_param(self) -> None:
        self._counters["unknown_parameters"] += 1
        self._warn_once(
            "unknown",
            "rankscope: a bucket holds a parameter that was not among "
            "module.parameters() at attach time; its gradient is not sketched",
        )

    def _native_error(self, err: str) -> None:
        self._counters["sketch_errors"] += 1
        self._warn_once("native", f"rankscope: sketch kernel refused a chunk: {err}")
