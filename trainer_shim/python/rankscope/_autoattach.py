"""Attaching to DDP models that the training script never handed to rankscope: the zero-code
launch (``python -m rankscope.run``, ``RANKSCOPE_AUTO=1``) and ``rankscope attach --pid`` (through
rankscope._attach_payload) both end here. FSDP2 models go through the same ``AutoAttacher`` to
rankscope._fsdp2_attach (their own clock and step boundary), FSDP1 roots and Megatron-core DDP
models (zero-code launch only) to rankscope._fsdp1_attach and rankscope._megatron_attach (FSDP2's
attachment on the optimizer-step clock).

For each DDP model (matched by exact type) an ``AttachedModel`` walks through four states:

1. ``waiting``: a forward pre-hook waits for the model's next forward with gradients. Nothing is
   registered from inside backward (a comm hook registered mid-backward silently diverges DDP).
2. at that forward it installs the monitor, dormant: ``rankscope.torch.attach`` with its comm
   hook, or, when the model already has a comm hook (PowerSGD, ZeRO's ``overlap_with_ddp``),
   per-parameter gradient hooks feeding ``attach_reducer``'s monitor (the ``path`` says which);
   the step boundary from the model's optimizer (its ``register_step_post_hook``; without an
   optimizer, the next synchronizing forward); the loss from the
   ``torch.autograd.backward`` wrapper (rankscope._loss_capture: the mean of the step's backward
   calls). State ``agreeing``: the ranks agree on the first step (rankscope._attach_agreement).
3. ``agreed``: waits for the forward of the agreed step.
4. ``reporting``: from that forward on, steps are numbered by DDP's iteration counter (the same
   on every rank) and reported, or kept dormant for ``rankscope ctl enable`` when asked.

Contract: nothing here raises into the training script; a failure is warned once, stops that
model's attachment (its hooks become pass-throughs) and is kept in ``error``. ``on_change`` is
called (training thread) each time a model changes state. Thread safety: training thread only,
except the parameter hooks (autograd thread, while the training thread waits in backward).
"""

import gc
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from rankscope import _fsdp2_attach, _loss_capture
from rankscope import torch as rst
from rankscope._attach_agreement import StartAgreement
from rankscope._attachment import Attachment
from rankscope._ddp_clock import DdpIterations

DDP = torch.nn.parallel.DistributedDataParallel

PATH_COMM_HOOK = "comm hook"
PATH_PARAM_HOOKS = "parameter hooks"


def find_models_and_optimizers():
    """(models, optimizers) alive in this process: DDP models by exact type, root FSDP2 modules
    (rankscope._fsdp2_attach.is_root; only when the process imported FSDP2), and optimizers by
    type's class hierarchy (never ``isinstance``, which runs user ``__class__`` properties). An
    optimizer wrapped by another (ZeroRedundancyOptimizer's local ``optim``) is left out. One
    heap walk."""
    models, optimizers = [], []
    optimizer_type = torch.optim.Optimizer
    fsdp_module = _fsdp2_attach.fsdp_module_class_if_imported()
    for o in gc.get_objects():
        t = type(o)
        if t is DDP:
            models.append(o)
        elif not isinstance(t, type):
            continue
        elif issubclass(t, optimizer_type):
            optimizers.append(o)
        elif (
            fsdp_module is not None
            and issubclass(t, fsdp_module)  # a C-level test first: the walk sees every object
            and _fsdp2_attach.is_root(o, fsdp_module)
        ):
            models.append(o)
    inner = {id(getattr(o, "optim", None)) for o in optimizers}
    # A wrapper that never ran Optimizer.__init__ (accelerate's AcceleratedOptimizer) has no
    # step hooks; the optimizer it wraps steps once per optimizer step.
    return models, [
        o for o in optimizers if id(o) not in inner and hasattr(o, "_optimizer_step_post_hooks")
    ]


def optimizer_of(model, optimizers) -> torch.optim.Optimizer | None:
    """The first optimizer that holds one of ``model``'s trainable parameters."""
    ids = {id(p) for p in model.parameters() if p.requires_grad}
    for opt in optimizers:
        for group in opt.param_groups:
            if any(id(p) in ids for p in group["params"]):
                return opt
    return None


def has_comm_hook(model) -> str:
    """The name of the comm hook already registered on a DDP model, or ""."""
    try:
        return str(model._get_ddp_logging_data().get("comm_hook") or "")
    except Exception:
        return ""


class AttachedModel(Attachment):
    """One DDP model attached from outside the script."""

    KIND = "a DDP model"

    def __init__(self, attacher: "AutoAttacher", model):
        super().__init__(
            attacher,
            model,
            dist.get_rank(model.process_group),
            dist.get_world_size(model.process_group),
        )
        self._agreement = None
        self._agreement_key = None
        self._clock = DdpIterations()
        self._last_iteration = None
        self._sync_backward = True
        self._params: list[torch.Tensor] = []
        self._pre_hook = model.register_forward_pre_hook(self._pre_forward)

    def _describe_more(self, d: dict) -> None:
        if self._agreement is not None:
            d["arrived"] = self._agreement.arrived

    # ---- the forward pre-hook: every state change happens here or at the step boundary ------

    def _pre_forward(self, module, inputs):
        if self.state in ("failed", "closed"):
            return None
        try:
            self._advance(module)
        except Exception as e:  # attaching must never break training
            self._fail(e)
        return None

    def _advance(self, model) -> None:
        n = self._clock.before_forward(model)  # None until known (rankscope._ddp_clock)
        self._sync_backward = bool(model.require_backward_grad_sync)
        if self.state == "waiting":
            if not torch.is_grad_enabled():
                return
            self._install(model)
            self._changed("agreeing")
        if n is None:
            return
        if self.state == "agreeing":
            if self._agreement is None:
                store = None
                try:
                    store = dist.distributed_c10d._get_default_store()
                except Exception:
                    pass
                self._agreement = StartAgreement(
                    store,
                    self._agreement_key,
                    self.monitor.rank,
                    self.monitor.world_size,
                    n,
                    self._attacher.warn,
                )
            start = self._agreement.poll(n)
            if start is None:
                return
            self.start_step = start
            self._changed("agreed")
        if self.state == "agreed" and n >= self.start_step:
            if n > self.start_step:
                self._attacher.warn(
                    f"rankscope: rank {self.rank} of group {self.group!r} saw the agreed first "
                    f"step {self.start_step} late, at step {n}; it reports from step {n}"
                )
                self.start_step = n
            self._attacher.capture.take()  # losses before this step's forward are not its own
            self.monitor._start_at(n, enabled=not self._attacher.dormant)
            self._changed("reporting")
        if (
            self.step_boundary == "forward"
            and self.state == "reporting"
            and n > (self._last_iteration if self._last_iteration is not None else n)
        ):
            self._boundary()
        self._last_iteration = n
        # The parameter hooks need each forward's no_sync() state; the forward boundary needs
        # every forward; otherwise the pre-hook's work is done.
        if self.state == "reporting" and self.step_boundary != "forward" and not self._params:
            self._pre_hook.remove()
            self._pre_hook = None

    def _install(self, model) -> None:
        attacher = self._attacher
        self.group = attacher.group_for(self, model)
        options = dict(attacher.options, job=attacher.job, group=self.group, dormant=True)
        hook = has_comm_hook(model)
        if not hook:
            self.monitor = rst.attach(model, **options)
            self.path = PATH_COMM_HOOK
        else:
            self.monitor = rst.attach_reducer(
                model.module, process_group=model.process_group, **options
            )
            self.path = f"{PATH_PARAM_HOOKS} (the model has its own comm hook: {hook})"
            self._install_param_hooks(model)
        self._optimizer = attacher.optimizer_for(model)
        if self._optimizer is None:
            self.step_boundary = "forward"
        else:
            self._hook_handles.append(
                self._optimizer.register_step_post_hook(lambda opt, args, kwargs: self._boundary())
            )
            self.step_boundary = f"{type(self._optimizer).__name__}.step post-hook"
        # The ranks agree once DDP's counter is known (a forward or two after this one).
        self._agreement_key = f"rankscope/attach/{attacher.job}/{self.group or '-'}"

    def _install_param_hooks(self, model) -> None:
        seen = set()
        for _, p in model.module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._params.append(p)
        for i, p in enumerate(self._params):
            self._hook_handles.append(p.register_hook(self._param_hook(i, p)))

    def _param_hook(self, index: int, param):
        ref = weakref.ref(param)

        def hook(grad):
            mon = self.monitor
            p = ref()
            if mon is None or p is None or not mon._active or not self._sync_backward:
                return None
            # The local gradient of the step: this backward's plus what no_sync() micro-batches
            # accumulated (DDP has not reduced anything yet; it does after accumulation).
            local = grad if p.grad is None else grad + p.grad
            mon.local_gradient(local, [p], index=index)
            return None

        return hook

    # ---- the step boundary ------------------------------------------------------------------

    def _boundary(self) -> None:
        mon = self.monitor
        if mon is None or self.state in ("failed", "closed"):
            return
        try:
            loss, _ = self._attacher.capture.take()
            if self._params and mon._active:
                for i, p in enumerate(self._params):
                    if p.grad is not None:
                        mon.reduced_gradient(p.grad, i)
            mon.step(loss)
        except Exception as e:  # attaching must never break training
            self._fail(e)

    # ---- state ------------------------------------------------------------------------------


class AutoAttacher:
    """The process's attachments: ``add`` a DDP model, read ``describe()``.

    ``options`` are ``rankscope.torch.attach`` keyword arguments (collector, sketch_dim, ...);
    ``dormant`` keeps the monitors switched off until ``rankscope ctl enable``.
    """

    def __init__(
        self, job: str, dormant: bool, options: dict, on_change: Callable[[], None] | None = None
    ):
        self.job = job
        self.dormant = bool(dormant)
        self.options = dict(options)
        self.capture = _loss_capture.install()
        self.models: list[AttachedModel] = []
        self._optimizers: list = []  # weak references to the optimizers last found on the heap
        self._on_change = on_change
        self._warned = set()

    def add(self, model):
        """Attaches ``model`` (a DDP model, or a root FSDP2 module found in a live process) at
        its next forward; None if it already is (or, for FSDP2, the script watches it)."""
        if type(model) is not DDP:
            return self.add_fsdp2(model, _fsdp2_attach.CLOCK_COLLECTIVES)
        for m in self.models:
            if m._model() is model:
                return None
        m = AttachedModel(self, model)
        self.models.append(m)
        self.changed()
        return m

    def add_fsdp2(self, model, clock: str, in_forward: bool = False):
        """Attaches a root FSDP2 module (rankscope._fsdp2_attach) at its next forward with
        gradients, or, ``in_forward`` (called from inside the root's first forward, before its
        backward), at this one; ``clock`` as there. None if it is already attached or watched
        (``rst.attach`` in the script, a framework's callback)."""
        if self.covers(model) or _fsdp2_attach.is_watched(model):
            return None
        m = _fsdp2_attach.AttachedFsdp2(self, model, clock)
        self.models.append(m)
        self.changed()
        if in_forward:
            m._pre_forward(model, ())
        return m

    def add_fsdp1(self, model):
        """Attaches an FSDP1 root (rankscope._fsdp1_attach; called from inside its first forward,
        before its backward) at this forward if it runs with gradients, else at its next one that
        does. None if it is already attached or has a comm hook (``rst.attach`` in the script:
        rankscope's; the script's own: warned, left unwatched)."""
        from rankscope import _fsdp1_attach
        from rankscope.frameworks import fsdp1

        if self.covers(model):
            return None
        hook = _fsdp1_attach.comm_hook_of(model)
        if hook is not None:
            if hook is not fsdp1._fsdp1_hook:
                self.warn(
                    "rankscope: an FSDP1 model has its own comm hook "
                    f"({getattr(hook, '__qualname__', hook)!s}); the zero-code launch leaves it "
                    "unwatched (rst.attach(model, comm_hook=...) before the first forward chains "
                    "to it)"
                )
            return None
        m = _fsdp1_attach.AttachedFsdp1(self, model)
        self.models.append(m)
        self.changed()
        m._pre_forward(model, ())
        return m

    def add_megatron(self, model):
        """Attaches a Megatron-core DDP model (rankscope._megatron_attach) at its next forward
        with gradients; None if it is already attached."""
        from rankscope import _megatron_attach

        if self.covers(model):
            return None
        m = _megatron_attach.AttachedMegatron(self, model)
        self.models.append(m)
        self.changed()
        return m

    def optimizer_for(self, model):
        """The optimizer that steps ``model`` (optimizer_of): the optimizers the payload found
        (live attach) serve first; a scan of the heap (one more gc walk on the training thread)
        only when none of them holds the model."""
        optimizer = optimizer_of(model, self.known_optimizers())
        if optimizer is None:
            _, found = find_models_and_optimizers()
            self.remember_optimizers(found)
            optimizer = optimizer_of(model, found)
        return optimizer

    def release(self, model) -> bool:
        """Stops attaching ``model`` if its monitor is not installed yet (rankscope.frameworks
        then watches it through the framework); False if it is."""
        for m in self.models:
            if m._model() is model:
                if m.state != "waiting":
                    return False
                if m._pre_hook is not None:
                    m._pre_hook.remove()
                    m._pre_hook = None
                m.state = "closed"
                self.models.remove(m)
                self.changed()
        return True

    def remember_optimizers(self, optimizers) -> None:
        """Keeps (weakly: the script owns them) the optimizers a heap scan found."""
        self._optimizers = [weakref.ref(o) for o in optimizers]

    def known_optimizers(self) -> list:
        return [o for o in (r() for r in self._optimizers) if o is not None]

    def covers(self, model) -> bool:
        return any(m._model() is model for m in self.models)

    def group_for(self, attached: AttachedModel, model) -> str:
        """The group of a DDP model (group_for_process_group)."""
        return self.group_for_process_group(
            attached, model.process_group, type(model.module).__name__
        )

    def group_for_process_group(self, attached, process_group, class_name: str) -> str:
        """The group of a model: derived from its process group, and, when another model of this
        process already reports that group, suffixed with the module's class name (a GAN's
        generator and discriminator), the same on every rank."""
        base = rst.data_parallel_group(process_group)
        taken = {m.group for m in self.models if m is not attached and m.group is not None}
        if base not in taken:
            return base
        name = class_name.lower()[:40] or "model"
        candidate, i = (f"{base}-{name}" if base else name), 1
        while candidate in taken:
            i += 1
            candidate = f"{base}-{name}{i}" if base else f"{name}{i}"
        return candidate

    def describe(self) -> list[dict]:
        return [m.describe() for m in self.models]

    def changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:
                pass

    def warn(self, message: str) -> None:
        if message in self._warned:
            return
        self._warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


_current: AutoAttacher | None = None


def current() -> AutoAttacher | None:
    """The process's AutoAttacher, if something attached from outside the script."""
    return _current


def get_or_create(
    job: str, dormant: bool, options: dict, on_change: Callable[[], None] | None = None
) -> AutoAttacher:
    global _current
    if _current is None:
        _current = AutoAttacher(job, dormant, options, on_change)
    return _current
