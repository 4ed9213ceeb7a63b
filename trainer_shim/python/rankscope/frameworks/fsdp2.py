"""FSDP2 (``fully_shard``, and ``replicate`` built on it): each rank's local gradient before
FSDP2 reduces it.

Where it is seen. Every FSDP2 parameter group (one per ``fully_shard`` call) reduces its gradients
in ``FSDPParamGroup.post_backward``, which hands ``foreach_reduce`` the parameters that have a
gradient and their *unsharded local* gradients; ``foreach_reduce`` first calls the group's
``_prepare_reduce_scatter_inputs(fsdp_params, unsharded_grads, world_size)`` (a per-group callable
that reorders non-dim-0 shards), before the copy into the reduce-scatter buffer. rankscope wraps that
callable on each group: it sees each parameter's full local gradient in its own shape, in the
gradient's dtype, only the parameters that have one (an unused expert is simply absent), then calls
PyTorch's own. The reduction itself is PyTorch's, untouched, so training is bit-identical.

Why not the public ``set_custom_reduce_scatter`` (torch >= 2.9): it sees the same values permuted
into rank chunks, but (a) it never runs when the shard group has one rank (pure data parallelism
through ``replicate`` or a replicate-only mesh: ``foreach_reduce`` copies instead), (b) its call
does not say which parameters the buffer holds, which changes when some have no gradient, and (c)
it replaces a comm torchtitan and others set themselves. The wrapped callable covers FSDP, HSDP and
replicate alike. It is private: rankscope checks for it (and the attributes it reads) with
``hasattr`` and refuses, with one message naming torch's version and the mode, where it is absent.

Modes and what is compared:
  - FSDP (1-D shard mesh): each rank's local loss, gradient norm and sketch, compared across all
    ranks of the mesh. No replica fingerprints: no two ranks hold the same reduced shard.
  - HSDP (2-D mesh, replicate x shard): the same, across all ranks of the mesh (every rank has its
    own data). The ranks of one shard index in the different replicas hold equal shards: each
    rank sends the parameter fingerprint of its local shards (every ``param_check_every`` steps,
    of each DTensor's local tensor, as replicate does) with its replica set, its coordinate on
    the shard mesh dimension, and the collector compares each shard index's replicas with each
    other, never shards against shards (docs/DESIGN.md "Replica sets"). Uneven shards: the local
    tensor is FSDP2's unpadded view (the padding is never read) and has the same shape on every
    replica of one shard index. The reduced gradient's fingerprint is not sent.
  - replicate (shard group of one rank): the same; every rank holds every parameter whole, so
    the parameter fingerprints (every ``param_check_every`` steps, of each DTensor's local
    tensor) are sent and compared across all ranks (one replica set, the whole group). The
    reduced gradient's fingerprint is not.
Micro-batches: FSDP2 reduces every backward unless ``set_requires_gradient_sync(False)``;
``rankscope.frameworks._local_grads.StepGradients`` sums the step's reductions (see there).

Aggregation integrity (rankscope._integrity), replicate mode only (the others leave each rank a
shard of the reduced gradient). ``foreach_reduce`` all-reduces each group's gradients (the mean
over the mesh) and assigns them to, or *adds* them into, each parameter's ``.grad`` (a DTensor
whose local tensor is whole when the shard group has one rank); the root's
``_root_post_backward_final_callback`` (private; queued by the first pre-backward of every
backward, on the state that ran it) then waits for the reductions (a stream wait on their
post-reduce events) when the backward is the last one (``is_last_backward``, FSDP2's default)
and not finalized by hand. rankscope wraps that callback on every FSDP2 state of the model and,
on the steps this rank checks, after the original, sketches every ``.grad``'s local tensor at
the parameter's offset in rankscope's flat order, replacing what an earlier backward of the step
added, when a reduction ran since the last read. So the step's last read holds the sum over its
micro-batches of the reduced means: the mean of the ranks' step local gradients, which the local
sketches (the micro-batches' added) average to: a step with several reductions is checked (its
extra rounding: the float32 additions into ``.grad``, one a micro-batch, of the size of the
reduction's own). It comes after FSDP2's reduction and before anything the script does to the
gradients (``clip_grad_norm_``, the optimizer). Not read (the step unchecked, counted as
``integrity_unread``): a backward whose reductions are left to a later finalization
(``set_is_last_backward(False)``, manual finalization), unless a later backward of the step
reads; an all-reduce hook (``set_all_reduce_hook``, which may change the reduced values) or a
gradient divide factor other than the mesh size (not the mean). Precision: the coarsest of the
reduce dtype and the gradients' dtype.

Versions: needs ``FSDPParamGroup._prepare_reduce_scatter_inputs`` (read in torch 2.15); the
integrity check ``FSDPState._root_post_backward_final_callback`` (read in torch 2.15; where it is
absent the check is off, ``mon.integrity_unsupported`` says so). torch 2.2
has no FSDP2 (``fully_shard`` appeared in torch.distributed._composable.fsdp in 2.4 and in
torch.distributed.fsdp in 2.6).
"""

import torch
import torch.distributed as dist

from rankscope.frameworks._local_grads import (
    FrameworkModel,
    ParamTable,
    StepGradients,
    refuse,
    wrap_retargetable,
)

WHAT = "FSDP2 (fully_shard)"


def fsdp_module_class():
    """FSDP2's ``FSDPModule`` class in this torch, or None."""
    for path in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = __import__(path, fromlist=["FSDPModule"])
        except ImportError:
            continue
        cls = getattr(module, "FSDPModule", None)
        if cls is not None:
            return cls
    return None


def is_fsdp2(model) -> bool:
    cls = fsdp_module_class()
    return cls is not None and isinstance(model, cls)


def param_groups(model) -> list:
    """Every FSDP2 parameter group under ``model`` (one per fully_shard / replicate call)."""
    cls = fsdp_module_class()
    groups = []
    for m in model.modules():
        if not isinstance(m, cls):
            continue
        state = m._get_fsdp_state()
        if hasattr(state, "_fsdp_param_groups"):  # recent torch: several groups per state
            groups.extend(g for g in state._fsdp_param_groups if g is not None)
        elif getattr(state, "_fsdp_param_group", None) is not None:
            groups.append(state._fsdp_param_group)
    return groups


def mode_of(groups) -> str:
    """ "FSDP", "HSDP" or "replicate", from the groups' mesh (the first group's; FSDP2 builds every
    group of a model on one mesh unless a shard_placement_fn says otherwise)."""
    info = groups[0].mesh_info
    shard = getattr(info, "shard_mesh_size", None)
    replicate = getattr(info, "replicate_mesh_size", None)
    if shard is None or shard == 1:
        return "replicate"
    if replicate is not None and replicate > 1:
        return "HSDP"
    return "FSDP"


def _mesh_group(groups):
    """The process group spanning the model's data-parallel mesh, or None if none exists
    without communication (a mesh smaller than the job and of more than one dimension)."""
    mesh = groups[0].mesh_info.mesh
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    if mesh.ndim == 1:
        return mesh.get_group()
    return None


def _mesh_key(mesh):
    """A mesh by its ranks and layout (replicate() without a mesh makes one per call)."""
    return (tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()))


def _shard_index(groups):
    """This rank's coordinate on the model's shard mesh dimension (HSDP: the ranks of one shard
    index in the different replicas hold equal shards), or None where this torch does not say."""
    info = groups[0].mesh_info
    dim = getattr(info, "shard_mesh_dim", None)
    if dim is not None and hasattr(info.mesh, "get_local_rank"):
        return int(info.mesh.get_local_rank(dim))
    rank = getattr(info, "shard_mesh_rank", None)
    return None if rank is None else int(rank)


def _missing(groups) -> str:
    """What this torch lacks of what the path reads, or ""."""
    for g in groups:
        if not callable(getattr(g, "_prepare_reduce_scatter_inputs", None)):
            return "FSDPParamGroup._prepare_reduce_scatter_inputs"
        if not hasattr(g, "fsdp_params") or not hasattr(g, "mesh_info"):
            return "FSDPParamGroup.fsdp_params / mesh_info"
        for p in g.fsdp_params:
            if not hasattr(p, "sharded_param"):
                return "FSDPParam.sharded_param"
    return ""


def attach_fsdp2(model, attach_monitor, *, accumulate_local_grad=None, start_step=0, **options):
    """``rankscope.torch.attach`` for an FSDP2 model: the Monitor, or an ``Unwatched`` stand-in
    (warned) where this torch or mode cannot be watched exactly. ``attach_monitor(model_like,
    **options)`` makes the Monitor (rankscope.torch's common path)."""
    if options.pop("comm_hook", None) is not None or options.pop("comm_hook_state", None):
        raise ValueError("attach: FSDP2 has no comm hook to chain to (comm_hook= is for DDP/FSDP1)")
    if getattr(model._get_fsdp_state(), "_is_root", None) is False:  # known after a forward
        return refuse(
            WHAT,
            "?",
            "the module is not the root FSDP2 module (pass the model the optimizer steps, the "
            "last fully_shard call); its gradient is not the rank's local gradient",
            start_step,
        )
    groups = param_groups(model)
    if not groups:
        return refuse(WHAT, "?", "the model has no FSDP2 parameter group", start_step)
    missing = _missing(groups)
    mode = mode_of(groups) if not missing else "?"
    if missing:
        return refuse(WHAT, mode, f"this torch has no {missing}", start_step)
    meshes = {_mesh_key(g.mesh_info.mesh) for g in groups}
    if len(meshes) > 1:
        return refuse(WHAT, mode, "the model's parameter groups use different meshes", start_step)
    pg = _mesh_group(groups)
    if pg is None:
        return refuse(
            WHAT, mode, "its 2-D mesh spans part of the job (no process group for it)", start_step
        )
    # rankscope's flat order: the model's named_parameters() (FSDP2 keeps the names and the
    # global shapes of its DTensor parameters).
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # Replicas: with a shard group of one rank every rank holds every parameter whole (its
    # DTensor's local tensor), and the parameter fingerprints compare them across the group.
    # HSDP: the local tensors are this rank's shards, compared with the other replicas' of the
    # same shard index only (the replica set).
    replicas = replica_set = None
    if mode == "HSDP":
        replica_set = _shard_index(groups)
    if options.get("fingerprints", True) and (
        mode == "replicate" or (mode == "HSDP" and replica_set is not None)
    ):
        replicas = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    table = ParamTable(((n, p.shape) for n, p in named), replicas)
    spec_by_param = {id(p): s for (_, p), s in zip(named, table.specs)}
    for g in groups:
        for fp in g.fsdp_params:
            if fp.sharded_param.requires_grad and id(fp.sharded_param) not in spec_by_param:
                return refuse(
                    WHAT, mode, "a sharded parameter is not among the model's", start_step
                )
    options["fingerprints"] = replicas is not None  # see the module docstring
    monitor = attach_monitor(FrameworkModel(model, table, pg), start_step=start_step, **options)
    grads = StepGradients(monitor, keep=accumulate_local_grad)
    monitor.local_grads = grads
    monitor.framework_mode = f"FSDP2 {mode}"
    if replicas is not None and hasattr(monitor, "_replica"):
        monitor._replica.replica_set = replica_set
    for g in groups:
        _wrap(g, grads, spec_by_param)
    _watch_reduced(model, monitor, grads, groups, mode, named, spec_by_param)
    return monitor


def _wrap(group, grads: StepGradients, spec_by_param: dict) -> None:
    """Wraps the group's _prepare_reduce_scatter_inputs once; a later attach retargets it."""

    def make(current, target):
        def prepare(fsdp_params, unsharded_grads, world_size, *args, **kwargs):
            step_grads, specs = target[0]
            if step_grads._monitor._active or step_grads.learning:
                try:
                    params = [specs[id(fp.sharded_param)] for fp in fsdp_params]
                except KeyError as e:  # monitoring must never break training
                    step_grads._monitor._hook_failed(e)
                else:
                    with torch.no_grad():
                        step_grads.add(params, list(unsharded_grads))
            return current(fsdp_params, unsharded_grads, world_size, *args, **kwargs)

        return prepare

    wrap_retargetable(group, "_prepare_reduce_scatter_inputs", (grads, spec_by_param), make)


# ---- Aggregation integrity: replicate mode's reduced gradient (see the module docstring) --------


def _integrity_unsupported(model, groups, mode) -> str:
    """Why the aggregation check cannot read this model's reduced gradient whole, or ""."""
    if mode != "replicate":
        return f"{mode} leaves each rank one shard of the reduced gradient"
    cls = fsdp_module_class()
    for m in model.modules():
        if isinstance(m, cls) and not callable(
            getattr(m._get_fsdp_state(), "_root_post_backward_final_callback", None)
        ):
            return (
                f"this torch ({torch.__version__}) has no "
                "FSDPState._root_post_backward_final_callback"
            )
    return ""


def _reduction_dtype(groups):
    """The coarsest dtype the groups reduce in or keep their gradients in (its precision bounds
    the check's tolerance), or None when every parameter reduces in its own dtype."""
    from rankscope._integrity import MANTISSA_BITS

    coarsest = None
    for g in groups:
        for fp in g.fsdp_params:
            for dtype in (getattr(fp, "reduce_dtype", None), fp.sharded_param.dtype):
                if dtype is None:
                    continue
                if coarsest is None or MANTISSA_BITS.get(dtype, 0) < MANTISSA_BITS.get(coarsest, 0):
                    coarsest = dtype
    return coarsest


def _watch_reduced(model, monitor, grads, groups, mode, named, spec_by_param) -> None:
    """Sets ``monitor.integrity_unsupported`` and, in replicate mode, wraps every FSDP2 state's
    post-backward final callback to read the reduced gradient (_ReducedReader)."""
    integrity = monitor._replica.integrity
    monitor.integrity_unsupported = _integrity_unsupported(model, groups, mode)
    if monitor.integrity_unsupported:
        integrity.disable()
        return
    reader = _ReducedReader(monitor, grads, groups, named, spec_by_param)
    cls = fsdp_module_class()
    for m in model.modules():
        if isinstance(m, cls):
            wrap_retargetable(
                m._get_fsdp_state(), "_root_post_backward_final_callback", reader, _make_callback
            )


def _make_callback(current, target):
    def callback(*args, **kwargs):
        ctx = getattr(current, "__self__", None)
        ctx = getattr(ctx, "_state_ctx", None)
        # Captured before the original clears it: reductions left to a manual finalization.
        manual = bool(getattr(ctx, "manual_backward_finalization_active", False))
        out = current(*args, **kwargs)
        target[0].after_backward(ctx, manual)
        return out

    return callback


class _ReducedReader:
    """Reads replicate mode's reduced gradient (every parameter's ``.grad``) into the step's
    reduced sketch at the end of each backward that reduced, on the steps this rank checks."""

    def __init__(self, monitor, grads: StepGradients, groups, named, spec_by_param):
        self._monitor = monitor
        self._grads = grads
        self._groups = groups
        self._params = [p for _, p in named]
        self._specs = [spec_by_param[id(p)] for p in self._params]
        self._offsets = [s.offset for s in self._specs]
        self._mesh_size = groups[0].mesh_info.mesh.size()
        self._read = None  # (step, reductions) of the last read

    def _unreadable(self, ctx, manual: bool) -> str:
        if manual or not getattr(ctx, "is_last_backward", True):
            return "reductions left to a later finalization"
        for g in self._groups:
            if getattr(g, "_all_reduce_hook", None) is not None:
                return "an all-reduce hook"
            factor = getattr(g, "gradient_divide_factor", None)
            if factor is not None and factor != self._mesh_size:
                return "a gradient divide factor"
        return ""

    def after_backward(self, ctx, manual: bool) -> None:
        monitor = self._monitor
        integrity = monitor._replica.integrity
        if not monitor._active or not integrity.due:
            return
        # .grad changes only in a reduction: read once after the step's last one.
        mark = (monitor._step, self._grads._reductions)
        if mark == self._read:
            return
        self._read = mark
        integrity.reset()  # this read replaces the step's earlier ones
        if self._unreadable(ctx, manual):
            integrity.unread()
            return
        try:
            tensors = []
            with torch.no_grad():
                for p, spec in zip(self._params, self._specs):
                    g = p.grad
                    if g is not None:
                        g = getattr(g, "_local_tensor", g)
                        if g.numel() != spec.numel():  # not whole: never a partial check
                            integrity.unread()
                            return
                        g = g.detach()
                    tensors.append(g)
            # Read here, not at attach: FSDP2 sets the reduce dtypes at its lazy init.
            dtype = _reduction_dtype(self._groups)
            integrity.add_tensors(tensors, self._offsets, reduction_dtype=dtype)
        except Exception:  # monitoring must never break training; the step goes unchecked
            integrity.fail()
