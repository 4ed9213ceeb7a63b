"""DDP's iteration counter, read from outside the script (rankscope._autoattach).

Ranks attached at different wall times agree on their first step, and number their steps, by
DDP's own iteration counter: the number of forwards with gradients that synchronize
(``torch.is_grad_enabled() and model.require_backward_grad_sync``), the same on every rank of a
group, one per optimizer step under gradient accumulation. Since torch 2.0 DDP keeps it only in
its C++ reducer, which hands it out in the runtime statistics of ``_get_ddp_logging_data()``
(``"iteration"``), recorded at DDP's sampled iterations (the first ten, then every
``sample_rate``-th, 100 by default). So the clock asks DDP to sample every iteration
(``_set_ddp_runtime_logging_sample_rate(1)``), reads the counter after two synchronizing
forwards, counts forwards itself from then on and puts DDP's default rate (100) back. Sampling
costs DDP what it already pays at its first ten iterations (on CUDA, waiting for the previous
iteration's timing events, mostly finished by then).

Contract: ``before_forward`` is called from the model's forward pre-hook at every forward, on the
training thread; it returns the counter as it stands before that forward (what the forward's
report will be numbered), or None while it is not known yet (the first two synchronizing
forwards after the first call). Raises RuntimeError when DDP records no counter at all.
"""

import torch

# DDP's default runtime-statistics sample rate (kDDPRuntimeLoggingSampleRate in torch's
# reducer), put back once the counter is known: DDP has no getter for the rate it had.
DDP_DEFAULT_SAMPLE_RATE = 100


class DdpIterations:
    """DDP's iteration counter of one model (see the module docstring)."""

    def __init__(self):
        self._base: int | None = None  # the counter before the next synchronizing forward
        self._synced_since_asking = 0  # synchronizing forwards since sampling was asked for

    def before_forward(self, model) -> int | None:
        sync = torch.is_grad_enabled() and bool(model.require_backward_grad_sync)
        if self._base is None:
            self._learn(model, sync)
        now = self._base
        if self._base is not None and sync:
            self._base += 1
        return now

    def _learn(self, model, sync: bool) -> None:
        if self._synced_since_asking == 0:
            if not sync:
                return
            model._set_ddp_runtime_logging_sample_rate(1)
        elif self._synced_since_asking >= 2:
            # Recorded at every synchronizing forward since (the counter was >= 1 at the second
            # one, so it was recorded): the last one's counter, before that forward's increment.
            recorded = model._get_ddp_logging_data().get("iteration")
            if recorded is not None:
                self._base = int(recorded) + 1
                model._set_ddp_runtime_logging_sample_rate(DDP_DEFAULT_SAMPLE_RATE)
                return
            if self._synced_since_asking > 4:
                raise RuntimeError(
                    "DDP recorded no iteration counter in its runtime statistics "
                    "(_get_ddp_logging_data()['iteration'])"
                )
        if sync:
            self._synced_since_asking += 1
