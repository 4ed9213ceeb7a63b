"""Megatron-core's DistributedDataParallel: each rank's local gradient before Megatron reduces it.

Where it is seen. Megatron's DDP adds every parameter's ``.grad`` into ``param.main_grad``, a view
into a contiguous gradient buffer split into buckets; the buckets of a
``_ParamAndGradBucketGroup`` are reduced by ``start_grad_sync`` (an all-reduce, or a
reduce-scatter with the distributed optimizer), which first scales ``bucket.grad_data`` in place by
``gradient_scaling_factor`` (1/dp unless the collective averages) and then issues the collective.
rankscope wraps ``start_grad_sync`` on each bucket group of the model: on entry (before the
scaling, where Megatron's own ``check_grads`` reads the local norm) every parameter's ``main_grad``
holds this rank's local gradient summed over the step's micro-batches, each of the loss the script
backpropagated (``loss / num_microbatches`` in Megatron's schedules), in the buffer's dtype
(``grad_reduce_in_fp32``), unscaled; rankscope sketches it and calls Megatron's own. Megatron
reduces once a step (on the last micro-batch with ``overlap_grad_reduce``, else in
``finish_grad_sync``, which ``finalize_model_grads`` calls), so the step's norm is exact without a
copy. The reduction is Megatron's, untouched: training is bit-identical.

Steps: ``mon.step(loss)`` after the optimizer step, as with DDP. ``finalize_model_grads`` ends
the reduction; nothing rankscope sends needs to wait for it.

Modes and what is compared: each rank's local loss, gradient norm and sketch, across the model's
data-parallel group (the group ``start_grad_sync`` reduces over: the bucket groups'
``data_parallel_group``, or ``intra_distributed_optimizer_instance_group`` with the distributed
optimizer). Replica fingerprints: without
the distributed optimizer every rank holds every parameter whole and equal, so the parameter
fingerprints (every ``param_check_every`` steps) are sent and compared across the group; with it
(ranks step different shards, then all-gather, possibly during the next forward) none are sent.
The reduced gradient's fingerprint is not sent.

Overlapped reduction (``overlap_grad_reduce=True``): Megatron's backward post-hook on each
parameter calls ``register_grad_ready``; once every parameter of a bucket group is ready on the
last micro-batch (the others run under ``model.no_sync()``), it calls the group's
``start_grad_sync``, which issues an asynchronous collective, and ``finish_grad_sync`` (from
``finalize_model_grads``) waits on it. The first step calls ``start_grad_sync`` from
``finish_grad_sync`` instead (Megatron learns the ready counts then). Either way the wrapped
``start_grad_sync`` is where each bucket group's local gradient is read, now on the autograd
thread while backward runs, one bucket group at a time; nothing else changes. Runs on the CPU
with gloo (tests/python/test_frameworks_megatron.py).

Aggregation integrity (rankscope._integrity), all-reduce mode: once a bucket group's
``finish_grad_sync`` returns, its buckets' ``grad_data`` hold the reduced gradient, the mean of
the ranks' local gradients (scaled by 1/dp then summed, or averaged by the collective), on every
rank. On the steps this rank checks, the wrapped ``finish_grad_sync`` adds each bucket's
``grad_data`` (its parameters' segments, at their flat offsets) to the step's reduced sketch, in
the buffer's dtype. A bucket group whose reduction was already waited on this step (Megatron's
``finish_grad_sync`` is then a no-op) is not added again; one reduced twice in a step leaves the
step unchecked (``integrity_repeated_reductions``). Not checked (``integrity_unsupported`` says
why): the distributed optimizer (reduce-scatter: each rank keeps only its shard of the reduced
gradient) and a reduction that is not the mean (``calculate_per_token_loss``: a sum).

Refused (one warning naming megatron-core's version and the mode, training unwatched): a version
outside ``SUPPORTED`` or without the attributes read, fp16 models (``TransformerConfig.fp16``:
Megatron's schedules backpropagate the loss times the optimizer's loss scale, so the buffers hold
scaled gradients), expert-parallel buffers (MoE experts reduce over another group), several
distributed-optimizer instances, and bucket groups that reduce over different process groups.
Stopped at the model's first reduction (one warning naming the version, mode and optimizer;
nothing reported from then on): a Megatron optimizer with a grad scaler (bf16 with
``loss_scale``) stepping the model's main parameters, which the model alone does not show; found
by one heap walk on the autograd thread, only when the model's parameters have Megatron main
parameters (a mixed-precision optimizer was built before that reduction).

Versions: read in megatron-core 0.19.2 (``_ParamAndGradBucketGroup.start_grad_sync``,
``finish_grad_sync``, ``is_first_batch``, ``grad_reduce_handle``, ``grad_reduce_finished``,
``buckets[i].params_list``, ``.grad_data``, ``.param_to_index``, ``.gradient_scaling_factor``,
``param.main_grad``).
"""

import gc
import sys
import warnings

import torch

from rankscope.fingerprint import SegmentLayout
from rankscope._options import replica_check_for
from rankscope.frameworks._local_grads import (
    FrameworkModel,
    ParamTable,
    StepGradients,
    refuse,
    wrap_retargetable,
)

WHAT = "Megatron-core DistributedDataParallel"
SUPPORTED = ((0, 19),)  # (major, minor) read and tested


def _version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:
        return "unknown"


def is_megatron_ddp(model) -> bool:
    for cls in type(model).__mro__:
        if cls.__name__ == "DistributedDataParallel" and (
            getattr(cls, "__module__", "") or ""
        ).startswith("megatron.core.distributed"):
            return True
    return False


def _refuse(mode: str, why: str, start_step: int):
    return refuse(f"{WHAT} (megatron-core {_version()})", mode, why, start_step)


def _group_attribute(distopt: bool) -> str:
    """The bucket group's attribute naming the group start_grad_sync reduces over (its
    ``communication_group``)."""
    return "intra_distributed_optimizer_instance_group" if distopt else "data_parallel_group"


def _missing(model, distopt: bool) -> str:
    """What this megatron-core lacks of what the path reads, or ""."""
    for name in ("bucket_groups", "expert_parallel_bucket_groups", "ddp_config", "module"):
        if not hasattr(model, name):
            return f"DistributedDataParallel.{name}"
    for g in model.bucket_groups:
        for name in ("start_grad_sync", "is_first_batch", "grad_reduce_handle", "buckets"):
            if not hasattr(g, name):
                return f"_ParamAndGradBucketGroup.{name}"
        if not hasattr(g, _group_attribute(distopt)):
            return f"_ParamAndGradBucketGroup.{_group_attribute(distopt)}"
        for b in g.buckets:
            if not hasattr(b, "params_list"):
                return "_ParamAndGradBucket.params_list"
            for p in b.params_list:
                if getattr(p, "main_grad", None) is None:
                    return "param.main_grad"
    return ""


def attach_megatron(model, attach_monitor, *, accumulate_local_grad=None, start_step=0, **options):
    """``rankscope.torch.attach`` for a Megatron-core DDP model: the Monitor, or an ``Unwatched``
    stand-in (warned) where this version or mode cannot be watched exactly."""
    if options.pop("comm_hook", None) is not None or options.pop("comm_hook_state", None):
        raise ValueError("attach: Megatron-core DDP has no comm hook to chain to")
    version = _version()
    cfg = getattr(model, "ddp_config", None)
    distopt = bool(getattr(cfg, "use_distributed_optimizer", False))
    mode = "distributed optimizer" if distopt else "all-reduce"
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    if major_minor not in SUPPORTED:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        return _refuse(mode, f"only megatron-core {supported} is read and tested", start_step)
    if bool(getattr(getattr(model, "config", None), "fp16", False)):
        return _refuse(
            "fp16 " + mode,
            "Megatron's gradient buffers hold the local gradient times the optimizer's loss "
            "scale, which the model does not know",
            start_step,
        )
    missing = _missing(model, distopt)
    if missing:
        return _refuse(mode, f"this megatron-core has no {missing}", start_step)
    if model.expert_parallel_bucket_groups:
        return _refuse(
            mode, "expert-parallel parameters reduce over another group than the rest", start_step
        )
    if distopt and int(getattr(cfg, "num_distributed_optimizer_instances", 1)) > 1:
        return _refuse(mode, "several distributed-optimizer instances", start_step)
    attr = _group_attribute(distopt)
    groups = {id(getattr(g, attr)): getattr(g, attr) for g in model.bucket_groups}
    if len(groups) != 1:
        return _refuse(mode, "its bucket groups reduce over different process groups", start_step)
    (pg,) = groups.values()
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
    replicas = None
    if not distopt and options.get("fingerprints", True):
        replicas = [p for _, p in named]
    table = ParamTable(((n, p.shape) for n, p in named), replicas)
    spec_by_param = {id(p): s for (_, p), s in zip(named, table.specs)}
    for g in model.bucket_groups:
        for b in g.buckets:
            for p in b.params_list:
                if id(p) not in spec_by_param:
                    return _refuse(
                        mode, "a bucket's parameter is not among the model's", start_step
                    )
    options["fingerprints"] = replicas is not None
    # All-reduce mode steps every rank alike on the reduced gradient: exact (docs/shim.md).
    options["replica_check"] = replica_check_for(options.get("replica_check"), "exact")
    # Megatron reduces once a step: the step's norm is exact without a copy (keep=False: a
    # parameter reduced twice in a step is not reported, never mis-summed).
    monitor = attach_monitor(FrameworkModel(model, table, pg), start_step=start_step, **options)
    grads = _MegatronGradients(monitor, bool(accumulate_local_grad), model, mode)
    monitor.local_grads = grads
    monitor.framework = f"megatron-core {version} ddp"
    monitor.framework_mode = f"Megatron DDP {mode}"
    for g in model.bucket_groups:
        _wrap(g, grads, spec_by_param)
    # The aggregation check: the reduced gradient is whole in grad_data after finish_grad_sync.
    monitor.integrity_unsupported = _integrity_unsupported(model, distopt, pg)
    if monitor.integrity_unsupported:
        monitor._replica.integrity.disable()
    else:
        for g in model.bucket_groups:
            _wrap_finish(g, monitor, spec_by_param)
    return monitor


def _integrity_unsupported(model, distopt: bool, pg) -> str:
    """Why the aggregation check cannot read this model's reduced gradient whole as the mean of
    the ranks' local gradients ("" when it can: all-reduce mode, averaged)."""
    if distopt:
        return "the distributed optimizer reduce-scatters: each rank keeps only its shard"
    average = bool(getattr(model.ddp_config, "average_in_collective", False))
    world = pg.size() if hasattr(pg, "size") else torch.distributed.get_world_size(pg)
    for g in model.bucket_groups:
        if not hasattr(g, "finish_grad_sync") or not hasattr(g, "grad_reduce_finished"):
            return "this megatron-core has no _ParamAndGradBucketGroup.finish_grad_sync"
        for b in g.buckets:
            if not hasattr(b, "grad_data") or not hasattr(b, "param_to_index"):
                return "this megatron-core has no _ParamAndGradBucket.grad_data/param_to_index"
            factor = float(getattr(b, "gradient_scaling_factor", 0.0))
            scaled = factor if average else factor * world  # 1 when the result is the mean
            if abs(scaled - 1.0) > 1e-9:
                return f"the reduction is not the mean (gradient_scaling_factor {factor})"
    return ""


def _bucket_layout(bucket, spec_by_param) -> SegmentLayout:
    """Where the bucket's parameters lie in its ``grad_data``, at their global flat offsets."""
    starts, counts, offsets = [], [], []
    for p in bucket.params_list:
        start, end = bucket.param_to_index[p]
        starts.append(start)
        counts.append(end - start)
        offsets.append(spec_by_param[id(p)].offset)
    return SegmentLayout(bucket.grad_data.numel(), starts, counts, offsets)


def _wrap_finish(bucket_group, monitor, spec_by_param: dict) -> None:
    """Wraps the bucket group's finish_grad_sync once (a later attach retargets it): after
    Megatron's, on the steps this rank checks, each bucket's reduced grad_data into the step's
    reduced sketch."""
    layouts = [(b, _bucket_layout(b, spec_by_param)) for b in bucket_group.buckets]

    def make(current, target):
        def finish_grad_sync(*args, **kwargs):
            mon, buckets = target[0]
            # Overlapped: a second call in the step waits on nothing and reduces nothing.
            waited = bool(bucket_group.ddp_config.overlap_grad_reduce) and bool(
                bucket_group.grad_reduce_finished
            )
            out = current(*args, **kwargs)
            integrity = mon._replica.integrity
            if mon._active and integrity.due and not waited:
                try:
                    for b, layout in buckets:
                        integrity.add(b.grad_data.detach(), layout, key=id(b))
                except Exception:  # monitoring must never break training; the step unchecked
                    integrity.fail()
            return out

        return finish_grad_sync

    wrap_retargetable(bucket_group, "finish_grad_sync", (monitor, layouts), make)


class _MegatronGradients(StepGradients):
    """StepGradients that stop for good (one warning; no step reported) when, at the model's
    first reduction, a Megatron optimizer with a grad scaler steps the model's main parameters:
    the buffers then hold the loss-scaled gradient, which is not the local gradient."""

    def __init__(self, monitor, keep: bool, model, mode: str):
        super().__init__(monitor, keep=keep)
        self._model = model
        self._mode = mode
        self._checked = False
        self.unwatched = ""

    def check_loss_scale(self) -> None:
        if self._checked:
            return
        self._checked = True
        try:
            name = loss_scaling_optimizer(self._model)
        except Exception as e:  # monitoring must never break training
            self._monitor._hook_failed(e)
            return
        if name:
            self.unwatched = (
                f"rankscope: {WHAT} (megatron-core {_version()}) in mode {self._mode} with "
                f"{name} and a loss scale (a grad scaler) is not watched: Megatron's gradient "
                "buffers hold the local gradient times the loss scale. Training goes on unwatched."
            )
            warnings.warn(self.unwatched, RuntimeWarning, stacklevel=2)
            # Off from this step on (before anything of it was added); a control that switches
            # the monitor on again finds add() a no-op and reports nothing.
            self._monitor._enabled = False
            self._monitor._active = False

    def add(self, specs, grads) -> None:
        if not self.unwatched:
            super().add(specs, grads)

    def close_step(self, sketcher):
        if self.unwatched:
            return False, None
        return super().close_step(sketcher)


def loss_scaling_optimizer(model) -> str:
    """The class name of the Megatron optimizer with a grad scaler whose torch.optim optimizer
    holds Megatron's main parameter (``param.main_param``) of one of ``model``'s parameters, or
    "". One heap walk when the model has main parameters (a mixed-precision optimizer was built),
    none otherwise."""
    module = getattr(model, "module", model)
    ids = {
        id(p.main_param) for p in module.parameters() if getattr(p, "main_param", None) is not None
    }
    base = getattr(sys.modules.get("megatron.core.optimizer.optimizer"), "MegatronOptimizer", None)
    if not ids or base is None:
        return ""
    for o in gc.get_objects():
        t = type(o)
        if not (isinstance(t, type) and issubclass(t, base)):
            continue
        state = getattr(o, "__dict__", {})
        inner = state.get("optimizer")
        if inner is None or state.get("grad_scaler") is None:
            continue
        if any(id(p) in ids for g in inner.param_groups for p in g["params"]):
            return t.__name__
    return ""


def _wrap(bucket_group, grads: StepGradients, spec_by_param: dict) -> None:
    """Wraps the bucket group's start_grad_sync once; a later attach retargets it."""

    def make(current, target):
        def start_grad_sync(*args, **kwargs):
            step_grads, specs = target[0]
            # Megatron's own no-op case (the collective of the first batch was already issued).
            no_op = bucket_group.is_first_batch and bucket_group.grad_reduce_handle is not None
            if step_grads._monitor._active and not no_op:
                step_grads.check_loss_scale()
            if step_grads._monitor._active and not no_op and not step_grads.unwatched:
                try:
                    params = [p for b in bucket_group.buckets for p in b.params_list]
                    local = [specs[id(p)] for p in params]
                    views = [p.main_grad.view(p.shape) for p in params]
                except Exception as e:  # monitoring must never break training
                    step_grads._monitor._hook_failed(e)
                else:
                    with torch.no_grad():
                        step_grads.add(local, views)
            return current(*args, **kwargs)

        return start_grad_sync

    wrap_retargetable(bucket_group, "start_grad_sync", (grads, spec_by_param), make)
