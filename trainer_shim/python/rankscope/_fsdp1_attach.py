"""FSDP1 (``FullyShardedDataParallel``) roots attached by the zero-code launch (``python -m
rankscope.run``, ``RANKSCOPE_AUTO=1``). The FSDP2 side (rankscope._fsdp2_attach) holds the clock,
the start agreement and the attachment's states; this module only finds FSDP1 roots and says how
an FSDP1 root differs (its process group, the path's name).

Finding the roots. FSDP1 decides which instance is the root (the one whose ``register_comm_hook``
reaches every unit, rankscope.frameworks.fsdp1) in its lazy initialization: the first instance
that runs ``_lazy_init`` (normally from its forward; also from a ``state_dict`` call or
``check_is_root``) becomes the root and marks every FSDP1 instance below it non-root. The
zero-code launch wraps ``FullyShardedDataParallel.forward`` (a post-import hook on its module;
``patch_fsdp1_module``): at each instance's first forward the wrapper asks ``check_is_root()``
(which runs the lazy initialization the forward would run first anyway, once) and hands a root
to the attacher, inside that forward, before its backward. A nested unit's first forward runs
inside the root's, after the root's lazy initialization made it non-root: it is skipped.

Why inside the forward, not at ``__init__``: at construction nobody knows yet whether another
FSDP1 instance will wrap this one. ``register_comm_hook`` (read in torch 2.15) asserts only that
the instance is the root and that no hook is registered yet; FSDP1 reads the hook in each unit's
post-backward, so registering between the first forward and its backward is in time.

The clock: optimizer steps since the first forward with gradients (``CLOCK_STEPS``), as for
FSDP2's zero-code launch, with the same ``ClockStart`` agreement; the step boundary is the
optimizer's step post-hook. A root whose units already have a comm hook (the script's own, or
``rst.attach`` in the script) is left alone (warned for a hook of its own).

Not done: a live ``rankscope attach --pid`` to an FSDP1 job (the heap walk finds no FSDP1 roots;
docs/shim.md "Limits").

Contract: nothing here raises into the training script; failures are warned through the
attacher. Thread safety: training thread only.
"""

import torch.distributed as dist

from rankscope._fsdp2_attach import CLOCK_STEPS, AttachedFsdp2

# FSDP1's module, where ``FullyShardedDataParallel`` is defined (torch 2.x).
FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"

_SEEN = "_rankscope_seen"  # in an instance's __dict__ once its first forward was looked at


def comm_hook_of(model):
    """The comm hook registered on the FSDP1 model's units, or None."""
    from torch.distributed.fsdp import _traversal_utils

    for state in _traversal_utils._get_fsdp_states(model):
        hook = getattr(state, "_comm_hook", None)
        if hook is not None:
            return hook
    return None


def patch_fsdp1_module(module, attacher) -> None:
    """(zero-code launch) Wraps ``FullyShardedDataParallel.forward`` of FSDP1's module so that
    every FSDP1 root is handed to ``attacher`` at its first forward (see the module docstring)."""
    cls = getattr(module, "FullyShardedDataParallel", None)
    forward = getattr(cls, "forward", None)
    if forward is None or not hasattr(cls, "check_is_root"):
        attacher.warn(
            "rankscope: this torch's FullyShardedDataParallel has no forward/check_is_root; FSDP1 "
            "models are not attached by the zero-code launch (rst.attach(model) in the script "
            "watches them)"
        )
        return
    if getattr(forward, "_rankscope", False):
        return

    def forward_wrapper(self, *args, **kwargs):
        if _SEEN not in self.__dict__:
            self.__dict__[_SEEN] = True
            try:
                if self.check_is_root():
                    attacher.add_fsdp1(self)
            except Exception as e:  # attaching must never break the script
                attacher.warn(f"rankscope: could not attach to an FSDP1 model ({e!r})")
        return forward(self, *args, **kwargs)

    forward_wrapper._rankscope = True
    forward_wrapper.__wrapped__ = forward
    cls.forward = forward_wrapper


class AttachedFsdp1(AttachedFsdp2):
    """One FSDP1 root attached by the zero-code launch: AttachedFsdp2 on the optimizer-step clock,
    with FSDP1's process group and comm hook path (rankscope.frameworks.fsdp1)."""

    KIND = "an FSDP1 model"
    PATH = "comm hook"

    def __init__(self, attacher, model):
        super().__init__(attacher, model, CLOCK_STEPS)

    @staticmethod
    def _process_group(model):
        return model.process_group or dist.group.WORLD

    @staticmethod
    def _class_name(model) -> str:
        return type(getattr(model, "module", model)).__name__
