"""rankscope.torch: the PyTorch trainer shim.

    import rankscope.torch as rst
    mon = rst.attach(ddp_model, collector="127.0.0.1:50051", job="exp-42", sketch_dim=1024)
    for batch in loader:
        loss = ...; loss.backward(); opt.step()
        mon.step(loss)          # once per optimizer step; loss is this rank's local loss
    mon.close()

How it works. ``attach`` registers a DDP communication hook. For each gradient bucket, *before*
the all-reduce, the hook adds every parameter's local gradient into this rank's count sketch at
the parameter's global flat offset (fixed once from ``module.named_parameters()``, identical on
every rank; buckets are rebuilt after the first iteration, so nothing is keyed by bucket index)
and accumulates the exact sum of squares; then it chains to the default all-reduce.
``mon.step(loss)`` closes the step: loss, local gradient norm and sketch go to the C++ agent,
which streams them to the collector from its own thread.

Replica checks. The hook also chains a callback on the all-reduce's future that folds the
*reduced* bucket into an order-independent 64-bit fingerprint and its exact sum of squares
(rankscope.fingerprint); every ``param_check_every`` steps ``mon.step`` fingerprints the
parameters after the optimizer step. Both go with the report (with the reduced gradient's norm,
the rank's step time up to its first hook call, and the local batch size), and the collector
names the ranks whose fingerprints differ from the majority.

Where the work runs. CPU gradients are sketched by the C++ kernel straight from the tensor's
memory (float32, bfloat16, float16; other dtypes are converted to float32 first), with the GIL
released. Gradients on another device are sketched there with torch operations that reproduce
the kernel's hash exactly (rankscope.torch_sketch); the loss, sketch and norm are copied to
pinned host memory without blocking and read at a later ``mon.step`` once a CUDA event says the
copy is done. Nothing on the training thread calls ``.item()`` on a device tensor, synchronizes a
device or runs a collective.

Control. A job may start *dormant* (``dormant=True`` or ``RANKSCOPE_DORMANT=1``): the hook then
only forwards to the all-reduce. ``rankscope ctl enable|disable|set --job J`` makes the
collector push a Control message down every rank's stream; ``mon.step`` polls the agent for it
(a mutex and a tuple, no I/O) and every rank applies it at the same step, so the ranks' sketches
stay comparable. The collector proposes that step (its newest step + lead_steps); because a
dormant job reports no steps, the collector's view may be stale, so the first rank to see a new
control agrees on the step through the job's c10d store (one ``add``/``set`` per control, never
per step) and the others adopt it; see docs/shim.md.

Thread safety: ``attach`` and ``Monitor`` methods are called from the training thread; the hook
runs on the autograd thread while backward runs, which never overlaps ``mon.step``.
"""

import atexit
import collections
import datetime
import math
import os
import time
import warnings
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from rankscope import _native
from rankscope import fingerprint as _fp
from rankscope import tls as _tls
from rankscope.torch_sketch import TorchSketch

__all__ = ["attach", "Monitor"]

_NATIVE_DTYPES = {
    torch.float32: _native.DTYPE_FLOAT32,
    torch.bfloat16: _native.DTYPE_BFLOAT16,
    torch.float16: _native.DTYPE_FLOAT16,
}

# Reports on a device that are waiting for their host copy before the agent gets them.
_MAX_PENDING = 64

# Marks a replica value that travels in a pending report's device payload.
_IN_PAYLOAD = object()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def attach(model: "torch.nn.parallel.DistributedDataParallel",
           collector: Optional[str] = None,
           job: Optional[str] = None,
           sketch_dim: int = _native.DEFAULT_SKETCH_DIM,
           every: int = 1,
           dormant: Optional[bool] = None,
           *,
           start_step: int = 0,
           sketch_seed: int = _native.DEFAULT_SKETCH_SEED,
           local_batch_size: int = 0,
           param_check_every: int = 50,
           fingerprints: bool = True,
           comm_hook: Optional[Callable] = None,
           comm_hook_state=None,
           auth_token: Optional[str] = None,
           tls_ca: Optional[str] = None,
           tls_cert: Optional[str] = None,
           tls_key: Optional[str] = None,
           tls_target_name: Optional[str] = None,
           queue_capacity: int = 1024,
           max_unacked: int = 8192,
           warn_after: float = 10.0,
           max_backoff: float = 10.0,
           control_margin: float = 2.0,
           close_timeout: float = 2.0) -> "Monitor":
    """Attaches rankscope to a DistributedDataParallel model; call it on every rank at the same
    point of training (before the first step, or after any number of steps).

    Args:
      model: the DDP-wrapped model. No other comm hook may be registered on it (DDP allows one);
        pass your own hook as ``comm_hook`` (with ``comm_hook_state``) and rankscope chains to it
        instead of the default all-reduce.
      collector: ``host:port`` of the collector; default ``$RANKSCOPE_COLLECTOR`` or
        ``127.0.0.1:50051``.
      job: the training job's name; default ``$RANKSCOPE_JOB``. Required.
      sketch_dim: count sketch size k (same on every rank).
      every: report every N optimizer steps (the steps whose number is a multiple of N).
      dormant: start switched off (the hook only forwards to the all-reduce) until
        ``rankscope ctl enable``; default ``$RANKSCOPE_DORMANT``.
      start_step: number of the first step ``mon.step`` closes (pass the optimizer's global step
        when attaching late or resuming, so that steps line up with earlier reports).
      sketch_seed: hash seed (same on every rank).
      local_batch_size: samples per rank and step, reported for the noise-scale estimate.
      param_check_every: fingerprint the parameters after the optimizer step every N steps (the
        first reported step at or after each multiple of N, and the first reported step); 0
        never. The collector names the ranks whose parameters differ (replica divergence).
      fingerprints: fingerprint the reduced gradient of every reported step (and the parameters,
        see ``param_check_every``); see rankscope.fingerprint.
      auth_token: the collector's shared token (``--auth_token_file``), if it requires one.
      tls_ca: PEM CA that signs the collector's certificate: connect over TLS. Default
        ``$RANKSCOPE_TLS_CA``; plaintext when no CA, certificate or key is set.
      tls_cert, tls_key: this rank's PEM client certificate and key, for a collector that
        requires mutual TLS (``--tls_client_ca_file``). Default ``$RANKSCOPE_TLS_CERT`` and
        ``$RANKSCOPE_TLS_KEY``.
      tls_target_name: name to verify in the collector's certificate when it differs from the
        host in ``collector``; default ``$RANKSCOPE_TLS_TARGET_NAME``.
      warn_after: seconds without a collector connection before a warning (once).
      max_backoff: longest wait, in seconds, between reconnection attempts.
      control_margin: seconds of steps between the first rank seeing a control message and the
        step it applies at, when the collector's proposed step is too close or past.
      close_timeout: seconds ``close`` (and interpreter exit) waits for unacked reports.
    Returns:
      the Monitor; call ``mon.step(loss)`` once per optimizer step.
    Raises:
      TypeError if ``model`` is not DDP; ValueError on a bad job name or option (a TLS file
      that is missing, not PEM, or a key that does not match its certificate); RuntimeError if
      DDP already has a comm hook or torch.distributed is not initialized.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("rankscope.torch.attach needs a torch.nn.parallel."
                        f"DistributedDataParallel model, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("rankscope.torch.attach: torch.distributed is not initialized")
    collector = collector or os.environ.get("RANKSCOPE_COLLECTOR") or "127.0.0.1:50051"
    job = job or os.environ.get("RANKSCOPE_JOB")
    if not job:
        raise ValueError("rankscope.torch.attach: no job name; pass job= or set RANKSCOPE_JOB")
    if dormant is None:
        dormant = _env_flag("RANKSCOPE_DORMANT")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if param_check_every < 0:
        raise ValueError(f"param_check_every must be >= 0, got {param_check_every}")
    monitor = Monitor(model, collector=collector, job=job, sketch_dim=int(sketch_dim),
                      every=int(every), enabled=not dormant, start_step=int(start_step),
                      sketch_seed=int(sketch_seed), local_batch_size=int(local_batch_size),
                      param_check_every=int(param_check_every) if fingerprints else 0,
                      fingerprints=bool(fingerprints), auth_token=auth_token or "",
                      tls_options=_tls.resolve(tls_ca, tls_cert, tls_key, tls_target_name),
                      queue_capacity=int(queue_capacity),
                      max_unacked=int(max_unacked), warn_after=float(warn_after),
                      max_backoff=float(max_backoff),
                      control_margin=float(control_margin), close_timeout=float(close_timeout))
    state = _HookState(monitor, comm_hook, comm_hook_state, model.process_group)
    try:
        model.register_comm_hook(state, _rankscope_comm_hook)
    except RuntimeError as e:
        monitor.close(timeout=0)
        raise RuntimeError(
            "rankscope.torch.attach: DDP refused the comm hook (a model takes one hook, "
            "registered once; pass your own hook to attach(comm_hook=...) instead of "
            f"registering it): {e}") from e
    return monitor


class _HookState:
    """What the comm hook needs: the monitor and the hook to chain to."""

    __slots__ = ("monitor", "chain", "chain_state")

    def __init__(self, monitor, chain, chain_state, process_group):
        self.monitor = monitor
        if chain is None:
            self.chain = default_hooks.allreduce_hook
            self.chain_state = process_group
        else:
            self.chain = chain
            self.chain_state = chain_state


def _rankscope_comm_hook(state: _HookState,
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: sketch the bucket's local gradient, then all-reduce it; once reduced,
    fold the reduced bucket into the step's replica fingerprint (a callback chained on the
    all-reduce's future: it runs when the collective completes, on the tensor's device)."""
    monitor = state.monitor
    if not monitor._active:
        return state.chain(state.chain_state, bucket)
    layout = None
    try:
        monitor._add_bucket(bucket)
        if monitor._fingerprints:
            layout = monitor._bucket_layout(bucket)
    except Exception as e:  # monitoring must never break training
        monitor._hook_failed(e)
    fut = state.chain(state.chain_state, bucket)
    if layout is None:
        return fut
    return fut.then(lambda f: monitor._fold_reduced(f, layout))


class _Pending:
    """A report whose values are being copied from a device to pinned host memory."""

    __slots__ = ("step", "host", "event", "cpu_bins", "cpu_sum_squares", "loss", "step_time",
                 "batch", "fp_host", "fp_present")

    def __init__(self, step, host, event, cpu_bins, cpu_sum_squares, loss, step_time, batch,
                 fp_host=None, fp_present=(None, None, None)):
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


class Monitor:
    """One rank's rankscope session; made by ``attach``."""

    def __init__(self, model, *, collector, job, sketch_dim, every, enabled, start_step,
                 sketch_seed, local_batch_size, auth_token, tls_options=None,
                 param_check_every=50,
                 fingerprints=True, queue_capacity, max_unacked,
                 warn_after, max_backoff, control_margin, close_timeout):
        pg = model.process_group
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.job = job
        self.collector = collector
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._seed = sketch_seed
        self._local_batch_size = local_batch_size
        self._warn_after = warn_after
        self._control_margin = control_margin
        self._close_timeout = close_timeout

        # Global flat offsets, by parameter, in module order (identical on every rank).
        self._offset_by_id = {}
        self._offset_by_ptr = {}
        total = 0
        for _, p in model.module.named_parameters():
            if not p.requires_grad or id(p) in self._offset_by_id:
                continue
            self._offset_by_id[id(p)] = total
            if p.numel() > 0:
                self._offset_by_ptr[p.data_ptr()] = total
            total += p.numel()
        self.num_coordinates = total
        # Parameter fingerprints: every parameter (frozen ones too), model.parameters() order.
        self._fp_params = []
        self._fp_param_offsets = []
        seen, total = set(), 0
        for p in model.module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            self._fp_params.append(p)
            self._fp_param_offsets.append(total)
            total += p.numel()
        self._fingerprints = fingerprints
        self._param_check_every = param_check_every
        self._last_param_check = None  # step of the last parameter fingerprint
        self._layouts = {}  # bucket index -> (buffer address, numel, SegmentLayout), when final

        self._agent = _native.Agent(
            collector=collector, job=job, rank=self.rank, world_size=self.world_size,
            sketch_dim=sketch_dim, sketch_seed=sketch_seed, attempt=self.attempt,
            framework_version=f"torch {torch.__version__}", auth_token=auth_token,
            queue_capacity=queue_capacity, max_unacked=max_unacked,
            initial_backoff_s=min(0.1, max_backoff), max_backoff_s=max_backoff,
            **(tls_options or {}))

        self._dim = sketch_dim
        self._every = every
        self._enabled = enabled
        self._closed = False
        self._cpu_sketch = _native.Sketch(sketch_dim, sketch_seed)
        self._device_sketches = {}
        self._pending = collections.deque()
        # Tests: sketch and fingerprint CPU tensors with the torch-op path (as on a GPU) instead
        # of the C++ kernels.
        self._force_torch_sketch = False
        # Per bucket index: (buffer address, numel, first offset, BucketPlan), filled only once
        # DDP has rebuilt its buckets (after that, index, buffer and layout stay fixed).
        self._ddp_ref = weakref.ref(model)
        self._plans_final = False
        self._plans = {}

        # Per-step accumulation state (touched by the hook).
        self._got_grads = False
        self._seen_params = set()  # global offsets of the parameters sketched this step
        self._t_first_hook = None
        # Reduced-gradient fingerprint and sum of squares, one 0-d tensor per reduced bucket
        # (appended by future callbacks, possibly on a communication thread: list.append only).
        self._fp_buckets = 0
        self._fp_incomplete = False  # a bucket of this step could not be fingerprinted
        self._grad_fps = []
        self._reduced_ss = []

        self._step = start_step
        self._t_attach = time.monotonic()
        self._t_step_end = None
        self._step_time_ema = None
        self._health_interval = min(1.0, max(0.05, warn_after / 2))
        self._next_health_check = self._t_attach + self._health_interval

        self._control_seen = None
        self._control_pending = None  # (apply_step, enabled, every, sketch_dim, generation)
        self._store = None

        self.counters = collections.Counter()
        self._warned = set()

        self._active = self._decide(self._step)
        # The step time of the first step runs from the start of its forward.
        self._forward_hook = model.register_forward_pre_hook(_forward_started(weakref.ref(self)))
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- public API -------------------------------------------------------------------------

    @property
    def step_number(self) -> int:
        """The number the next ``step()`` call will close."""
        return self._step

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def every(self) -> int:
        return self._every

    @property
    def sketch_dim(self) -> int:
        return self._dim

    def step(self, loss=None, step: Optional[int] = None, batch_size: Optional[int] = None):
        """Closes one optimizer step. ``loss`` is this rank's local loss (a tensor on any
        device, or a number); ``step`` optionally gives the step's number (and renumbers the
        following ones); ``batch_size`` overrides ``local_batch_size`` for this step. Never
        blocks on I/O or on a device."""
        if self._closed:
            return
        s = self._step if step is None else int(step)
        now = time.monotonic()
        if self._active:
            if self._got_grads:
                try:
                    self._emit(s, loss, batch_size)
                except Exception as e:  # monitoring must never break training
                    self.counters["step_errors"] += 1
                    self._warn_once("emit", f"rankscope: could not report step {s} ({e!r}); "
                                    "training is unaffected")
            else:
                self.counters["steps_without_gradients"] += 1
                self._warn_once(
                    "nograd", "rankscope: mon.step() was called but no gradient bucket was "
                    "all-reduced since the previous step (no backward, or no_sync() on every "
                    "micro-batch?); nothing is reported for such steps")
        if self._t_step_end is not None:
            dt = now - self._t_step_end
            self._step_time_ema = dt if self._step_time_ema is None else (
                0.9 * self._step_time_ema + 0.1 * dt)
        self._t_step_end = now
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._step = s + 1
        if self._pending:
            self._drain(block=False)
        self._poll_control()
        if now >= self._next_health_check:
            self._check_health(now)
        self._active = self._decide(self._step)
        if self._active:
            self._begin_step()

    def flush(self, timeout: float = 5.0) -> bool:
        """Hands every pending report to the agent (waiting for device copies) and waits up to
        ``timeout`` seconds until the collector acknowledged them all. True iff it did."""
        self._drain(block=True)
        return self._agent.flush(float(timeout)) == ""

    def close(self, timeout: Optional[float] = None) -> dict:
        """Stops reporting (the hook stays registered, as DDP cannot remove it, and only
        forwards to the all-reduce), flushes for up to ``timeout`` seconds (default
        ``close_timeout``) and stops the agent. Idempotent. Returns the final stats."""
        if self._closed:
            return self.stats()
        self._active = False
        self._drain(block=True)
        self._closed = True
        err = self._agent.close(self._close_timeout if timeout is None else float(timeout))
        if err:
            self.counters["close_unacked"] += 1
        return self.stats()

    def stats(self) -> dict:
        """The agent's counters (recorded, sent, acked, rejected, dropped, invalid, reconnects,
        connected, queued, unacked) plus the shim's own (prefixed ``shim_``)."""
        s = self._agent.stats()
        for k, v in self.counters.items():
            s["shim_" + k] = v
        s["shim_pending_device_copies"] = len(self._pending)
        return s

    def control(self):
        """The newest control message received (generation, apply_at_step, enabled, every,
        sketch_dim), or None."""
        return self._agent.control()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- hook side --------------------------------------------------------------------------

    def _offset_of(self, p):
        off = self._offset_by_id.get(id(p))
        if off is None and p.numel() > 0:
            off = self._offset_by_ptr.get(p.data_ptr())
        return off

    def _add_bucket(self, bucket) -> None:
        if self._plans_final:
            # Fast path: DDP's buckets are final, and this one's plan is known.
            buf = bucket.buffer()
            entry = self._plans.get(bucket.index())
            if entry is not None and entry[0] == buf.data_ptr() and entry[1] == buf.numel():
                self._note_bucket((entry[2],))
                self._cpu_sketch.add_plan(entry[3], entry[0])
                self.counters["planned_buckets"] += 1
                return
        else:
            self._plans_final = _buckets_are_final(self._ddp_ref())
        params = bucket.parameters()
        grads = bucket.gradients()
        offsets = [self._offset_of(p) for p in params]
        self._note_bucket([o for o in offsets if o is not None])
        if not grads:
            return
        if grads[0].device.type == "cpu" and not self._force_torch_sketch:
            self._add_cpu(offsets, grads)
            if self._plans_final:
                self._make_plan(bucket, offsets, grads)
        else:
            self._add_on_device(offsets, grads)

    def _note_bucket(self, offsets) -> None:
        """Marks the parameters (by global offset) whose gradients this step has sketched. If
        one comes again, a second synchronized backward ran before mon.step() (accumulation
        without no_sync()): the buckets now hold the newest, accumulated gradient, which is what
        DDP all-reduces, so the sketch starts over."""
        seen = self._seen_params
        if any(o in seen for o in offsets):
            self.counters["backward_restarts"] += 1
            self._reset_accumulators()
        seen.update(offsets)
        self.counters["buckets"] += 1
        if not self._got_grads:
            self._got_grads = True
            self._t_first_hook = time.monotonic()

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
            if g.dtype != dtype or g.dtype not in _NATIVE_DTYPES:
                # Rare: a dtype the kernel does not read, or a mixed bucket. Convert and add now.
                g = g.to(torch.float32).contiguous()
                err = self._cpu_sketch.add(g.data_ptr(), _native.DTYPE_FLOAT32, n, off)
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
            err = self._cpu_sketch.add_many(addrs, ns, offs, _NATIVE_DTYPES[dtype])
            if err:
                self._native_error(err)
        del keep

    def _add_on_device(self, offsets, grads) -> None:
        """Torch ops on the gradient's device (rankscope.torch_sketch): no host copy."""
        device = grads[0].device
        sketch = self._device_sketches.get(device)
        if sketch is None:
            sketch = TorchSketch(self._dim, self._seed, device)
            self._device_sketches[device] = sketch
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

    def _make_plan(self, bucket, offsets, grads) -> None:
        """Caches where this bucket's gradients lie in its buffer, once DDP no longer rebuilds
        its buckets, if every gradient is a dense block of one kernel dtype in the buffer."""
        buf = bucket.buffer()
        base, dtype = buf.data_ptr(), buf.dtype
        if dtype not in _NATIVE_DTYPES or buf.is_sparse:
            return
        end = base + buf.numel() * buf.element_size()
        byte_offsets, counts, global_offsets = [], [], []
        for off, g in zip(offsets, grads):
            n = g.numel()
            if n == 0:
                continue
            if off is None or g.dtype != dtype or not g.is_contiguous():
                return
            start = g.data_ptr()
            if start < base or start + n * g.element_size() > end:
                return
            byte_offsets.append(start - base)
            counts.append(n)
            global_offsets.append(off)
        if not counts:
            return
        plan = _native.BucketPlan(_NATIVE_DTYPES[dtype], byte_offsets, counts, global_offsets)
        # A bucket's parameters are marked by its first offset on the fast path: buckets are
        # final, so no other bucket holds that parameter.
        self._plans[bucket.index()] = (base, buf.numel(), global_offsets[0], plan)

    def _reset_accumulators(self) -> None:
        self._cpu_sketch.reset()
        for s in self._device_sketches.values():
            s.reset()
        self._seen_params.clear()
        self._got_grads = False
        self._t_first_hook = None
        self._fp_buckets = 0
        self._fp_incomplete = False  # a bucket of this step could not be fingerprinted
        self._grad_fps = []
        self._reduced_ss = []

    # ---- replica fingerprints -----------------------------------------------------------------

    def _bucket_layout(self, bucket):
        """Where this bucket's parameters lie in its buffer and in the global flat vector (a
        SegmentLayout), or None when the buffer cannot be folded (counted). Cached per bucket
        once DDP's buckets are final."""
        buf = bucket.buffer()
        entry = self._layouts.get(bucket.index()) if self._plans_final else None
        if entry is not None and entry[0] == buf.data_ptr() and entry[1] == buf.numel():
            self._fp_buckets += 1
            return entry[2]
        if not _fp.supported(buf.dtype) or buf.is_sparse:
            self._fp_skipped(f"a {buf.dtype} gradient bucket")
            return None
        base, size = buf.data_ptr(), buf.element_size()
        starts, counts, offsets = [], [], []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            n = g.numel()
            if n == 0:
                continue
            off = self._offset_of(p)
            delta = g.data_ptr() - base
            if (off is None or g.dtype != buf.dtype or not g.is_contiguous() or delta % size
                    or delta < 0 or delta // size + n > buf.numel()):
                self._fp_skipped("a gradient that is not a dense view of its bucket")
                return None
            starts.append(delta // size)
            counts.append(n)
            offsets.append(off)
        layout = _fp.SegmentLayout(buf.numel(), starts, counts, offsets)
        if self._plans_final:
            self._layouts[bucket.index()] = (base, buf.numel(), layout)
        self._fp_buckets += 1
        return layout

    def _fold_reduced(self, fut, layout):
        """Future callback (after the all-reduce): folds the reduced bucket into the step's
        fingerprint and sum of squares on its device, and passes the value on unchanged."""
        value = fut.value()
        try:
            t = value[0] if isinstance(value, (list, tuple)) else value
            flat = t.detach().reshape(-1)
            if _fp.native_supported(flat) and not self._force_torch_sketch:  # C++: one pass
                f, ss = _fp.fold_segments_cpu(flat, layout)
                self._grad_fps.append(f)
                self._reduced_ss.append(ss)
            else:  # torch ops on the device, no synchronization
                self._grad_fps.append(_fp.fold_segments(flat, layout))
                norm = torch.linalg.vector_norm(flat, 2, dtype=torch.float64)
                self._reduced_ss.append(norm * norm)
        except Exception as e:  # monitoring must never break training
            self.counters["fingerprint_errors"] += 1
            self._warn_once("fperr", f"rankscope: could not fingerprint a reduced bucket ({e!r})")
        return value

    def _fp_skipped(self, what: str) -> None:
        self._fp_incomplete = True
        self.counters["fingerprint_skipped_buckets"] += 1
        self._warn_once("fpskip", f"rankscope: {what} cannot be fingerprinted; the reduced "
                        "gradient's replica check is off for such steps")

    def _param_check_due(self, step: int) -> bool:
        every = self._param_check_every
        if not every:
            return False
        last = self._last_param_check
        return last is None or step // every > last // every or step < last

    def _step_fingerprints(self, step: int, device):
        """(grad fingerprint, param fingerprint, reduced sum of squares) of the step being
        closed: Python numbers when computed on the host (CPU tensors), 0-d tensors on
        ``device`` otherwise, None when not sent. No synchronization."""
        grad_fp = reduced_ss = param_fp = None
        if (self._fingerprints and self._fp_buckets and not self._fp_incomplete
                and len(self._grad_fps) == self._fp_buckets):
            grad_fp = _fp.add_all(self._grad_fps, device)
            sss = self._reduced_ss
            if all(isinstance(v, float) for v in sss):
                reduced_ss = sum(sss)
            else:
                reduced_ss = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device)
                                          for v in sss]).sum()
        if self._param_check_due(step):
            try:
                parts = []
                with torch.no_grad():
                    for p, off in zip(self._fp_params, self._fp_param_offsets):
                        if _fp.native_supported(p) and not self._force_torch_sketch:
                            parts.append(_fp.fold_cpu(p, off)[0])
                        elif _fp.supported(p.dtype):
                            parts.append(_fp.fold(p, off))
                param_fp = _fp.add_all(parts, device) if parts else 0
                self._last_param_check = step
                self.counters["param_checks"] += 1
            except Exception as e:
                self.counters["fingerprint_errors"] += 1
                self._warn_once("fpparam", f"rankscope: could not fingerprint the parameters "
                                f"({e!r})")
        return grad_fp, param_fp, reduced_ss

    def _begin_step(self) -> None:
        if self._got_grads or self._seen_params:
            self._reset_accumulators()

    def _hook_failed(self, e: Exception) -> None:
        self.counters["hook_errors"] += 1
        self._warn_once("hook", f"rankscope: the comm hook failed ({e!r}); this step is not "
                        "reported. Training is unaffected.")
        self._got_grads = False

    def _unknown_param(self) -> None:
        self.counters["unknown_parameters"] += 1
        self._warn_once("unknown", "rankscope: a bucket holds a parameter that was not among "
                        "module.parameters() at attach time; its gradient is not sketched")

    def _native_error(self, err: str) -> None:
        self.counters["sketch_errors"] += 1
        self._warn_once("native", f"rankscope: sketch kernel refused a chunk: {err}")

    # ---- step side --------------------------------------------------------------------------

    def _decide(self, step: int) -> bool:
        return self._enabled and not self._closed and step % self._every == 0

    def _step_time(self):
        if self._t_first_hook is None or self._t_step_end is None:
            return None
        return max(0.0, self._t_first_hook - self._t_step_end)

    def _emit(self, step: int, loss, batch_size) -> None:
        batch = self._local_batch_size if batch_size is None else int(batch_size)
        step_time = self._step_time()
        loss_on_device = isinstance(loss, torch.Tensor) and loss.device.type != "cpu"
        if not self._device_sketches and not loss_on_device:
            grad_fp, param_fp, reduced_ss = self._step_fingerprints(step, torch.device("cpu"))
            gn = math.sqrt(max(self._cpu_sketch.sum_squares(), 0.0))
            err = self._agent.record_sketch(
                step, _host_loss(loss), gn, self._cpu_sketch, step_time, batch,
                reduced_grad_fingerprint=None if grad_fp is None else _fp.to_uint64(grad_fp),
                param_fingerprint=None if param_fp is None else _fp.to_uint64(param_fp),
                reduced_grad_norm=None if reduced_ss is None else math.sqrt(
                    max(float(reduced_ss), 0.0)))
            self._after_record(err)
            return
        self._emit_device(step, loss, step_time, batch)

    def _emit_device(self, step, loss, step_time, batch) -> None:
        # One device holds the gradient (DDP replicates a module on one device per process).
        device = next(iter(self._device_sketches), None)
        if device is None:
            device = loss.device
        payload = torch.empty(self._dim + 2, dtype=torch.float64, device=device)
        sketch = self._device_sketches.get(device)
        if sketch is not None:
            payload[:self._dim].copy_(sketch.bins)
            payload[self._dim].copy_(sketch.sum_squares)
        else:
            payload[:self._dim + 1].zero_()
        host_loss = None
        if isinstance(loss, torch.Tensor) and loss.device == device:
            payload[self._dim + 1].copy_(loss.detach().reshape(()))
        else:
            host_loss = _host_loss(loss)
        cpu_bins, cpu_ss = None, 0.0
        if self._cpu_sketch.sum_squares() != 0.0:  # a model split across CPU and a device
            cpu_bins = torch.empty(self._dim, dtype=torch.float64)
            self._cpu_sketch.copy_bins_to(cpu_bins.data_ptr())
            cpu_ss = self._cpu_sketch.sum_squares()
        values = self._step_fingerprints(step, device)
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
        if device.type == "cuda":
            host = torch.empty(self._dim + 2, dtype=torch.float64, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            fp_host = None
            if fp_payload is not None:
                fp_host = torch.empty(3, dtype=torch.int64, pin_memory=True)
                fp_host.copy_(fp_payload, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # no portable event: copied when drained (a later step), which waits there
            host, fp_host, event = payload, fp_payload, None
        self._pending.append(
            _Pending(step, host, event, cpu_bins, cpu_ss, host_loss, step_time, batch,
                     fp_host, present))
        if len(self._pending) > _MAX_PENDING:
            self.counters["pending_overflow_waits"] += 1
            self._drain(block=True, limit=1)

    def _drain(self, block: bool, limit: Optional[int] = None) -> None:
        done = 0
        while self._pending and (limit is None or done < limit):
            p = self._pending[0]
            if p.event is not None:
                if not block and not p.event.query():
                    return
                p.event.synchronize()
            host = p.host if p.event is not None else p.host.to("cpu")
            dim = host.numel() - 2  # the sketch_dim of its step (a control may have changed it)
            bins = host[:dim]
            ss = float(host[dim]) + p.cpu_sum_squares
            if p.cpu_bins is not None:
                bins = bins + p.cpu_bins
            loss = float(host[dim + 1]) if p.loss is None else p.loss
            floats = bins.to(torch.float32).contiguous()
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
            err = self._agent.record_raw(p.step, loss, math.sqrt(max(ss, 0.0)),
                                         floats.data_ptr(), floats.numel(), p.step_time, p.batch,
                                         reduced_grad_fingerprint=fps[0],
                                         param_fingerprint=fps[1], reduced_grad_norm=fps[2])
            self._after_record(err)
            self._pending.popleft()
            done += 1

    def _after_record(self, err: str) -> None:
        if not err:
            self.counters["reported"] += 1
            return
        self.counters["record_errors"] += 1
        self._warn_once("record", f"rankscope: the agent refused a report: {err}")

    # ---- control ------------------------------------------------------------------------------

    def _poll_control(self) -> None:
        c = self._agent.control()
        if c is not None and c != self._control_seen:
            self._control_seen = c
            generation, apply_at, enabled, every, dim = c
            agreed = self._agree_apply_step(c)
            if agreed < self._step:
                # This rank saw the control after the agreed step: it applies now, and the steps
                # in between differ from the other ranks' (they show up as missing ranks).
                self.counters["late_controls"] += 1
                self._warn_once(
                    f"late{generation}", f"rankscope: control generation {generation} was agreed "
                    f"for step {agreed} but reached rank {self.rank} at step {self._step}")
            self._control_pending = (agreed, bool(enabled), max(1, int(every)), int(dim),
                                     generation)
        pending = self._control_pending
        if pending is not None and self._step >= pending[0]:
            _, enabled, every, dim, _ = pending
            self._control_pending = None
            self._enabled = enabled
            self._every = every
            if dim and dim != self._dim:
                self._set_dim(dim)
            self.counters["controls_applied"] += 1

    def _margin_steps(self) -> int:
        if not self._step_time_ema:
            return 10
        return int(min(100_000, max(2, math.ceil(self._control_margin / self._step_time_ema))))

    def _agree_apply_step(self, control) -> int:
        """The step every rank applies ``control`` at: the collector's apply_at_step if it is
        still ahead of this rank, else a step ``control_margin`` seconds ahead. The first rank to
        see the control decides and publishes it in the c10d store; the others adopt it."""
        generation, apply_at, enabled, every, dim = control
        proposal = max(int(apply_at), self._step + self._margin_steps())
        store = self._get_store()
        if store is None:
            return proposal
        key = (f"rankscope/ctl/{self.job}/{self.attempt}/{generation}/{apply_at}/"
               f"{int(bool(enabled))}/{every}/{dim}")
        try:
            if store.add(key + "/n", 1) == 1:
                store.set(key, str(proposal))
                return proposal
            store.wait([key], datetime.timedelta(seconds=10))
            return int(store.get(key))
        except Exception as e:  # a store problem must not stop training
            self.counters["store_errors"] += 1
            self._warn_once("store", f"rankscope: could not agree on a control step through "
                            f"the c10d store ({e!r}); using step {proposal}")
            return proposal

    def _get_store(self):
        if self._store is None:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:
                self._store = False
        return self._store or None

    def _set_dim(self, dim: int) -> None:
        self._dim = dim
        self._cpu_sketch = _native.Sketch(dim, self._seed)
        self._device_sketches = {}

    # ---- health -------------------------------------------------------------------------------

    def _check_health(self, now: float) -> None:
        self._next_health_check = now + self._health_interval
        if now - self._t_attach < self._warn_after:
            return
        s = self._agent.stats()
        if not s["connected"]:
            why = f" ({s['last_error']})" if s.get("last_error") else ""
            self._warn_once("down", f"rankscope: no connection to the collector at "
                            f"{self.collector} for job {self.job} (rank {self.rank}){why}; "
                            "training continues, reports are buffered and dropped when "
                            "buffers fill")
        if s["dropped"]:
            self._warn_once("dropped", f"rankscope: {s['dropped']} reports dropped so far "
                            "(collector unreachable longer than the buffers last)")

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _buckets_are_final(ddp) -> bool:
    """True once DDP will not rebuild its buckets any more: it rebuilt them (after the first
    iteration), or it never will (find_unused_parameters without static_graph)."""
    if ddp is None:
        return False
    if getattr(ddp, "_has_rebuilt_buckets", False):
        return True
    return bool(getattr(ddp, "find_unused_parameters", False)) and not getattr(
        ddp, "static_graph", False)


def _forward_started(ref):
    """A forward pre-hook: the first step's time runs from the start of its forward (later
    steps' from the end of the previous mon.step)."""

    def hook(module, inputs):
        monitor = ref()
        if monitor is not None and monitor._t_step_end is None:
            monitor._t_step_end = time.monotonic()
        return None

    return hook


def _host_loss(loss) -> float:
    if loss is None:
        return float("nan")
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().reshape(()))  # a CPU tensor: no device synchronization
    return float(loss)


def _close_at_exit(ref) -> None:
    monitor = ref()
    if monitor is not None:
        try:
            monitor.close()
        except Exception:
            pass
