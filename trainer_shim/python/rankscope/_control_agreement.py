"""Control agreement (rankscope.torch): every rank of a job applies a control message
(enable, disable, every, sketch_dim) at the same step, so that the ranks' sketches stay
comparable.

The collector proposes a step (its newest step + lead_steps) with the control it pushes down
every rank's stream. A dormant job reports no steps, so that view may be stale: the first rank to
see a new control decides the step (the proposal if it is still ahead of that rank, else a step
``control_margin`` seconds ahead at the rank's step rate) and publishes it in the job's c10d
store; the others adopt it. That is one ``add``/``set`` (or ``wait``/``get``) per control, never
per step. See docs/shim.md.

Thread safety: training thread only (``mon.step``).
"""

import datetime
import math
from collections.abc import Callable

import torch.distributed as dist


class ControlAgreement:
    """Follows the control messages of one rank: ``poll`` once per ``mon.step``.

    ``counters`` and ``warn_once(key, message)`` are the monitor's.
    """

    def __init__(
        self,
        job: str,
        attempt: int,
        rank: int,
        control_margin: float,
        counters,
        warn_once: Callable,
    ):
        self._job = job
        self._attempt = attempt
        self._rank = rank
        self._control_margin = control_margin
        self._counters = counters
        self._warn_once = warn_once
        self._seen = None
        self._pending = None  # (apply_step, enabled, every, sketch_dim, generation)
        self._store = None

    def poll(self, control, step: int, step_time_ema: float | None) -> tuple[bool, int, int] | None:
        """Takes the agent's newest control (generation, apply_at_step, enabled, every,
        sketch_dim), or None, at step ``step``. Returns (enabled, every, sketch_dim; 0: unchanged)
        when a control is due at this step, else None."""
        if control is not None and control != self._seen:
            self._seen = control
            generation, apply_at, enabled, every, dim = control
            agreed = self._agree_apply_step(control, step, step_time_ema)
            if agreed < step:
                # This rank saw the control after the agreed step: it applies now, and the steps
                # in between differ from the other ranks' (they show up as missing ranks).
                self._counters["late_controls"] += 1
                self._warn_once(
                    f"late{generation}",
                    f"rankscope: control generation {generation} was agreed "
                    f"for step {agreed} but reached rank {self._rank} at step {step}",
                )
            self._pending = (agreed, bool(enabled), max(1, int(every)), int(dim), generation)
        pending = self._pending
        if pending is not None and step >= pending[0]:
            _, enabled, every, dim, _ = pending
            self._pending = None
            return enabled, every, dim
        return None

    def _margin_steps(self, step_time_ema: float | None) -> int:
        if not step_time_ema:
            return 10
        return int(min(100_000, max(2, math.ceil(self._control_margin / step_time_ema))))

    def _agree_apply_step(self, control, step: int, step_time_ema: float | None) -> int:
        """The step every rank applies ``control`` at: the collector's apply_at_step if it is
        still ahead of this rank, else a step ``control_margin`` seconds ahead. The first rank to
        see the control decides and publishes it in the c10d store; the others adopt it."""
        generation, apply_at, enabled, every, dim = control
        proposal = max(int(apply_at), step + self._margin_steps(step_time_ema))
        store = self._get_store()
        if store is None:
            return proposal
        key = (
            f"rankscope/ctl/{self._job}/{self._attempt}/{generation}/{apply_at}/"
            f"{int(bool(enabled))}/{every}/{dim}"
        )
        try:
            if store.add(key + "/n", 1) == 1:
                store.set(key, str(proposal))
                return proposal
            store.wait([key], datetime.timedelta(seconds=10))
            return int(store.get(key))
        except Exception as e:  # a store problem must not stop training
            self._counters["store_errors"] += 1
            self._warn_once(
                "store",
                f"rankscope: could not agree on a control step through "
                f"the c10d store ({e!r}); using step {proposal}",
            )
            return proposal

    def _get_store(self):
        if self._store is None:
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except Exception:
                self._store = False
        return self._store or None
