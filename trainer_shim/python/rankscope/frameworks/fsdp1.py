"""FSDP1 (``FullyShardedDataParallel``): each rank's local gradient through FSDP's communication
hook.

Where it is seen. ``FullyShardedDataParallel.register_comm_hook(state, hook)`` (on the root) makes
every FSDP unit call ``hook(state, padded_unsharded_grad, new_sharded_grad)`` (FULL_SHARD,
SHARD_GRAD_OP) or ``hook(state, grad)`` (NO_SHARD) instead of its own reduction: the first tensor
is the unit's whole local gradient, its FlatParameter's, flat, zero-padded, in the reduce dtype
and not yet divided. rankscope sketches it (each original parameter's piece at the parameter's
offset in rankscope's flat order: ``_param_infos``, ``_numels_with_padding`` and
``_is_padding_mask`` of the FlatParameter say which piece is which; padding is skipped), then
chains to PyTorch's default hooks (``reduce_scatter_hook`` / ``allreduce_hook`` with
``DefaultState(process_group)``), which pre-divide, reduce and post-divide exactly as FSDP's own
path does (same factors), so training is bit-identical with and without rankscope.
``register_comm_hook`` gives every unit the same state; rankscope then gives each unit's FSDP state
its own (``_comm_hook_state``, private), which names the unit's FlatParameter.

Modes and what is compared: FULL_SHARD, SHARD_GRAD_OP and NO_SHARD: each rank's local loss,
gradient norm and sketch, across the FSDP process group. Replica fingerprints: FULL_SHARD and
SHARD_GRAD_OP send none (no two ranks hold the same shard); NO_SHARD sends the parameter
fingerprints (every ``param_check_every`` steps, of the FlatParameters, which every rank holds
whole), compared across all ranks; the reduced gradient's fingerprint is not sent. HYBRID_SHARD and
_HYBRID_SHARD_ZERO2: torch refuses comm hooks there; refused with a message, training unwatched.
Micro-batches: without ``no_sync()`` FSDP1 reduces every backward (see
rankscope.frameworks._local_grads.StepGradients); with ``no_sync()`` on all but the last, once.

Aggregation integrity (rankscope._integrity): under NO_SHARD the hook's all-reduce leaves each
unit's whole reduced (mean) flat gradient in the tensor it was given, so on the steps this rank
checks the hook adds it, after chaining, with the unit's pieces at their global offsets (on a GPU
a DeviceSketch launch on the same stream, after the all-reduce). A unit reduced twice in a step
(accumulation without ``no_sync``: the second holds the first's sum too) leaves that step
unchecked. FULL_SHARD and SHARD_GRAD_OP leave each rank one shard of the reduced gradient: not
checked (docs/DESIGN.md "Aggregation integrity" says what a sharded check would need).

Versions: the hook API and the FlatParameter fields read are the same in torch 2.2 and 2.15.
Register before the first forward (FSDP's rule for comm hooks).
"""

import torch
from torch.distributed.algorithms._comm_hooks import default_hooks

from rankscope._options import replica_check_for
from rankscope.fingerprint import SegmentLayout
from rankscope.frameworks._local_grads import (
    FrameworkModel,
    ParamTable,
    StepGradients,
    refuse,
)

WHAT = "FSDP1 (FullyShardedDataParallel)"
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def is_fsdp1(model) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(model, FullyShardedDataParallel)


def _states():
    from torch.distributed.fsdp import _traversal_utils

    return _traversal_utils._get_fsdp_states


def _units(model):
    """[(fsdp state, [(offset in the unit's unpadded flat gradient, numel, spec name, shape,
    module, index in the unit)])] for every unit with parameters."""
    units = []
    for state in _states()(model):
        handle = getattr(state, "_handle", None)
        if handle is None:
            continue
        fp = handle.flat_param
        pieces, offset, j = [], 0, 0
        for numel, padding in zip(fp._numels_with_padding, fp._is_padding_mask):
            if not padding:
                info = fp._param_infos[j]
                pieces.append((offset, numel, info.param_name, fp._shapes[j], info.module, j))
                j += 1
            offset += numel
        units.append((state, pieces))
    return units


def attach_fsdp1(
    model,
    attach_monitor,
    *,
    accumulate_local_grad=None,
    comm_hook=None,
    comm_hook_state=None,
    start_step=0,
    **options,
):
    """``rankscope.torch.attach`` for an FSDP1 root: the Monitor, or an ``Unwatched`` stand-in
    (warned) in a mode torch refuses hooks for. ``comm_hook`` (an FSDP hook, with
    ``comm_hook_state``) replaces PyTorch's default hooks as what rankscope chains to."""
    strategies = {s.sharding_strategy.name for s in _states()(model)}
    hybrid = sorted(strategies & set(_HYBRID))
    if hybrid:
        return refuse(
            WHAT,
            hybrid[0],
            "torch refuses communication hooks for hybrid sharding, and its reduction is not "
            "otherwise reachable; use FSDP2 (fully_shard on a 2-D mesh) for HSDP",
            start_step,
        )
    units = _units(model)
    # rankscope's flat order: the model's named_parameters() as written, i.e. by module in
    # traversal order (FSDP keeps the original modules in the tree), then by position.
    order = {}
    for name, m in model.named_modules():
        order.setdefault(id(m), (len(order), name.replace("_fsdp_wrapped_module.", "")))
    entries = []
    for u, (_, pieces) in enumerate(units):
        for k, (_, _, pname, shape, module, j) in enumerate(pieces):
            idx, mname = order[id(module)]
            entries.append(((idx, u, j), f"{mname}.{pname}" if mname else pname, shape, (u, k)))
    entries.sort(key=lambda e: e[0])
    # Replicas: under NO_SHARD every rank holds every FlatParameter whole, and the parameter
    # fingerprints compare them.
    replicas = None
    if strategies == {"NO_SHARD"} and options.get("fingerprints", True):
        replicas = [state._handle.flat_param for state, _ in units]
    table = ParamTable(((name, shape) for _, name, shape, _ in entries), replicas)
    spec_at = {where: spec for (_, _, _, where), spec in zip(entries, table.specs)}

    pg = model.process_group
    options["fingerprints"] = replicas is not None  # see the module docstring
    # NO_SHARD all-reduces and steps every rank alike: exact (docs/shim.md).
    options["replica_check"] = replica_check_for(options.get("replica_check"), "exact")
    monitor = attach_monitor(FrameworkModel(model, table, pg), start_step=start_step, **options)
    grads = StepGradients(monitor, keep=accumulate_local_grad)
    monitor.local_grads = grads
    monitor.framework_mode = "FSDP1 " + "/".join(sorted(strategies))
    # The aggregation check needs the whole reduced gradient: NO_SHARD only.
    check_reduced = strategies == {"NO_SHARD"}
    if not check_reduced:
        monitor._replica.integrity.disable()
    shared = _Shared(grads, comm_hook, comm_hook_state, pg, check_reduced)
    try:
        model.register_comm_hook(shared, _fsdp1_hook)
    except (AssertionError, RuntimeError, ValueError) as e:
        monitor.close(timeout=0)
        raise RuntimeError(
            "rankscope.torch.attach: FSDP refused the comm hook (a model takes one hook, "
            "registered once, on the root, before the first forward; pass your own hook as "
            f"attach(comm_hook=...)): {e}"
        ) from e
    for u, (state, pieces) in enumerate(units):
        layout = [(off, n, spec_at[(u, k)]) for k, (off, n, *_rest) in enumerate(pieces)]
        state._comm_hook_state = _UnitState(shared, layout)
    return monitor


class _Shared:
    """What every unit's hook state shares: the step's gradients and the hook chained to."""

    __slots__ = ("grads", "chain", "chain_state", "default_state", "check_reduced")

    def __init__(self, grads, chain, chain_state, pg, check_reduced=False):
        self.grads = grads
        self.chain = chain
        self.chain_state = chain_state
        self.default_state = default_hooks.DefaultState(pg)
        self.check_reduced = check_reduced  # NO_SHARD: the reduced flat gradient is whole


class _UnitState:
    """One FSDP unit's hook state: where each original parameter lies in its flat gradient."""

    __slots__ = ("shared", "layout", "_segments")

    def __init__(self, shared, layout):
        self.shared = shared
        self.layout = layout  # [(offset, numel, ParamSpec)]
        self._segments = None  # the layout as a SegmentLayout of the flat gradient (cached)

    def segments(self, numel: int) -> SegmentLayout:
        """The pieces as a SegmentLayout of a flat gradient of ``numel`` elements."""
        if self._segments is None or self._segments.numel != numel:
            self._segments = SegmentLayout(
                numel,
                [off for off, _, _ in self.layout],
                [n for _, n, _ in self.layout],
                [spec.offset for _, _, spec in self.layout],
            )
        return self._segments


def _fsdp1_hook(state, grad: torch.Tensor, output: torch.Tensor | None = None):
    """Sketches the unit's local gradient, then reduces it as FSDP's default path does."""
    if isinstance(state, _UnitState):
        shared = state.shared
        step_grads = shared.grads
        if step_grads._monitor._active:
            flat = grad.reshape(-1)
            specs, pieces = [], []
            for off, n, spec in state.layout:
                specs.append(spec)
                pieces.append(flat[off : off + n].view(spec.shape))
            with torch.no_grad():
                step_grads.add(specs, pieces)
    else:  # the state register_comm_hook was given: never called, FSDP gives units theirs
        shared = state
    if shared.chain is not None:
        if output is None:
            result = shared.chain(shared.chain_state, grad)
        else:
            return shared.chain(shared.chain_state, grad, output)
    elif output is None:
        result = default_hooks.allreduce_hook(shared.default_state, grad)
    else:
        return default_hooks.reduce_scatter_hook(shared.default_state, grad, output)
    if shared.check_reduced and isinstance(state, _UnitState):
        _add_reduced(state, grad)
    return result


def _add_reduced(state: _UnitState, grad: torch.Tensor) -> None:
    """NO_SHARD, after the all-reduce: the unit's reduced flat gradient into the step's reduced
    sketch, on the steps this rank checks the aggregation."""
    monitor = state.shared.grads._monitor
    integrity = monitor._replica.integrity
    if not monitor._active or not integrity.due:
        return
    try:
        flat = grad.detach().reshape(-1)
        integrity.add(flat, state.segments(flat.numel()), key=id(state))
    except Exception:  # monitoring must never break training; the step goes unchecked
        integrity.fail()
