"""Hugging Face Trainer: ``attach(trainer)`` (accelerate's DDP, FSDP and DeepSpeed backends).

The Trainer builds its data-parallel model inside ``train()`` (accelerate's ``prepare``), so
``attach`` adds a TrainerCallback; at ``on_train_begin`` the model is built and the callback
attaches rankscope to ``trainer.model_wrapped`` (``rankscope.torch.attach``):

- DDP backend: rankscope's DDP comm hook. Under gradient accumulation the Trainer runs every
  micro-batch but the last under ``accelerator.no_sync``, so the buckets hold this rank's local
  gradient summed over the step's micro-batches, each of ``loss / gradient_accumulation_steps``
  (the Trainer's scaling), unreduced.
- FSDP backend (``fsdp=...``, ``fsdp_config={"fsdp_version": 2}``): accelerate applies
  ``fully_shard``; the model is an FSDP2 module and rankscope's FSDP2 path watches it
  (rankscope.frameworks.fsdp2: each parameter group's unsharded local gradient before the
  reduce-scatter). accelerate's ``no_sync`` does not stop FSDP2's reduction, so FSDP2 reduces
  every micro-batch: with ``gradient_accumulation_steps > 1`` the callback passes
  ``accumulate_local_grad=True`` (unless given), so every step's norm is the exact norm of the
  micro-batches' sum from the first step. FSDP1 (``fsdp_version`` 1) goes to the FSDP1 path
  (its comm hook is registered at ``on_train_begin``, before the first forward, as FSDP1
  requires). accelerate 1.15 builds FSDP only on an accelerator (its state enables FSDP for the
  multi-GPU/XPU/... types, and its FSDP1 plugin requires a device); the tests run the FSDP2
  backend on the CPU by setting that state's distributed type (tests/python/framework_harness.py).

The step's loss is the sum of what ``trainer.training_step`` returned over the step's micro-batches
(the Trainer's own ``tr_loss`` accounting: each is the micro-batch loss already divided by the
accumulation steps, or normalized by the step's item count when the model takes
``num_items_in_batch``), i.e. the loss the Trainer logs for that step. The step closes at
``on_optimizer_step``, numbered from ``state.global_step``. Replica fingerprints are DDP's: the
reduced gradient of every step and the parameters every ``param_check_every`` steps, identical on
every rank.

- DeepSpeed backend (``deepspeed=config``): accelerate builds a DeepSpeedEngine, which
  ``trainer.model_wrapped`` holds; rankscope.frameworks.deepspeed watches it (the engine's own
  ``step`` closes rankscope's steps; the Trainer passes ``scale_wrt_gas=False`` to its
  ``backward``, so the step's loss is the sum of the Trainer's pre-divided micro-batch losses).

Replica fingerprints under FSDP: none (no two ranks hold the same shard); see fsdp2.py. Under
DeepSpeed: the deepspeed module's (parameters for ZeRO 0-2).

Refused with one warning naming the version and backend, the Trainer left unwatched: a model
that is neither a DDP, an FSDP nor a DeepSpeed model at ``on_train_begin`` (one process,
DataParallel), and what those paths refuse (their own warning names the version and the mode).
"""

import warnings

import torch

from rankscope import frameworks
from rankscope import torch as rst
from rankscope.frameworks._local_grads import Unwatched

__all__ = ["attach", "RankscopeCallback"]


def _transformers_version() -> str:
    try:
        import transformers

        return str(transformers.__version__)
    except Exception:
        return "unknown"


def _callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class _Losses:
    """Sums the losses ``training_step`` returns between optimizer steps."""

    def __init__(self):
        self.values = []

    def take(self):
        values, self.values = self.values, []
        if not values:
            return None
        if len(values) == 1:
            return values[0]
        return torch.stack([v.reshape(()).float() for v in values]).sum()


def _backend(model) -> str:
    """ "ddp", "fsdp2", "fsdp1" for the model the Trainer built, or "" (not watched)."""
    if type(model) is torch.nn.parallel.DistributedDataParallel:
        return "ddp"
    from rankscope.frameworks import fsdp1, fsdp2

    if fsdp2.is_fsdp2(model):
        return "fsdp2"
    if fsdp1.is_fsdp1(model):
        return "fsdp1"
    if frameworks.framework_of(model) == "deepspeed":
        return "deepspeed"
    return ""


def RankscopeCallback(trainer, options: dict):  # noqa: N802 (a class factory)
    """A TrainerCallback (transformers is imported only here) that attaches rankscope to
    ``trainer``'s DDP model when training begins and closes a step at each optimizer step."""
    base = _callback_base()

    class _Callback(base):
        def __init__(self):
            self.monitor = None
            self.refused = ""
            self._closes_steps = True
            self._losses = _Losses()
            self._trainer = trainer
            self._wrap_training_step(trainer)

        def _wrap_training_step(self, t):
            original = t.training_step
            losses = self._losses

            def training_step(*args, **kwargs):
                loss = original(*args, **kwargs)
                if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                    losses.values.append(loss.detach().reshape(()))
                return loss

            training_step.__wrapped__ = original
            t.training_step = training_step

        def on_train_begin(self, args, state, control, **kwargs):
            if self.monitor is not None or self.refused:
                return
            model = self._trainer.model_wrapped
            backend = _backend(model)
            if not backend:
                self.refused = (
                    f"rankscope: the Hugging Face Trainer (transformers "
                    f"{_transformers_version()}) trains a {type(model).__name__}, not a "
                    "DistributedDataParallel, FSDP or DeepSpeed model; only those backends are "
                    "watched, training is unaffected"
                )
                warnings.warn(self.refused, RuntimeWarning, stacklevel=2)
                return
            if backend == "ddp" and not frameworks.release_ddp(model):
                return  # the zero-code DDP attachment already watches it
            opts = dict(options)
            opts.setdefault("start_step", int(state.global_step))
            opts.setdefault("local_batch_size", int(args.per_device_train_batch_size))
            if backend.startswith("fsdp") and int(args.gradient_accumulation_steps) > 1:
                opts.setdefault("accumulate_local_grad", True)  # FSDP reduces every micro-batch
            try:
                if backend == "deepspeed":  # the engine's step closes the steps
                    from rankscope.frameworks import deepspeed

                    monitor = deepspeed.attach(model, **opts)
                else:
                    monitor = rst.attach(model, **opts)
            except Exception as e:  # attaching must never break training
                self.refused = f"rankscope: could not attach to the Trainer's model ({e!r})"
                warnings.warn(self.refused, RuntimeWarning, stacklevel=2)
                return
            if isinstance(monitor, Unwatched):  # the FSDP path warned, naming torch and mode
                self.refused = monitor.reason
                return
            self.monitor = monitor
            self._closes_steps = backend != "deepspeed"
            if backend == "deepspeed":
                monitor.framework = f"transformers {_transformers_version()} {monitor.framework}"
            else:
                monitor.framework = f"transformers {_transformers_version()} {backend}"
            self._losses.take()

        def on_optimizer_step(self, args, state, control, **kwargs):
            mon = self.monitor
            if mon is not None and self._closes_steps:
                mon.step(self._losses.take(), step=int(state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            if self.monitor is not None:
                self.monitor.flush(timeout=5.0)

    return _Callback()


def attach(trainer, **options):
    """Attaches rankscope to a ``transformers.Trainer`` before ``trainer.train()``; ``options``
    are ``rankscope.torch.attach``'s. Returns the callback; its ``monitor`` is the Monitor once
    training began (None before, or when refused: ``refused`` says why)."""
    for cb in trainer.callback_handler.callbacks:
        if getattr(cb, "_rankscope", False):
            return cb
    cb = RankscopeCallback(trainer, options)
    cb._rankscope = True
    trainer.add_callback(cb)
    return cb
