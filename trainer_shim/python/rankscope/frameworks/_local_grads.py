"""What the sharded frameworks' paths share (rankscope.frameworks.fsdp1, .fsdp2): the model's
parameters as rankscope numbers them, a monitor model that stands in for DDP's, the step's local
gradient when a framework reduces every micro-batch, and the refusal that leaves training
unwatched.

Flat order. rankscope numbers a model's coordinates in ``named_parameters()`` order of the model as
written (before any wrapping), the order DDP's path and the truth tests use; each framework path
maps its gradient pieces onto that order (``ParamSpec.offset``).

Micro-batches. DDP reduces once per step (``no_sync`` on the others); FSDP1 without ``no_sync``
and FSDP2 (unless ``set_requires_gradient_sync(False)``) reduce every micro-batch, so a step's
local gradient is the *sum* of the gradients the hook saw. Sketches are linear: they add. Norms
are not: ``||g1 + g2||`` needs the earlier gradients. ``StepGradients`` therefore keeps, only when
asked or once a step reduced a parameter twice, a running float32 sum of each parameter's local
gradient for the step (memory: one unsharded copy of the model's gradients per rank), and the
step's norm is that sum's exact norm. A step that reduced a parameter twice before the sum was kept
is not reported (counted as ``shim_accumulation_unseen``, warned once): nothing is reported that is
not the local gradient it claims to be. A model attached from outside the script
(rankscope._fsdp2_attach) learns it before its first reported step instead: while the ranks agree
on that step, the attachment marks each optimizer step's end (``dormant_step_ended``) and
``add`` notes which parameters each step reduced, so that first step already keeps the sums.

Thread safety: ``add`` runs where the framework's hook runs (the autograd thread, or FSDP1's
post-backward stream context on the same thread) while backward runs; ``reset`` and ``close_step``
on the training thread in ``mon.step``; they never overlap.
"""

import warnings

import torch

from rankscope._adapters import SelfReduced
from rankscope._torch_compat import foreach_norms


class ParamSpec:
    """One parameter of the model as rankscope numbers it: its name, shape and global flat offset.
    Stands in for the parameter in the monitor's tables (id-keyed), so sharded or flattened
    parameters are never read there."""

    __slots__ = ("name", "shape", "offset", "requires_grad", "_numel")

    def __init__(self, name: str, shape, offset: int):
        self.name = name
        self.shape = torch.Size(shape)
        self.offset = offset
        self.requires_grad = True
        self._numel = self.shape.numel()

    def numel(self) -> int:
        return self._numel

    def data_ptr(self) -> int:
        return 0  # never a tensor's address: the sketcher finds specs by id


class ParamTable:
    """The model's trainable parameters as ``ParamSpec``s, in rankscope's flat order; what the
    monitor's sketcher reads as ``model.module`` (``named_parameters``). ``replica_tensors``: where
    every rank of the group holds the same parameter values (pure data parallelism), the tensors
    that hold them, which the replica fingerprints read (``parameters``); else the specs, never
    read (fingerprints off)."""

    def __init__(self, named_shapes, replica_tensors=None):
        self.replica_tensors = None if replica_tensors is None else list(replica_tensors)
        self.specs = []
        offset = 0
        for name, shape in named_shapes:
            spec = ParamSpec(name, shape, offset)
            self.specs.append(spec)
            offset += spec.numel()
        self.num_coordinates = offset

    def named_parameters(self):
        return ((s.name, s) for s in self.specs)

    def parameters(self):
        return iter(self.specs if self.replica_tensors is None else self.replica_tensors)


class FrameworkModel(SelfReduced):
    """What ``Monitor`` reads of a DDP model, for a framework path: the parameter table (as
    ``module``), the data-parallel process group, and the forward pre-hook on the real model.
    A ``SelfReduced`` model to ``attach``: the framework path feeds the monitor itself."""

    def __init__(self, real_module, table: ParamTable, process_group):
        super().__init__(table, process_group)
        self.real_module = real_module

    def register_forward_pre_hook(self, hook):
        return self.real_module.register_forward_pre_hook(lambda _m, args: hook(self, args))


class _Bucket:
    """One reduction's local gradients in the shape the sketcher reads (a GradBucket's)."""

    __slots__ = ("_index", "_params", "_grads")

    def __init__(self, index, params, grads):
        self._index = index
        self._params = params
        self._grads = grads

    def index(self):
        return self._index

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads


class StepGradients:
    """One rank's local gradient of the step, fed by a framework's hook one reduction at a time.

    ``keep``: True keeps the running sum from the first step (exact norms under any number of
    reductions a step), False never (a step with a parameter reduced twice is not reported),
    None (default) from the step after the first one that reduced a parameter twice.
    """

    def __init__(self, monitor, keep: bool | None = None):
        self._monitor = monitor
        self._auto = keep is None
        self._keep = bool(keep)
        self._reductions = 0
        self._dormant_seen = None  # parameters reduced in the dormant step (dormant_step_ended)
        monitor._sketcher.restart_on_repeat = False
        self.reset()

    def dormant_step_ended(self) -> None:
        """(rankscope._fsdp2_attach) An optimizer step ended while the monitor is not active yet
        (a live attach agreeing on its first step): from now on, until the monitor is active,
        ``add`` only notes which parameters each step reduced, and in the default mode a
        parameter reduced twice in one such step keeps the running sums from the first reported
        step on, so that step is reported too (``learning``)."""
        if self._auto and not self._keep:
            self._dormant_seen = set()

    @property
    def learning(self) -> bool:
        """Whether ``add`` wants the reductions while the monitor is not active."""
        return self._dormant_seen is not None and not self._keep

    def reset(self) -> None:
        self._seen = set()
        self._sums = {}  # offset -> float32 running sum, flat (kept mode)
        self._repeated = False
        self._unseen = False  # a repeat came before the sum was kept

    def add(self, specs, grads) -> None:
        """Sketches one reduction's local gradients (``specs[i]`` holds ``grads[i]``, in the
        parameter's shape) and, in kept mode, adds them to the step's running sums. A few torch
        calls a reduction whatever its number of parameters: the sums of the parameters first
        seen this step are views of one new float32 buffer a device, filled by one
        ``_foreach_copy_``; the others take one ``_foreach_add_``. The buffers live until the
        step's ``reset`` (as many bytes as the sums, allocated when the gradients are)."""
        monitor = self._monitor
        if not monitor._active:
            if self.learning:
                offsets = {spec.offset for spec in specs}
                if offsets & self._dormant_seen:
                    self._keep = True  # reduces every micro-batch: keep the sums from the start
                self._dormant_seen |= offsets
            return
        self._dormant_seen = None  # reporting began: the steps tell from now on
        # Counted first: a reduction that fails below still changed the reduced gradient (the
        # FSDP2 aggregation check re-reads it when this count moved).
        self._reductions += 1
        try:
            firsts = {}  # device -> ([offset], [flat gradient])
            sums, more = [], []
            for spec, g in zip(specs, grads):
                off = spec.offset
                if off in self._seen:
                    self._repeated = True
                    acc = self._sums.get(off)
                    if acc is None:
                        self._unseen = True
                    else:
                        sums.append(acc)
                        more.append(g.detach().reshape(-1))
                else:
                    self._seen.add(off)
                    if self._keep:
                        offs, flats = firsts.setdefault(g.device, ([], []))
                        offs.append(off)
                        flats.append(g.detach().reshape(-1))
            for device, (offs, flats) in firsts.items():
                numels = [f.numel() for f in flats]
                views = torch.empty(sum(numels), dtype=torch.float32, device=device).split(numels)
                torch._foreach_copy_(views, flats)  # casts to float32
                self._sums.update(zip(offs, views))
            if sums:
                torch._foreach_add_(sums, more)
            monitor._add_bucket(_Bucket(self._reductions, list(specs), list(grads)))
        except Exception as e:  # monitoring must never break training
            monitor._hook_failed(e)

    def close_step(self, sketcher):
        """(report the step?, its exact sum of squares or None for the sketch's own)."""
        if not self._repeated:
            return True, None
        if self._unseen:
            counters = self._monitor.counters
            counters["accumulation_unseen"] += 1
            if self._auto:
                self._keep = True
            self._monitor._warn_once(
                "accumulation",
                "rankscope: the framework reduced the gradient of some parameters more than "
                "once in this step (gradient accumulation, a reduction every micro-batch); the "
                "step's local gradient norm needs the micro-batches' sum, which rankscope keeps "
                + (
                    "from the next step on (one unsharded float32 copy of the gradients per "
                    "rank); this step is not reported"
                    if self._auto
                    else "only with accumulate_local_grad=True; such steps are not reported"
                )
                + ". Without that memory: reduce once a step (FSDP2's "
                "set_requires_gradient_sync(False), FSDP1's no_sync() on the other "
                "micro-batches)",
            )
            return False, None
        total = _sum_of_squares(list(self._sums.values()))
        return True, (float(total) if total.device.type == "cpu" else total)


def _sum_of_squares(tensors):
    """sum_i ||t_i||^2 of float32 tensors, accumulated in float64 (a 0-d float64 tensor on their
    device; CPU when there are none), with one ``_foreach_norm`` computed in float64."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(foreach_norms(tensors, torch.float64)).square().sum()


class Unwatched:
    """What ``attach`` returns for a framework version or mode rankscope cannot watch exactly:
    the Monitor's calls, doing nothing. Training goes on unwatched."""

    enabled = False
    every = 1
    sketch_dim = 0

    def __init__(self, reason: str, start_step: int = 0):
        self.reason = reason
        self._step = start_step

    @property
    def step_number(self) -> int:
        return self._step

    def step(self, loss=None, step: int | None = None, batch_size: int | None = None):
        self._step = (self._step if step is None else int(step)) + 1

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self, timeout: float | None = None) -> dict:
        return self.stats()

    def stats(self) -> dict:
        return {"unwatched": self.reason}

    def control(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def refuse(what: str, mode: str, why: str, start_step: int = 0, stacklevel: int = 4) -> Unwatched:
    """One clear warning naming torch's version and the mode; an ``Unwatched`` monitor.
    ``stacklevel`` 4 names the script's ``attach`` call from a framework path."""
    message = (
        f"rankscope: {what} in mode {mode} on torch {torch.__version__} is not watched: {why}. "
        "Training goes on unwatched."
    )
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)
    return Unwatched(message, start_step)


def wrap_retargetable(owner, name: str, state, make_wrapper) -> None:
    """Replaces ``owner.name`` once by ``make_wrapper(original, target)``, where ``target[0]``
    holds ``state``; a later call on the same owner (a re-attach) only points ``target[0]`` at
    the new state, so the framework's method is never wrapped twice. The wrapper reads
    ``target[0]`` on every call."""
    current = getattr(owner, name)
    target = getattr(current, "_rankscope_target", None)
    if target is not None:
        target[0] = state
        return
    target = [state]
    wrapper = make_wrapper(current, target)
    wrapper._rankscope_target = target
    setattr(owner, name, wrapper)
