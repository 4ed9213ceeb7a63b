"""Loss capture for scripts that never call ``mon.step(loss)`` (zero-code launch and
``rankscope attach --pid``): a wrapper around ``torch.autograd.backward``, which
``Tensor.backward`` calls, records every one-element tensor that a backward starts from.

``take()`` at an optimizer step returns the mean of the losses recorded since the previous
``take()`` (several under gradient accumulation; their sum once ``sum_losses`` is set, for the
Hugging Face and Lightning Trainers, which divide each by the accumulation steps) as a tensor
on the loss's device, so that reading
it never synchronizes with a GPU here; the monitor's deferred reports read it later.

Contract: the wrapper only records (a detached reference, no copy, no device read) and always
calls the original with the same arguments; it never raises on its own account. Installing twice
is a no-op. With ``torch.cuda.amp.GradScaler`` the recorded loss is the scaled one.

Thread safety: backward and ``take`` run on the training thread.
"""

import torch

_installed = None  # the LossCapture, once installed


class LossCapture:
    """The process's backward wrapper and the losses it recorded since the last ``take``."""

    def __init__(self):
        self._losses = []
        self._original = torch.autograd.backward
        self.last_count = 0  # backward calls that made the last taken loss
        # Sum instead of mean: for frameworks that divide each micro-batch's loss by the
        # accumulation steps before backward (Hugging Face, Lightning; rankscope._attach_payload).
        self.sum_losses = False

    def record(self, tensors) -> None:
        t = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
        if isinstance(t, torch.Tensor) and t.numel() == 1 and len(self._losses) < 4096:
            self._losses.append(t.detach())

    def take(self) -> tuple[torch.Tensor | None, int]:
        """(mean loss since the previous take, number of backward calls); (None, 0) if none."""
        losses, self._losses = self._losses, []
        self.last_count = len(losses)
        if not losses:
            return None, 0
        if len(losses) == 1:
            return losses[0].reshape(()), 1
        try:
            stacked = torch.stack([x.reshape(()).to(torch.float32) for x in losses])
            return (stacked.sum() if self.sum_losses else stacked.mean()), len(losses)
        except Exception:  # losses on several devices: the last one stands for the step
            return losses[-1].reshape(()), len(losses)


def install() -> LossCapture:
    """Wraps ``torch.autograd.backward`` (once per process) and returns the capture."""
    global _installed
    if _installed is not None:
        return _installed
    capture = LossCapture()
    original = capture._original

    def backward(tensors, *args, **kwargs):
        try:
            capture.record(tensors)
        except Exception:  # capturing must never break training
            pass
        return original(tensors, *args, **kwargs)

    backward.__wrapped__ = original
    backward.__doc__ = original.__doc__
    torch.autograd.backward = backward
    _installed = capture
    return capture
