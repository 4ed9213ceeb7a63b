"""What every model attached from outside the training script shares (rankscope._autoattach's
DDP models, rankscope._fsdp2_attach's FSDP2 roots): the state a ``rankscope attach`` reads back
(``describe``), and the one way an attachment fails.

States: ``waiting`` -> ``agreeing`` -> ``agreed`` -> ``reporting``, or ``failed``/``closed``.
Contract: a failure is warned once through the attacher, removes every hook the attachment
registered (they become pass-throughs where torch cannot remove them), closes its monitor
without waiting, and is kept in ``error``; nothing raises into the training script. Thread
safety: the training thread only.
"""

import weakref

import torch.distributed as dist


class Attachment:
    """The common part; a subclass sets ``KIND`` (how the warning names the model), registers its
    forward pre-hook in ``_pre_hook`` and its other hooks in ``_hook_handles``, and may add to
    ``describe`` through ``_describe_more``."""

    KIND = "a model"

    def __init__(self, attacher, model, rank: int, world_size: int):
        self._attacher = attacher
        self._model = weakref.ref(model)
        self.state = "waiting"
        self.path = ""
        self.group = None
        self.rank = rank
        self.world_size = world_size
        self.global_rank = dist.get_rank()
        self.start_step: int | None = None
        self.step_boundary = ""
        self.error = ""
        self.monitor = None
        self._optimizer = None
        self._hook_handles = []
        self._pre_hook = None

    def describe(self) -> dict:
        d = {
            "state": self.state,
            "path": self.path,
            "group": self.group or "",
            "rank": self.rank,
            "world_size": self.world_size,
            "global_rank": self.global_rank,
            "start_step": self.start_step,
            "step_boundary": self.step_boundary,
            "error": self.error,
        }
        self._describe_more(d)
        d["backward_calls_per_step"] = self._attacher.capture.last_count
        return d

    def _describe_more(self, d: dict) -> None:
        """Adds the subclass's own keys to ``describe()``'s dict."""

    def _remove_pre_hook(self) -> None:
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None

    def _changed(self, state: str) -> None:
        self.state = state
        self._attacher.changed()

    def _fail(self, e: Exception) -> None:
        self.error = f"{type(e).__name__}: {e}"
        self.state = "failed"
        self._remove_pre_hook()
        for h in self._hook_handles:
            try:
                h.remove()
            except Exception:
                pass
        self._hook_handles = []
        if self.monitor is not None:
            try:
                self.monitor.close(timeout=0)
            except Exception:
                pass
        self._attacher.warn(
            f"rankscope: could not attach to {self.KIND} ({self.error}); training is unaffected"
        )
        self._attacher.changed()


def hand_over_when_built(cls, attacher, add, kind: str) -> None:
    """(zero-code launch) Wraps ``cls.__init__`` so that every instance of exactly ``cls`` (not a
    subclass, whose own ``__init__`` may not have finished) is passed to ``add`` once built. A
    failure of ``add`` is warned through ``attacher`` ("could not attach to ``kind``"), never
    raised into the script. Wrapping an already wrapped class does nothing."""
    original = cls.__init__
    if getattr(original, "_rankscope", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if type(self) is cls:
            try:
                add(self)
            except Exception as e:  # attaching must never break the script
                attacher.warn(f"rankscope: could not attach to {kind} ({e!r})")

    __init__._rankscope = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__
