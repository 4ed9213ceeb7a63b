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
optimizer that steps the model (``_optimizer_for``):

- Megatron's ``FP32Optimizer`` wraps a ``torch.optim`` optimizer of the model's own parameters.
- ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer`` of bf16/fp16 parameters wrap
  one of float32 main parameters: whole copies (``param.main_param``) or this rank's shards of
  them (``param.main_param`` with ``main_param_sharded``). That optimizer is found by those
  tensors; its ``step`` runs once a Megatron step (``step_with_ready_grads``) unless Megatron
  skips the step, which it does only with a loss scaler (fp16, or bf16 with ``loss_scale``) on
  an overflow. ``DistributedOptimizer`` of float32 parameters steps shard views into the
  parameter buffer (no ``main_param``): not found, the attachment fails with a warning saying so
  (docs/shim.md "Limits"). So does a rank whose shard is empty (Megatron's stub optimizer).
- A Megatron optimizer with a grad scaler is refused (the attachment fails, warned, naming
  megatron-core's version and the optimizer): the gradients its buffers hold are the loss
  scale times the local gradient, and the steps it skips would not be boundaries. fp16 models are
  refused earlier by the model path (rankscope.frameworks.megatron) for the same reason.

The local gradient is read where ``rst.attach(model)`` reads it (each bucket group's
``start_grad_sync``), in the gradient buffer's dtype (bf16 unless ``grad_reduce_in_fp32``).

The loss: Megatron's schedules backpropagate each micro-batch's loss divided by the number of
micro-batches, so the step's loss is the sum of the backward losses (the loss capture's
``sum_losses``, set for the process when a Megatron model is installed).

Contract: nothing here raises into the training script; failures are warned through the
attacher. Thread safety: training thread only.
"""

import gc
import sys

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
        self._wrapper = None
        super()._install(model)
        if self._wrapper is not None:
            self.step_boundary = f"{self._wrapper}: {self.step_boundary}"
        self._attacher.capture.sum_losses = True  # see the module docstring

    def _optimizer_for(self, model):
        """The torch.optim optimizer that steps the model's parameters or Megatron's main
        parameters of them (see the module docstring); RuntimeError when none, or when
        Megatron's optimizer scales the loss."""
        optimizer = self._attacher.optimizer_for(model)
        if optimizer is not None:
            return optimizer
        # The lookup above scanned the heap: the process's optimizers are known now.
        optimizer = _optimizer_of_main_params(model, self._attacher.known_optimizers())
        mode = f"megatron-core {megatron._version()}"
        if optimizer is None:
            raise RuntimeError(
                f"{mode}: no torch.optim optimizer holds the parameters of {self.KIND} or "
                "Megatron's main parameters of them (its step is the step boundary such a model "
                "is watched by)"
            )
        wrapper = _megatron_optimizer_of(optimizer)
        if wrapper is None:
            raise RuntimeError(
                f"{mode}: no Megatron optimizer wraps the {type(optimizer).__name__} that steps "
                f"the main parameters of {self.KIND}"
            )
        name = type(wrapper).__name__
        if getattr(wrapper, "grad_scaler", None) is not None:
            raise RuntimeError(
                f"{mode} {name} with a loss scale (a grad scaler: fp16, or bf16 with "
                "loss_scale) is not watched: Megatron's gradient buffers hold the scaled "
                "gradients and it skips the steps that overflow"
            )
        self._wrapper = name
        return optimizer


def _optimizer_of_main_params(model, optimizers):
    """The first of ``optimizers`` that holds Megatron's float32 main parameter (whole, or this
    rank's shard: ``param.main_param``, which does not require a gradient) of one of the
    model's parameters, or None."""
    module = getattr(model, "module", model)
    ids = {
        id(p.main_param)
        for p in module.parameters()
        if p.requires_grad and getattr(p, "main_param", None) is not None
    }
    for opt in optimizers if ids else ():
        for group in opt.param_groups:
            if any(id(p) in ids for p in group["params"]):
                return opt
    return None


def _megatron_optimizer_of(optimizer):
    """The Megatron optimizer (``MegatronOptimizer`` subclass, not the chain) whose ``optimizer``
    is ``optimizer``, or None. One heap walk (at install, on the training thread)."""
    module = sys.modules.get("megatron.core.optimizer.optimizer")
    base = getattr(module, "MegatronOptimizer", None)
    if base is None:
        return None
    for o in gc.get_objects():
        t = type(o)
        if isinstance(t, type) and issubclass(t, base):
            if getattr(o, "__dict__", {}).get("optimizer") is optimizer:
                return o
    return None
