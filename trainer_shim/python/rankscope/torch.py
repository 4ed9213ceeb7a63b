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
import functools
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable

# First: one clear ImportError line if torch is missing or older than the supported floor.
from rankscope import _requirements  # noqa: F401
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from rankscope import _native
from rankscope import fingerprint as _fp
from rankscope import tls as _tls
from rankscope._bucket_sketcher import BucketSketcher
from rankscope._control_agreement import ControlAgreement
from rankscope._deferred import DeferredReports, host_loss
from rankscope._replica import ReplicaFingerprints

__all__ = ["attach", "attach_reducer", "Monitor"]

# Default parameter-fingerprint interval, from its measured cost (docs/PERFORMANCE.md, "Replica
# fingerprints"): one check costs 0.28-0.34 % of a CPU step (bench/fingerprint_overhead.py), so
# checking every 5 steps keeps it under 0.1 % of a step (0.07 %) while a diverged replica is named
# at most 4 steps after it diverged (50, the earlier default, took up to 49).
PARAM_CHECK_EVERY = 5


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# At most this many threads sketch a CPU gradient bucket by default (rankscope/striped_sketch.h).
MAX_DEFAULT_SKETCH_THREADS = 8


def default_sketch_threads() -> int:
    """attach's default ``sketch_threads``: ``$RANKSCOPE_SKETCH_THREADS`` if set, else the cores
    this process may run on (its CPU affinity) that torch's intra-op threads leave free, at least
    1 and at most MAX_DEFAULT_SKETCH_THREADS. Raises ValueError on a bad environment value."""
    env = os.environ.get("RANKSCOPE_SKETCH_THREADS", "").strip()
    if env:
        try:
            threads = int(env)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"RANKSCOPE_SKETCH_THREADS must be a whole number >= 1, got {env!r}")
        return threads
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_SKETCH_THREADS, usable - torch.get_num_threads()))


def _group_ranks(pg) -> list:
    """The global ranks a process group spans, sorted; read locally, no communication."""
    if hasattr(dist, "get_process_group_ranks"):  # torch >= 2.0
        return sorted(dist.get_process_group_ranks(pg))
    from torch.distributed import distributed_c10d as c10d

    return sorted(c10d._pg_group_ranks[pg].keys())


def data_parallel_group(pg) -> str:
    """The name rankscope gives a DDP model's process group: "" (the job's only group) when it
    spans every rank of the job, else ``dp<lowest global rank>``, e.g. "dp1" for the odd ranks of
    a job laid out with tensor parallelism 2. Data-parallel groups of one model are disjoint, so
    their lowest ranks tell them apart; every rank of a group derives the same name."""
    if pg is None or dist.get_world_size(pg) == dist.get_world_size():
        return ""
    return f"dp{_group_ranks(pg)[0]}"


# What attach sends when told neither sketch_dim nor sketch_bytes: 4 KiB a rank a step in the
# most accurate encoding for that budget as measured (docs/PERFORMANCE.md "Sketch encodings":
# int8 bins, k = 4,096).
DEFAULT_SKETCH_BYTES = 4096
DEFAULT_SKETCH_ENCODING = "int8"


def sketch_dim_for(sketch_dim: int | None, sketch_bytes: int | None, sketch_encoding: str | None):
    """(k, encoding) from attach's sketch_dim / sketch_bytes / sketch_encoding.

    sketch_dim keeps its meaning from before encodings existed: k float32 bins unless an encoding
    is named. Otherwise k follows from the byte budget (default DEFAULT_SKETCH_BYTES) and the
    encoding (default DEFAULT_SKETCH_ENCODING). Raises ValueError on an unknown encoding, both
    sketch_dim and sketch_bytes, or a budget that is not a whole number of bins."""
    if sketch_encoding is None:
        sketch_encoding = "float32" if sketch_dim is not None else DEFAULT_SKETCH_ENCODING
    per_bin = _native.SKETCH_BYTES_PER_BIN.get(sketch_encoding)
    if per_bin is None:
        raise ValueError(
            f"sketch_encoding must be one of "
            f"{', '.join(_native.SKETCH_BYTES_PER_BIN)}, got {sketch_encoding!r}"
        )
    if sketch_dim is not None:
        if sketch_bytes is not None:
            raise ValueError("give sketch_dim or sketch_bytes, not both")
        return int(sketch_dim), sketch_encoding
    if sketch_bytes is None:
        sketch_bytes = DEFAULT_SKETCH_BYTES
    sketch_bytes = int(sketch_bytes)
    if sketch_bytes < per_bin or sketch_bytes % per_bin != 0:
        raise ValueError(
            f"sketch_bytes {sketch_bytes} is not a positive multiple of "
            f"{per_bin} bytes ({sketch_encoding} bins)"
        )
    return sketch_bytes // per_bin, sketch_encoding


# (collector, job, group, rank) -> the live Monitor of this process that reports it.
_ATTACHED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def attach(
    model: "torch.nn.parallel.DistributedDataParallel",
    collector: str | None = None,
    job: str | None = None,
    sketch_dim: int | None = None,
    every: int = 1,
    dormant: bool | None = None,
    *,
    start_step: int = 0,
    sketch_seed: int = _native.DEFAULT_SKETCH_SEED,
    local_batch_size: int = 0,
    param_check_every: int = PARAM_CHECK_EVERY,
    fingerprints: bool = True,
    comm_hook: Callable | None = None,
    comm_hook_state=None,
    auth_token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_target_name: str | None = None,
    queue_capacity: int = 1024,
    max_unacked: int = 8192,
    warn_after: float = 10.0,
    max_backoff: float = 10.0,
    control_margin: float = 2.0,
    close_timeout: float = 2.0,
    group: str | None = None,
    sketch_bytes: int | None = None,
    sketch_encoding: str | None = None,
    sketch_threads: int | None = None,
) -> "Monitor":
    """Attaches rankscope to a DistributedDataParallel model; call it on every rank at the same
    point of training (before the first step, or after any number of steps).

    Args:
      model: the DDP-wrapped model. No other comm hook may be registered on it (DDP allows one);
        pass your own hook as ``comm_hook`` (with ``comm_hook_state``) and rankscope chains to it
        instead of the default all-reduce.
      collector: ``host:port`` of the collector; default ``$RANKSCOPE_COLLECTOR`` or
        ``127.0.0.1:50051``.
      job: the training job's name; default ``$RANKSCOPE_JOB``. Required.
      sketch_dim: count sketch size k, the number of bins (same on every rank); without
        ``sketch_encoding`` these are float32 bins, as before encodings existed. Give
        ``sketch_dim`` or ``sketch_bytes``, not both.
      sketch_bytes: the sketch's bytes per rank and step instead of ``sketch_dim``: k is
        ``sketch_bytes`` divided by the encoding's bytes per bin (4, 2 or 1), which must divide
        it. Default (neither given): 4,096.
      sketch_encoding: how the bins travel and are kept (same on every rank of a job):
        ``"float32"``, ``"float16"`` (a half per bin and a per-report power-of-two scale) or
        ``"int8"`` (a byte per bin and a per-report scale max|bin|/127, rounded to nearest).
        The same bytes buy 2x or 4x the bins, and the direction error falls like 1/sqrt(k).
        Default: ``"int8"`` (k = 4,096 at the default 4 KiB), the most accurate at that budget
        (docs/PERFORMANCE.md "Sketch encodings"); ``"float32"`` when only ``sketch_dim`` is
        given.
      sketch_threads: threads that sketch a CPU gradient bucket (the backward waits for its
        bucket's sketch, so large CPU gradients, as with CPU training or optimizer offload,
        sketch faster on more cores). The sketch is bit-identical whatever the number
        (rankscope/striped_sketch.h). Default: ``$RANKSCOPE_SKETCH_THREADS``, else the cores
        this process may use that torch's own threads leave free (``torch.get_num_threads()``),
        at least 1 and at most 8. GPU gradients are sketched on the GPU and ignore it.
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
      group: the model's data-parallel group ([A-Za-z0-9_.:-], at most 64 characters). Default:
        derived from the DDP model's process group without any communication ("" when it spans
        the whole job, else ``dp<lowest global rank>``). Ranks are compared only within their
        group; give two models of one process (a GAN's generator and discriminator) distinct
        groups, or distinct job names.
    Returns:
      the Monitor; call ``mon.step(loss)`` once per optimizer step.
    Raises:
      TypeError if ``model`` is not DDP; ValueError on a bad job name or option (a TLS file
      that is missing, not PEM, or a key that does not match its certificate), or when this
      process already reports the same (job, group, rank) for another model; RuntimeError if
      DDP already has a comm hook or torch.distributed is not initialized.
    """
    self_reduced = isinstance(model, _SelfReduced)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) and not self_reduced:
        raise TypeError(
            "rankscope.torch.attach needs a torch.nn.parallel."
            f"DistributedDataParallel model, got {type(model).__name__}"
        )
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
    sketch_dim, sketch_encoding = sketch_dim_for(sketch_dim, sketch_bytes, sketch_encoding)
    if sketch_threads is None:
        sketch_threads = default_sketch_threads()
    if int(sketch_threads) < 1 or int(sketch_threads) > 256:
        raise ValueError(f"sketch_threads must be in [1, 256], got {sketch_threads}")
    group = data_parallel_group(model.process_group) if group is None else str(group)
    key = (collector, job, group, dist.get_rank(model.process_group))
    holder = _ATTACHED.get(key)
    # The same model again is DDP's refusal (one comm hook per model), said below.
    if holder is not None and not holder._closed and holder._model_id != id(model):
        raise ValueError(
            f"rankscope.torch.attach: this process already reports job {job!r} group {group!r} "
            f"rank {key[3]} for another model; the collector would refuse (or mix) the two. "
            "Pass group=... (e.g. group='generator' and group='discriminator') or another job "
            "name to one of them"
        )
    monitor = Monitor(
        model,
        collector=collector,
        job=job,
        group=group,
        sketch_dim=int(sketch_dim),
        sketch_encoding=sketch_encoding,
        sketch_threads=int(sketch_threads),
        every=int(every),
        enabled=not dormant,
        start_step=int(start_step),
        sketch_seed=int(sketch_seed),
        local_batch_size=int(local_batch_size),
        param_check_every=int(param_check_every) if fingerprints else 0,
        fingerprints=bool(fingerprints),
        auth_token=auth_token or "",
        tls_options=_tls.resolve(tls_ca, tls_cert, tls_key, tls_target_name),
        queue_capacity=int(queue_capacity),
        max_unacked=int(max_unacked),
        warn_after=float(warn_after),
        max_backoff=float(max_backoff),
        control_margin=float(control_margin),
        close_timeout=float(close_timeout),
    )
    if self_reduced:  # the trainer hands over its gradients (Monitor.local_gradient)
        _ATTACHED[key] = monitor
        return monitor
    state = _HookState(monitor, comm_hook, comm_hook_state, model.process_group)
    try:
        model.register_comm_hook(state, _rankscope_comm_hook)
    except RuntimeError as e:
        monitor.close(timeout=0)
        raise RuntimeError(
            "rankscope.torch.attach: DDP refused the comm hook (a model takes one hook, "
            "registered once; pass your own hook to attach(comm_hook=...) instead of "
            f"registering it): {e}"
        ) from e
    _ATTACHED[key] = monitor
    return monitor


def attach_reducer(module: torch.nn.Module, process_group=None, **kwargs) -> "Monitor":
    """Attaches rankscope to a trainer that reduces gradients itself (Megatron-core's DDP,
    DeepSpeed, a hand-written bucketed all-reduce): there is no DDP comm hook, so the trainer
    hands the monitor each step's local gradient just before it is reduced and the reduced one
    after, with the same sketch, fingerprint and step semantics as ``attach``::

        mon = rst.attach_reducer(model, process_group=dp_group, job="exp-42")
        for x, y in loader:
            loss = loss_fn(model(x), y); loss.backward()
            flat = flatten_grads(model)           # the buffer the trainer all-reduces
            mon.local_gradient(flat, params)      # before the reduction
            flat.div_(world); dist.all_reduce(flat, group=dp_group)
            mon.reduced_gradient(flat)            # after it (same buffer, or a copy)
            unflatten_into_grads(flat, model); opt.step()
            mon.step(loss)

    ``module`` is the model (its ``named_parameters()`` order fixes the flat index, as for DDP);
    ``process_group`` the data-parallel group the trainer reduces over (default: the whole job).
    Every other argument is ``attach``'s (``comm_hook`` excepted).
    """
    if "comm_hook" in kwargs or "comm_hook_state" in kwargs:
        raise ValueError(
            "attach_reducer: a trainer that reduces gradients itself has no comm hook to chain to"
        )
    return attach(_SelfReduced(module, process_group), **kwargs)


class _SelfReduced:
    """What Monitor needs of a DDP model, for a trainer that reduces gradients itself."""

    def __init__(self, module, process_group):
        self.module = module
        self.process_group = process_group

    def register_forward_pre_hook(self, hook):
        return self.module.register_forward_pre_hook(lambda _m, args: hook(self, args))


class _FlatBucket:
    """A flat gradient buffer and the parameters it holds, back to back in ``params`` order, in
    the shape of DDP's GradBucket (what the sketcher and the replica fingerprints read)."""

    def __init__(self, index, buffer, params):
        self._index = index
        self._buffer = buffer
        self._params = list(params)
        self._grads = []
        offset = 0
        for p in self._params:
            n = p.numel()
            self._grads.append(buffer[offset : offset + n].view(p.shape))
            offset += n
        if offset != buffer.numel():
            raise ValueError(
                f"the gradient buffer has {buffer.numel()} values, its parameters {offset}"
            )

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads


def _flat(gradient) -> torch.Tensor:
    """One flat buffer: the tensor itself, or the concatenation of a list of tensors."""
    if isinstance(gradient, torch.Tensor):
        return gradient.reshape(-1)
    return torch.cat([g.detach().reshape(-1) for g in gradient])


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


def _rankscope_comm_hook(
    state: _HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: sketch the bucket's local gradient, then all-reduce it; once reduced,
    fold the reduced bucket into the step's replica fingerprint (a callback chained on the
    all-reduce's future: it runs when the collective completes, on the tensor's device)."""
    monitor = state.monitor
    if not monitor._active:
        return state.chain(state.chain_state, bucket)
    layout = None
    replica = monitor._replica
    try:
        monitor._add_bucket(bucket)
        if replica.enabled:
            layout = replica.bucket_layout(bucket, monitor._sketcher)
    except Exception as e:  # monitoring must never break training
        monitor._hook_failed(e)
    fut = state.chain(state.chain_state, bucket)
    if layout is None:
        return fut
    return fut.then(lambda f: replica.fold_reduced(f, layout))


class Monitor:
    """One rank's rankscope session; made by ``attach``."""

    def __init__(
        self,
        model,
        *,
        collector,
        job,
        group="",
        sketch_dim,
        every,
        enabled,
        sketch_encoding="float32",
        sketch_threads=1,
        start_step,
        sketch_seed,
        local_batch_size,
        auth_token,
        tls_options=None,
        param_check_every=PARAM_CHECK_EVERY,
        fingerprints=True,
        queue_capacity,
        max_unacked,
        warn_after,
        max_backoff,
        control_margin,
        close_timeout,
    ):
        pg = model.process_group
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.global_rank = dist.get_rank()
        self.job = job
        self.group = group
        self._model_id = id(model)
        self.collector = collector
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._local_batch_size = local_batch_size
        self._warn_after = warn_after
        self._close_timeout = close_timeout

        self._agent = _native.Agent(
            collector=collector,
            job=job,
            rank=self.rank,
            world_size=self.world_size,
            sketch_dim=sketch_dim,
            sketch_seed=sketch_seed,
            attempt=self.attempt,
            framework_version=f"torch {torch.__version__}",
            auth_token=auth_token,
            queue_capacity=queue_capacity,
            max_unacked=max_unacked,
            initial_backoff_s=min(0.1, max_backoff),
            max_backoff_s=max_backoff,
            group=group,
            global_rank=self.global_rank,
            sketch_encoding=sketch_encoding,
            **(tls_options or {}),
        )
        self.sketch_encoding = sketch_encoding
        self.instance_id = self._agent.instance_id()

        self._every = every
        self._enabled = enabled
        self._closed = False
        self._refused = False  # the collector refused this rank for good (stats()["refused"])
        self._pending_layouts = {}  # local_gradient index -> replica layout (attach_reducer)
        self.counters = collections.Counter()
        self._warned = set()
        # The four parts behind the monitor: the hook's sketching and fingerprinting, the
        # reports waiting for device copies, and the ranks' agreement on control steps. They
        # share the counters and the warned keys, and hold no reference to the monitor.
        warn_once = functools.partial(_warn_once, self._warned)
        self._replica = ReplicaFingerprints(
            model, fingerprints, param_check_every, self.counters, warn_once
        )
        self._sketcher = BucketSketcher(
            model,
            sketch_dim,
            sketch_seed,
            self.counters,
            warn_once,
            on_restart=self._replica.reset,
            threads=sketch_threads,
        )
        self.sketch_threads = sketch_threads
        self.num_coordinates = self._sketcher.num_coordinates
        self._deferred = DeferredReports(self._agent, self.counters)
        self._controls = ControlAgreement(
            f"{job}/{group}" if group else job,
            self.attempt,
            self.rank,
            control_margin,
            self.counters,
            warn_once,
        )

        self._step = start_step
        self._t_attach = time.monotonic()
        self._t_step_end = None
        self._step_time_ema = None
        self._health_interval = min(1.0, max(0.05, warn_after / 2))
        self._next_health_check = self._t_attach + self._health_interval

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
        return self._sketcher.dim

    def step(self, loss=None, step: int | None = None, batch_size: int | None = None):
        """Closes one optimizer step. ``loss`` is this rank's local loss (a tensor on any
        device, or a number); ``step`` optionally gives the step's number (and renumbers the
        following ones); ``batch_size`` overrides ``local_batch_size`` for this step. Never
        blocks on I/O or on a device."""
        if self._closed:
            return
        s = self._step if step is None else int(step)
        now = time.monotonic()
        if self._active:
            if self._sketcher.got_grads:
                try:
                    self._emit(s, loss, batch_size)
                except Exception as e:  # monitoring must never break training
                    self.counters["step_errors"] += 1
                    self._warn_once(
                        "emit",
                        f"rankscope: could not report step {s} ({e!r}); training is unaffected",
                    )
            else:
                self.counters["steps_without_gradients"] += 1
                self._warn_once(
                    "nograd",
                    "rankscope: mon.step() was called but no gradient bucket was "
                    "all-reduced since the previous step (no backward, or no_sync() on every "
                    "micro-batch?); nothing is reported for such steps",
                )
        if self._t_step_end is not None:
            dt = now - self._t_step_end
            self._step_time_ema = (
                dt if self._step_time_ema is None else (0.9 * self._step_time_ema + 0.1 * dt)
            )
        self._t_step_end = now
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self._step = s + 1
        if self._deferred:
            self._deferred.drain(self._after_record, block=False)
        self._poll_control()
        if now >= self._next_health_check:
            self._check_health(now)
        self._active = self._decide(self._step)
        if self._active:
            self._begin_step()

    def flush(self, timeout: float = 5.0) -> bool:
        """Hands every pending report to the agent (waiting for device copies) and waits up to
        ``timeout`` seconds until the collector acknowledged them all. True iff it did."""
        self._deferred.drain(self._after_record, block=True)
        return self._agent.flush(float(timeout)) == ""

    def close(self, timeout: float | None = None) -> dict:
        """Stops reporting (the hook stays registered, as DDP cannot remove it, and only
        forwards to the all-reduce), flushes for up to ``timeout`` seconds (default
        ``close_timeout``) and stops the agent. Idempotent. Returns the final stats."""
        if self._closed:
            return self.stats()
        self._active = False
        self._deferred.drain(self._after_record, block=True)
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
        s["shim_pending_device_copies"] = len(self._deferred)
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

    def local_gradient(self, gradient, params, index: int = 0) -> None:
        """For trainers that reduce gradients themselves (``attach_reducer``): this rank's local
        gradient of ``params`` (in that order, back to back), just before it is reduced; one flat
        buffer, or a list of tensors (then copied into one). Several buffers per step (buckets)
        are given distinct ``index`` values. Never raises for a runtime condition."""
        if not self._active:
            return
        try:
            bucket = _FlatBucket(index, _flat(gradient), params)
            self._add_bucket(bucket)
            if self._replica.enabled:
                self._pending_layouts[index] = self._replica.bucket_layout(bucket, self._sketcher)
        except Exception as e:  # monitoring must never break training
            self._hook_failed(e)

    def reduced_gradient(self, gradient, index: int = 0) -> None:
        """The reduced (averaged) gradient of the buffer given to ``local_gradient`` with the same
        ``index``, in the same layout: folded into the step's replica fingerprint."""
        layout = self._pending_layouts.pop(index, None)
        if layout is None:
            return
        fut = torch.futures.Future()
        fut.set_result(_flat(gradient))
        self._replica.fold_reduced(fut, layout)

    def _add_bucket(self, bucket) -> None:
        self._sketcher.add_bucket(bucket)

    @property
    def _cpu_sketch(self):
        """This step's sketch of the CPU gradients (a ``_native.Sketch``)."""
        return self._sketcher.cpu_sketch

    @property
    def _force_torch_sketch(self) -> bool:
        """Tests: sketch and fingerprint CPU tensors with the torch-op path (as on a GPU)
        instead of the C++ kernels."""
        return self._sketcher.force_torch

    @_force_torch_sketch.setter
    def _force_torch_sketch(self, value: bool) -> None:
        self._sketcher.force_torch = bool(value)
        self._replica.force_torch = bool(value)

    def _reset_accumulators(self) -> None:
        self._sketcher.reset()
        self._replica.reset()
        self._pending_layouts.clear()

    def _begin_step(self) -> None:
        if self._sketcher.got_grads or self._sketcher.seen_params:
            self._reset_accumulators()

    def _hook_failed(self, e: Exception) -> None:
        self.counters["hook_errors"] += 1
        self._warn_once(
            "hook",
            f"rankscope: the comm hook failed ({e!r}); this step is not "
            "reported. Training is unaffected.",
        )
        self._sketcher.got_grads = False

    # ---- step side --------------------------------------------------------------------------

    def _decide(self, step: int) -> bool:
        return self._enabled and not self._closed and not self._refused and step % self._every == 0

    def _step_time(self):
        t_first_hook = self._sketcher.t_first_hook
        if t_first_hook is None or self._t_step_end is None:
            return None
        return max(0.0, t_first_hook - self._t_step_end)

    def _emit(self, step: int, loss, batch_size) -> None:
        batch = self._local_batch_size if batch_size is None else int(batch_size)
        step_time = self._step_time()
        loss_on_device = isinstance(loss, torch.Tensor) and loss.device.type != "cpu"
        sketcher = self._sketcher
        if not sketcher.device_sketches and not loss_on_device:
            grad_fp, param_fp, reduced_ss = self._replica.step_values(step, torch.device("cpu"))
            gn = math.sqrt(max(sketcher.cpu_sketch.sum_squares(), 0.0))
            err = self._agent.record_sketch(
                step,
                host_loss(loss),
                gn,
                sketcher.cpu_sketch,
                step_time,
                batch,
                reduced_grad_fingerprint=None if grad_fp is None else _fp.to_uint64(grad_fp),
                param_fingerprint=None if param_fp is None else _fp.to_uint64(param_fp),
                reduced_grad_norm=None
                if reduced_ss is None
                else math.sqrt(max(float(reduced_ss), 0.0)),
                loss_absent=loss is None,
            )
            self._after_record(err)
            return
        self._emit_device(step, loss, step_time, batch)

    def _emit_device(self, step, loss, step_time, batch) -> None:
        sketcher = self._sketcher
        # One device holds the gradient (DDP replicates a module on one device per process).
        device = next(iter(sketcher.device_sketches), None)
        if device is None:
            device = loss.device
        self._deferred.add(
            step,
            device,
            sketcher.device_sketches.get(device),
            sketcher.dim,
            sketcher.cpu_sketch,
            loss,
            lambda: self._replica.step_values(step, device),
            step_time,
            batch,
            self._after_record,
        )

    def _after_record(self, err: str) -> None:
        if not err:
            self.counters["reported"] += 1
            return
        self.counters["record_errors"] += 1
        self._warn_once("record", f"rankscope: the agent refused a report: {err}")

    def _start_at(self, step: int, enabled: bool) -> None:
        """(rankscope._autoattach) Numbers the step about to start ``step`` and switches the
        monitor on or leaves it dormant: called at the forward of the step every rank of the group
        agreed to start at, so that step numbers and the first reported step match across ranks."""
        self._step = int(step)
        self._enabled = bool(enabled)
        self._active = self._decide(self._step)
        if self._active:
            self._begin_step()

    # ---- control ------------------------------------------------------------------------------

    def _poll_control(self) -> None:
        due = self._controls.poll(self._agent.control(), self._step, self._step_time_ema)
        if due is not None:
            enabled, every, dim = due
            self._enabled = enabled
            self._every = every
            if dim and dim != self._sketcher.dim:
                self._sketcher.set_dim(dim)
            self.counters["controls_applied"] += 1

    # ---- health -------------------------------------------------------------------------------

    def _check_health(self, now: float) -> None:
        self._next_health_check = now + self._health_interval
        s = self._agent.stats()
        if s.get("refused"):
            self._warn_once(
                "refused",
                f"rankscope: the collector at {self.collector} refused "
                f"job {self.job} group {self.group!r} rank {self.rank} for good "
                f"({s['last_error']}); this rank stops reporting, training "
                "continues",
            )
            self._active = False
            self._refused = True
            return
        if now - self._t_attach < self._warn_after:
            return
        if not s["connected"]:
            why = f" ({s['last_error']})" if s.get("last_error") else ""
            self._warn_once(
                "down",
                f"rankscope: no connection to the collector at "
                f"{self.collector} for job {self.job} (rank {self.rank}){why}; "
                "training continues, reports are buffered and dropped when "
                "buffers fill",
            )
        if s["dropped"]:
            self._warn_once(
                "dropped",
                f"rankscope: {s['dropped']} reports dropped so far "
                "(collector unreachable longer than the buffers last)",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _warn_once(warned: set, key: str, message: str) -> None:
    """Monitor._warn_once for the monitor's parts: ``warned`` is the monitor's set of keys."""
    if key in warned:
        return
    warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _forward_started(ref):
    """A forward pre-hook: the first step's time runs from the start of its forward (later
    steps' from the end of the previous mon.step)."""

    def hook(module, inputs):
        monitor = ref()
        if monitor is not None and monitor._t_step_end is None:
            monitor._t_step_end = time.monotonic()
        return None

    return hook


def _close_at_exit(ref) -> None:
    monitor = ref()
    if monitor is not None:
        try:
            monitor.close()
        except Exception:
            pass
