"""Megatron-core ``DistributedDataParallel`` models attached by the zero-code launch (``python -m
rankscope.run``, ``RANKSCOPE_AUTO=1``). rankscope._fsdp2_attach holds the clock, the start
agreement and the attachment's states; this module finds the models and says how one differs.

Finding the models. The zero-code launch wraps ``DistributedDataParallel.__init__`` of megatron-core
(a post-import hook on its module, as for the Hugging Face and Lightning Trainers;
``patch_ddp_module``): every model of exactly that class is handed to the attacher when built.
It is attached at its first forward with gradients, as ``rst.attach(model)`` would be in the
script (rankscope.frameworks.megatron: ``start_grad_sync`` of each bucket group wrapped; refused
with one warning for what that path refuses). A model the script attached itself before that
forward (``rst.attach(model)``: its bucket groups' ``start_grad_sync`` already wrapped) is
released, never retargeted away from the script's monitor.

The clock: optimizer steps since that forward (``CLOCK_STEPS``, FSDP2's zero-code clock, the same
``ClockStart`` agreement); the step boundary is the step post-hook of the ``torch.optim``
optimizer that holds the model's parameters. Megatron's ``FP32Optimizer`` wraps one; its fp16/bf16
and distributed optimizers step fp32 copies (main parameters): where no ``torch.optim`` optimizer
holds any of the model's own parameters, the attachment fails with a warning saying so and the
model is left unwatched (docs/shim.md "Limits").

The loss: Megatron's schedules backpropagate each micro-batch's loss divided by the number of
micro-batches, so the step's loss is the sum of the backward losses (the loss capture's
``sum_losses``, set for the process when a Megatron model is installed).

Contract: nothing here raises into the training script; failures are warned through the
attacher. Thread safety: training thread only.
"""

import torch

from rankscope._attachment import hand_over_when_built
from rankscope._fsdp2_attach import CLOCK_STEPS, AttachedFsdp2
from rankscope.frameworks import megatron

# megatron-core's module where ``DistributedDataParallel`` is defined (0.19).
DDP_MODULE = "megatron.core.distributed.distributed_data_parallel"


def is_watched(model) -> bool:
    """True when rankscope already watches the Megatron model (``rst.attach`` in the script): a
    bucket group's ``start_grad_sync`` is rankscope's wrapper."""
    return any(
        hasattr(getattr(g, "start_grad_sync", None), "_rankscope_target")
        for g in getattr(model, "bucket_groups", ())
    )


def patch_ddp_module(module, attacher) -> None:
    """(zero-code launch) Wraps ``DistributedDataParallel.__init__`` of megatron-core so that every
    model of exactly that class is handed to ``attacher`` once built."""
    cls = getattr(module, "DistributedDataParallel", None)
    if cls is not None:
        hand_over_when_built(cls, attacher, attacher.add_megatron, "a Megatron-core DDP model")


class AttachedMegatron(AttachedFsdp2):
    """One Megatron-core DDP model attached by the zero-code launch: AttachedFsdp2 on the
    optimizer-step clock, with Megatron's data-parallel group and bucket path."""

    KIND = "a Megatron-core DDP model"
    PATH = "start_grad_sync buckets"

    def __init__(self, attacher, model):
        super().__init__(attacher, model, CLOCK_STEPS)

    @staticmethod
    def _process_group(model):
        """The group the first bucket group reduces over (rst.attach refuses models whose
        bucket groups reduce over different ones)."""
        cfg = getattr(model, "ddp_config", None)
        attr = megatron._group_attribute(bool(getattr(cfg, "use_distributed_optimizer", False)))
        for g in getattr(model, "bucket_groups", ()):
            return getattr(g, attr, None)
        return None

    @staticmethod
    def _class_name(model) -> str:
        return type(getattr(model, "module", model)).__name__

    def _pre_forward(self, module, inputs):
        if self.state == "waiting" and torch.is_grad_enabled() and is_watched(module):
            self._attacher.release(module)  # the script's rst.attach watches it
            return None
        return super()._pre_forward(module, inputs)

    def _install(self, model) -> None:
        super()._install(model)
        self._attacher.capture.sum_losses = True  # see the module docstring
