"""Lightning (``lightning.pytorch``): ``attach(trainer)`` or ``attach(lightning_module)``, DDP
strategy.

A Callback does the work. At ``on_train_start`` the strategy has wrapped the module in
DistributedDataParallel (``trainer.strategy.model``); the callback attaches rankscope's DDP comm
hook to it (``rankscope.torch.attach``). Under ``accumulate_grad_batches`` Lightning runs every
micro-batch but the last under DDP's ``no_sync``, so the buckets hold this rank's local gradient
summed over the step's micro-batches, each of ``loss / accumulate_grad_batches`` (Lightning's
scaling), unreduced.

The step's loss is the sum over the step's micro-batches of ``outputs["loss"]`` at
``on_train_batch_end`` (Lightning's normalized closure loss: the micro-batch loss divided by
``accumulate_grad_batches``), i.e. the mean micro-batch loss. The step closes at the
``on_train_batch_end`` of the micro-batch whose optimizer step ran (a step post-hook on the
torch optimizer says so), numbered from ``trainer.global_step`` at ``on_train_start``. Replica
fingerprints are DDP's: the reduced gradient of every step and the parameters every
``param_check_every`` steps.

Refused with one warning naming the version and strategy, training left unwatched: a model that
is not a DDP model at ``on_train_start`` (one device, FSDP, DeepSpeed), manual optimization, or
more than one optimizer.
"""

import warnings

import torch

from rankscope import frameworks
from rankscope import torch as rst

__all__ = ["attach"]


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:  # the older standalone package
        import pytorch_lightning as pl
    return pl


def _callback(options: dict):
    pl = _lightning()

    class RankscopeCallback(pl.Callback):
        """Attaches at ``on_train_start``; closes a step after each optimizer step."""

        _rankscope = True

        def __init__(self):
            self.monitor = None
            self.refused = ""
            self._losses = []
            self._stepped = False
            self._handle = None

        def _refuse(self, why: str) -> None:
            self.refused = (
                f"rankscope: Lightning {pl.__version__} {why}; this model is not watched, "
                "training is unaffected"
            )
            warnings.warn(self.refused, RuntimeWarning, stacklevel=2)

        def on_train_start(self, trainer, pl_module):
            if self.monitor is not None or self.refused:
                return
            model = trainer.strategy.model
            strategy = type(trainer.strategy).__name__
            if type(model) is not torch.nn.parallel.DistributedDataParallel:
                self._refuse(f"with {strategy} trains a {type(model).__name__}, not DDP")
                return
            if not pl_module.automatic_optimization:
                self._refuse(f"with {strategy} and manual optimization")
                return
            if len(trainer.optimizers) != 1:
                self._refuse(f"with {strategy} and {len(trainer.optimizers)} optimizers")
                return
            if not frameworks.release_ddp(model):
                return  # the zero-code DDP attachment already watches it
            opts = dict(options)
            opts.setdefault("start_step", int(trainer.global_step))
            try:
                self.monitor = rst.attach(model, **opts)
            except Exception as e:  # attaching must never break training
                self._refuse(f"with {strategy}: attach failed ({e!r})")
                return
            self.monitor.framework = f"lightning {pl.__version__} {strategy}"
            self._handle = trainer.optimizers[0].register_step_post_hook(self._optimizer_stepped)

        def _optimizer_stepped(self, *args):
            self._stepped = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.monitor is None:
                return
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self._losses.append(loss.detach().reshape(()).float())
            if not self._stepped:
                return
            self._stepped = False
            losses, self._losses = self._losses, []
            self.monitor.step(torch.stack(losses).sum() if losses else None)

        def on_train_end(self, trainer, pl_module):
            if self.monitor is not None:
                self.monitor.flush(timeout=5.0)

    return RankscopeCallback()


def attach(obj, **options):
    """Attaches rankscope to a ``lightning.pytorch.Trainer`` (before ``fit``) or a
    ``LightningModule`` (its trainer's, or the callbacks its ``configure_callbacks`` returns at
    ``fit``); ``options`` are ``rankscope.torch.attach``'s. Returns the Callback; its ``monitor``
    is the Monitor once training started (None before, or when refused: ``refused`` says why)."""
    pl = _lightning()
    if isinstance(obj, pl.LightningModule):
        trainer = getattr(obj, "_trainer", None)
        if trainer is None:
            cb = _callback(options)
            original = obj.configure_callbacks

            def configure_callbacks():
                found = original()
                found = [found] if isinstance(found, pl.Callback) else list(found or [])
                trainer = getattr(obj, "_trainer", None)
                if trainer is not None and any(
                    getattr(c, "_rankscope", False) for c in trainer.callbacks
                ):
                    return found  # the trainer is watched already (the zero-code launch)
                return [*found, cb]

            obj.configure_callbacks = configure_callbacks
            return cb
        obj = trainer
    for cb in obj.callbacks:
        if getattr(cb, "_rankscope", False):
            return cb
    cb = _callback(options)
    obj.callbacks.append(cb)
    return cb
