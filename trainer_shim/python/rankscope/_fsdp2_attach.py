"""FSDP2 models attached from outside the script: the zero-code launch (``python -m
rankscope.run``, ``RANKSCOPE_AUTO=1``) and ``rankscope attach --pid``. rankscope._autoattach holds
the process's ``AutoAttacher`` and the DDP side; this module the FSDP2 side.

Finding the models. ``fully_shard`` (and ``replicate``, built on it) swaps a module's class for a
dynamic subclass of ``FSDPModule``, and FSDP2 decides which module is the root (the one whose
gradient is the rank's local gradient: the one the optimizer steps) at the root's first forward,
in ``FSDPState._lazy_init``. The zero-code launch wraps that method (a post-import hook on its
module; ``patch_state_module``): the first call that makes a state the root hands its module to
the attacher. A live attach finds the roots on the heap (``is_root``), beside the DDP models.

The common clock. DDP's reducer counts iterations the same way on every rank, which is what the
ranks agree on the first reported step with (rankscope._attach_agreement). FSDP2 keeps no such
counter, so each attached model reads a clock of its own at each optimizer step (the model's
optimizer's ``register_step_post_hook``, the step boundary):

- zero-code launch (``CLOCK_STEPS``): the optimizer steps since the model's first forward with
  gradients. The monitor is installed at that forward, the same point of the program on every
  rank (before the first optimizer step), so every rank has the same count at the same boundary.
- live attach (``CLOCK_COLLECTIVES``): ranks are attached at different steps, so a count since
  arrival differs from rank to rank. The clock is the number of collectives this rank issued on
  the model's mesh (``_get_sequence_number_for_group`` of the backend for the model's device,
  summed over the mesh's process groups; c10d numbers them from 0 on every rank). Every rank of
  a data-parallel mesh issues the same collectives on it in the same order (FSDP2's all-gathers
  and reduce-scatters, a gradient clipping's all-reduce, the script's own), and when the
  optimizer step ends all of the step's collectives were issued (the reduce-scatters run in the
  backward, which FSDP2 finishes before it returns) and none of the next step's (issued from its
  forward on). So at the same boundary the count is the same on every rank, and it grows every
  step (a training step of FSDP2 runs at least one collective on its mesh).

Agreement. Each rank publishes its clock at a boundary, with a lead: ``LEAD`` steps' worth of the
clock (``LEAD`` for the step count; ``LEAD`` times the collectives of this rank's previous step
for the collective count, so it publishes at its second boundary). Once every rank has arrived,
each computes ``start = max(clocks) + max(leads)`` from the same published values and begins
reporting with the step that follows its first boundary whose clock is ``>= start``. That boundary
is the same step on every rank, because the clock has the same value at the same boundary and
increases. None has passed it when it learns the start, as for DDP: a step's collectives complete
only when every rank joins them, so no rank is more than a step ahead of the last to arrive, and
the start is ``LEAD`` (4) steps past it. A rank that learns the start late anyway (a store that
answered slowly) still numbers its steps as the others do, from its own record of the clock, and
reports from its current step (warned); the steps between are missing for it on the collector.

Step numbers. Zero-code launch: the step count itself (the first step after the first forward is
0), as DDP's counter numbers DDP's steps. Live attach: the optimizer's own step count where its
state keeps one on the CPU (Adam, AdamW and the other optimizers with ``state[p]["step"]``: the
same on every rank), else 0 at the agreed first step; either way the same on every rank.

Contract: nothing here raises into the training script; a failure is warned once, stops that
model's attachment and is kept in ``error``. Thread safety: training thread only (forward
pre-hooks, the optimizer's step post-hook, the payload).
"""

import sys

import torch
import torch.distributed as dist

from rankscope import torch as rst
from rankscope._attach_agreement import LEAD, StartAgreement
from rankscope._attachment import Attachment
from rankscope.frameworks import fsdp2
from rankscope.frameworks._local_grads import Unwatched

CLOCK_STEPS = "optimizer steps"
CLOCK_COLLECTIVES = "collectives"

# FSDP2's state module, where ``FSDPState._lazy_init`` decides the root: torch >= 2.6, then 2.4-2.5.
STATE_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_state",
    "torch.distributed._composable.fsdp._fsdp_state",
)


def fsdp_module_class_if_imported():
    """FSDP2's ``FSDPModule`` if the process imported FSDP2 (never imports it), else None."""
    if not any(m in sys.modules for m in STATE_MODULES):
        return None
    return fsdp2.fsdp_module_class()


def is_root(obj, fsdp_module_class) -> bool:
    """True for an FSDP2 module that FSDP2 made its root (after the root's first forward)."""
    t = type(obj)
    if not (isinstance(t, type) and issubclass(t, fsdp_module_class)):
        return False
    try:
        return obj._get_fsdp_state()._is_root is True
    except Exception:
        return False


def is_watched(model) -> bool:
    """True when rankscope already watches the FSDP2 model (``rst.attach`` in the script, or a
    framework's callback): its parameter groups' reduce-scatter preparation is wrapped."""
    return any(
        hasattr(g._prepare_reduce_scatter_inputs, "_rankscope_target")
        for g in fsdp2.param_groups(model)
        if hasattr(g, "_prepare_reduce_scatter_inputs")
    )


def patch_state_module(module, attacher) -> None:
    """(zero-code launch) Wraps ``FSDPState._lazy_init`` of FSDP2's state module so that every
    root FSDP2 module is handed to ``attacher`` at its first forward."""
    cls = getattr(module, "FSDPState", None)
    lazy_init = getattr(cls, "_lazy_init", None)
    if lazy_init is None:
        attacher.warn(
            f"rankscope: torch {torch.__version__} has no FSDPState._lazy_init; FSDP2 models are "
            "not attached by the zero-code launch (rst.attach(model) in the script watches them)"
        )
        return
    if getattr(lazy_init, "_rankscope", False):
        return

    def _lazy_init_wrapper(self, *args, **kwargs):
        was = self._is_root
        result = lazy_init(self, *args, **kwargs)
        if was is None and self._is_root is True:
            try:
                attacher.add_fsdp2(self._modules[0], CLOCK_STEPS, in_forward=True)
            except Exception as e:  # attaching must never break the script
                attacher.warn(f"rankscope: could not attach to an FSDP2 model ({e!r})")
        return result

    _lazy_init_wrapper._rankscope = True
    _lazy_init_wrapper.__wrapped__ = lazy_init
    cls._lazy_init = _lazy_init_wrapper


def collective_counter(model):
    """A function returning the collectives this rank issued on the FSDP2 model's mesh so far
    (see the module docstring); raises RuntimeError naming what this torch or backend lacks."""
    groups = fsdp2.param_groups(model)
    mesh = groups[0].mesh_info.mesh
    device = model._get_fsdp_state()._device
    backends = []
    for pg in mesh.get_all_groups():
        backend = pg
        try:
            backend = pg._get_backend(device)
        except Exception:  # one backend for every device: the group's own
            pass
        if not hasattr(backend, "_get_sequence_number_for_group"):
            raise RuntimeError(
                f"torch {torch.__version__}'s process groups do not count collectives "
                "(_get_sequence_number_for_group), the clock a live attach to FSDP2 agrees on"
            )
        backends.append(backend)

    def count() -> int:
        return sum(int(b._get_sequence_number_for_group()) for b in backends)

    count()  # a backend that keeps no sequence numbers raises here, at install
    return count


def optimizer_step_count(optimizer) -> int | None:
    """The optimizer's own count of its steps, where its state keeps one on the CPU (the
    ``step`` of the first parameter that has state: Adam, AdamW, ...), else None. Never reads a
    device tensor (that would synchronize)."""
    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not state:
                    continue
                step = state.get("step")
                if isinstance(step, (int, float)):
                    return int(step)
                if isinstance(step, torch.Tensor) and step.device.type == "cpu":
                    return int(step.item())
                return None
    except Exception:
        return None
    return None


class ClockStart:
    """One rank's part in starting at the agreed step of one (job, group) on a clock read at
    each optimizer step (see the module docstring). Pure but for the c10d store: the same
    object whichever clock, so that the tests can drive ranks through it.

    ``kind`` CLOCK_STEPS publishes 0 at once (every rank is installed before its first optimizer
    step); CLOCK_COLLECTIVES publishes at its second boundary, with ``LEAD`` times the clock's
    advance over the step before. ``store`` None: no agreement, this rank starts ``LEAD`` steps
    on (warned by StartAgreement only when a store fails)."""

    def __init__(self, store, key: str, rank: int, world_size: int, kind: str, warn):
        self._args = (store, key, rank, world_size)
        self._kind = kind
        self._warn = warn
        self.agreement = None
        self.start = None  # the agreed clock value, once known
        self._values = []  # the clock at each boundary since arrival
        if kind == CLOCK_STEPS:
            self._publish(0, LEAD)

    @property
    def arrived(self) -> int:
        return 0 if self.agreement is None else self.agreement.arrived

    def _publish(self, value: int, lead: int) -> None:
        self.agreement = StartAgreement(*self._args, value, self._warn, lead=lead)

    def at_boundary(self, value: int, optimizer_count=None):
        """Called at each optimizer step boundary (the step just ended) with the clock's value
        then, until it returns a number: the number of the step about to begin, which is this
        rank's first reported one, or None while that is not known or not reached.
        ``optimizer_count()`` gives the optimizer's own step count or None (CLOCK_COLLECTIVES
        numbers by it). Raises RuntimeError when the clock did not advance over a step (it
        cannot tell steps apart)."""
        if self._values and value <= self._values[-1]:
            raise RuntimeError(
                f"the {self._kind} clock did not advance over an optimizer step ({value}): "
                "the model's mesh ran no collective in it"
            )
        self._values.append(value)
        if self.agreement is None:  # the collective clock: its lead from one step's advance
            if len(self._values) < 2:
                return None
            self._publish(value, LEAD * (value - self._values[-2]))
        if self.start is None:
            self.start = self.agreement.poll(value)
            if self.start is None:
                return None
        if value < self.start:
            return None
        since_start = sum(1 for v in self._values if v >= self.start)  # 1: on time
        if since_start > 1:
            self._warn(
                f"rankscope: rank {self._args[2]} learned the agreed first step "
                f"{since_start - 1} step(s) late; it reports from its current step"
            )
        if self._kind == CLOCK_STEPS:
            return value  # the count itself numbers the steps
        own = optimizer_count() if optimizer_count is not None else None
        return own if own is not None else since_start - 1


class AttachedFsdp2(Attachment):
    """One root FSDP2 model attached from outside the script. Its states and ``describe()`` are
    rankscope._autoattach.AttachedModel's: waiting -> agreeing -> agreed -> reporting (or
    failed); here "agreed" is never shown apart (the start is taken at the boundary that
    reaches it)."""

    KIND = "an FSDP2 model"
    PATH = "reduce-scatter inputs"  # where the local gradient is seen, after framework_mode

    def __init__(self, attacher, model, clock: str):
        pg = self._process_group(model)
        super().__init__(
            attacher,
            model,
            dist.get_rank(pg) if pg is not None else dist.get_rank(),
            dist.get_world_size(pg) if pg is not None else dist.get_world_size(),
        )
        self._clock_kind = clock
        self._pg = pg
        self._start = None  # ClockStart
        self._clock = None  # () -> the clock's value now
        self._steps = 0  # optimizer steps since the monitor was installed
        # Before FSDP2's own pre-forward (prepend): the parameters are still the sharded ones
        # then, which the FSDP2 path maps (during the forward they are the unsharded ones).
        self._pre_hook = model.register_forward_pre_hook(self._pre_forward, prepend=True)

    @staticmethod
    def _process_group(model):
        """The group the model's gradient is reduced over (None: a mesh spanning part of the
        job, refused at install)."""
        groups = fsdp2.param_groups(model)
        return fsdp2._mesh_group(groups) if groups else None

    @staticmethod
    def _class_name(model) -> str:
        """The class name that tells two models of one group apart (group_for_process_group)."""
        return type(model).__name__

    def _describe_more(self, d: dict) -> None:
        d["clock"] = self._clock_kind
        if self._start is not None and self._start.arrived:
            d["arrived"] = self._start.arrived

    # ---- installation, at the next forward with gradients -----------------------------------

    def _pre_forward(self, module, inputs):
        if self.state != "waiting" or not torch.is_grad_enabled():
            return None
        self._remove_pre_hook()
        try:
            self._install(module)
            self._changed("agreeing")
        except Exception as e:  # attaching must never break training
            self._fail(e)
        return None

    def _install(self, model) -> None:
        attacher = self._attacher
        if self._pg is None:
            raise RuntimeError(
                f"the model's mesh ({self.KIND}) spans part of the job (no process group for it)"
            )
        if self._clock_kind == CLOCK_COLLECTIVES:
            self._clock = collective_counter(model)
        else:
            self._clock = lambda: self._steps
        self.group = attacher.group_for_process_group(self, self._pg, self._class_name(model))
        options = dict(attacher.options, job=attacher.job, group=self.group, dormant=True)
        monitor = rst.attach(model, **options)
        if isinstance(monitor, Unwatched):  # the FSDP2 path warned, naming torch and the mode
            raise RuntimeError(monitor.reason)
        self.monitor = monitor
        self.path = f"{monitor.framework_mode}: {self.PATH}"
        self._optimizer = self._optimizer_for(model)
        self._hook_handles.append(
            self._optimizer.register_step_post_hook(lambda opt, args, kwargs: self._boundary())
        )
        self.step_boundary = f"{type(self._optimizer).__name__}.step post-hook"
        store = None
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            pass
        self._start = ClockStart(
            store,
            f"rankscope/attach/{attacher.job}/{self.group or '-'}",
            monitor.rank,
            monitor.world_size,
            self._clock_kind,
            attacher.warn,
        )

    # ---- the step boundary: the optimizer's step post-hook ----------------------------------

    def _optimizer_for(self, model):
        """The torch.optim optimizer whose step post-hook is the model's step boundary; raises
        RuntimeError (the attachment fails, warned) when there is none."""
        optimizer = self._attacher.optimizer_for(model)
        if optimizer is None:
            raise RuntimeError(
                f"no torch.optim optimizer holds the parameters of {self.KIND} (its step is "
                "the step boundary such a model is watched by)"
            )
        return optimizer

    def _boundary(self) -> None:
        if self.state in ("failed", "closed"):
            return
        try:
            self._steps += 1
            if self.state == "reporting":
                loss, _ = self._attacher.capture.take()
                self.monitor.step(loss)
                return
            # Until the first reported step: learn whether the framework reduces a parameter
            # more than once a step (FSDP2 under accumulation), so that step keeps the sums.
            grads = getattr(self.monitor, "local_grads", None)
            if grads is not None:
                grads.dormant_step_ended()
            number = self._start.at_boundary(
                int(self._clock()), lambda: optimizer_step_count(self._optimizer)
            )
            if number is not None:
                self.start_step = number
                self._attacher.capture.take()  # losses before this step are not its own
                self.monitor._start_at(number, enabled=not self._attacher.dormant)
                self._changed("reporting")
        except Exception as e:  # attaching must never break training
            self._fail(e)

    # ---- state ------------------------------------------------------------------------------
