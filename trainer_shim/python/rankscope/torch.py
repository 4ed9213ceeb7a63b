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
released. Gradients on another device are sketched there, with the same hash: on a CUDA device by
a fused Triton kernel, else by torch operations (rankscope._device_sketch; rankscope._backend
decides, per tensor, and its docstring has the table); the loss, sketch and norm are copied to
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

Frameworks. ``attach`` also takes an FSDP1 root or an FSDP2 module (and refuses, with one warning
and a stand-in monitor, the modes it cannot watch exactly); their paths are in
rankscope.frameworks, and docs/shim.md "Frameworks" says what each sees, through which hook.

Layout. This module is the public surface (``attach``, ``attach_reducer``, ``Monitor`` and the
option helpers, re-exported); the concepts behind it live in their own modules: ``_options``
(option resolution), ``_ddp_hook`` (the comm hook), ``_adapters`` (self-reduced models, flat
buckets) and ``_monitor`` (``Monitor``).

Thread safety: ``attach`` and ``Monitor`` methods are called from the training thread; the hook
runs on the autograd thread while backward runs, which never overlaps ``mon.step``.
"""

import inspect
import os
import weakref
from collections.abc import Callable

# First: one clear ImportError line if torch is missing or older than the supported floor.
from rankscope import _requirements  # noqa: F401
import torch
import torch.distributed as dist

from rankscope import _native, frameworks
from rankscope import tls as _tls
from rankscope._adapters import SelfReduced
from rankscope._buckets import DEFAULT_MAX_BUCKETS
from rankscope._ddp_hook import HookState, rankscope_comm_hook
from rankscope.frameworks._local_grads import refuse
from rankscope._monitor import Monitor
from rankscope._options import DEFAULT_SKETCH_BYTES as DEFAULT_SKETCH_BYTES
from rankscope._options import DEFAULT_SKETCH_ENCODING as DEFAULT_SKETCH_ENCODING
from rankscope._options import MAX_DEFAULT_SKETCH_THREADS as MAX_DEFAULT_SKETCH_THREADS
from rankscope._options import PARAM_CHECK_EVERY as PARAM_CHECK_EVERY
from rankscope._options import env_flag
from rankscope._options import integrity_every_for, replica_check_for
from rankscope._options import data_parallel_group as data_parallel_group
from rankscope._options import default_sketch_threads as default_sketch_threads
from rankscope._options import sketch_dim_for as sketch_dim_for

__all__ = ["attach", "attach_reducer", "Monitor"]

# (collector, job, group, rank) -> the live Monitor of this process that reports it.
_ATTACHED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


# Long: the public entry point: its documented keywords resolved and checked, then the dispatch to
# one path; the work is in _options, frameworks and _monitor.
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
    integrity_every: int | None = None,
    replica_check: str | None = None,
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
    accumulate_local_grad: bool | None = None,
    max_buckets: int = DEFAULT_MAX_BUCKETS,
) -> "Monitor":
    """Attaches rankscope to a DistributedDataParallel model; call it on every rank at the same
    point of training (before the first step, or after any number of steps).

    Args:
      model: the DDP-wrapped model. No other comm hook may be registered on it (DDP allows one);
        pass your own hook as ``comm_hook`` (with ``comm_hook_state``) and rankscope chains to it
        instead of the default all-reduce. A DeepSpeed engine, a ``transformers.Trainer`` or a
        Lightning ``Trainer``/``LightningModule`` goes to rankscope.frameworks (the same
        options; see docs/shim.md "Frameworks"), which closes the steps itself.
      collector: ``host:port`` of the collector, or a fleet's list (``"a:50051,b:50051"``, or
        one DNS name of several addresses): every rank of the job picks the job's shard by
        rendezvous hashing of ``job`` (docs/deploy.md "A fleet of collectors"); default
        ``$RANKSCOPE_COLLECTOR`` or ``127.0.0.1:50051``.
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
      integrity_every: check the all-reduce itself every N steps (docs/DESIGN.md "Aggregation
        integrity"): on the steps whose number is a multiple of N, one rank of the group
        (rotating: rank (step // N) % world) also sends the count sketch of the reduced
        gradient, and the collector compares it with the mean of the ranks' local sketches,
        naming a dropped, doubled or corrupted contribution. 0 never. Default
        ``$RANKSCOPE_INTEGRITY_EVERY``, else 1 (its cost: docs/PERFORMANCE.md "Aggregation
        integrity"). CPU gradients only for now.
      replica_check: how the collector compares the ranks' replicas (docs/DESIGN.md "Replica
        check: exact or tolerance"): ``"exact"``, the fingerprints bit for bit (reduced
        gradient and parameters); ``"tolerance"``, for replicas a framework or mode does not
        keep bit-identical (ranks on different GPU models, a reduction summed in a different
        order on each rank, a non-deterministic optimizer step): each fingerprint with a float
        summary, compared within a tolerance of a few ulps a value (CPU tensors; a C++ pass
        over the reduced gradient every step, docs/PERFORMANCE.md "Replica tolerance"). Default
        ``$RANKSCOPE_REPLICA_CHECK``, else the path's choice (docs/shim.md's tables; "exact"
        for DDP).
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
      accumulate_local_grad: FSDP1 / FSDP2 only, where the framework reduces every micro-batch
        of a step (gradient accumulation without ``no_sync()`` /
        ``set_requires_gradient_sync(False)``): the step's local gradient norm needs the sum of
        the micro-batches' gradients, which rankscope keeps in float32 (one unsharded copy of
        the gradients per rank). True: from the first step; False: never (such steps are not
        reported); None (default): from the step after the first such step (that one is not
        reported). One reduction a step needs no copy.
      max_buckets: where in the model: the most parameter groups whose local gradient norms
        every report carries (4 bytes each), named from the parameters' names in the hello
        (``layers.20-23.mlp``; docs/shim.md "Where in the model"); 0 sends none.
    Returns:
      the Monitor; call ``mon.step(loss)`` once per optimizer step. For a framework object in a
      mode rankscope cannot watch exactly (FSDP1 HYBRID_SHARD, DDP's python_reducer, a torch
      without what the path reads), a stand-in with the same methods that reports nothing,
      after one warning naming torch's version and the mode: training goes on unwatched.
    Raises:
      TypeError if ``model`` is not DDP or a known framework's object; ValueError on a bad job name or option (a TLS file
      that is missing, not PEM, or a key that does not match its certificate), or when this
      process already reports the same (job, group, rank) for another model; RuntimeError if
      DDP already has a comm hook or torch.distributed is not initialized.
    """
    options = dict(locals())  # attach's arguments, for a framework path
    del options["model"]
    self_reduced = isinstance(model, SelfReduced)
    is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    framework_path = None if is_ddp or self_reduced else frameworks.path_for(model)
    if not is_ddp and not self_reduced and framework_path is None:
        if frameworks.framework_of(model):  # DeepSpeed, Hugging Face, Lightning
            return frameworks.attach(model, **_explicit(options))
        raise TypeError(
            "rankscope.torch.attach needs a torch.nn.parallel.DistributedDataParallel model, "
            "an FSDP1 (FullyShardedDataParallel) root, an FSDP2 (fully_shard) module, a "
            "Megatron-core DistributedDataParallel model, a DeepSpeed engine, a Hugging Face Trainer or a Lightning Trainer/LightningModule, got "
            f"{type(model).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("rankscope.torch.attach: torch.distributed is not initialized")
    if framework_path is not None:
        return framework_path(model, attach, **options)
    if is_ddp and getattr(model, "_use_python_reducer", False):
        return refuse(
            "DDP",
            "python_reducer (torch._dynamo.config.optimize_ddp, for compiled autograd)",
            "DDP calls comm hooks there once per parameter as hook(state, (grad, param)) "
            "inside the compiled backward, where rankscope's sketch kernel cannot run; the "
            "default ddp_optimizer mode keeps the bucket hooks and is watched",
            start_step,
            stacklevel=3,
        )
    collector = collector or os.environ.get("RANKSCOPE_COLLECTOR") or "127.0.0.1:50051"
    job = job or os.environ.get("RANKSCOPE_JOB")
    if not job:
        raise ValueError("rankscope.torch.attach: no job name; pass job= or set RANKSCOPE_JOB")
    if dormant is None:
        dormant = env_flag("RANKSCOPE_DORMANT")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if param_check_every < 0:
        raise ValueError(f"param_check_every must be >= 0, got {param_check_every}")
    integrity_every = integrity_every_for(integrity_every)
    replica_check = replica_check_for(replica_check)
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
        integrity_every=integrity_every,
        replica_check=replica_check,
        auth_token=auth_token or "",
        tls_options=_tls.resolve(tls_ca, tls_cert, tls_key, tls_target_name),
        queue_capacity=int(queue_capacity),
        max_unacked=int(max_unacked),
        warn_after=float(warn_after),
        max_backoff=float(max_backoff),
        control_margin=float(control_margin),
        close_timeout=float(close_timeout),
        max_buckets=int(max_buckets),
    )
    if self_reduced:  # the trainer hands over its gradients (Monitor.local_gradient)
        _ATTACHED[key] = monitor
        return monitor
    state = HookState(monitor, comm_hook, comm_hook_state, model.process_group)
    try:
        model.register_comm_hook(state, rankscope_comm_hook)
    except RuntimeError as e:
        monitor.close(timeout=0)
        raise RuntimeError(
            "rankscope.torch.attach: DDP refused the comm hook (a model takes one hook, "
            "registered once; pass your own hook to attach(comm_hook=...) instead of "
            f"registering it): {e}"
        ) from e
    _ATTACHED[key] = monitor
    return monitor


def _explicit(args: dict) -> dict:
    """attach's keyword arguments that differ from their defaults (for rankscope.frameworks)."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(attach).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {k: v for k, v in args.items() if k in defaults and v is not defaults[k]}


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
    return attach(SelfReduced(module, process_group), **kwargs)
