"""Start agreement for models attached from outside the script (rankscope._autoattach): the
ranks of a data-parallel group are attached at different wall times (one `rankscope attach --pid`
after another, or hosts attached by different operators), yet every joined step must be
complete, so all ranks must start reporting at the same step.

The common clock is a counter that has the same value on every rank of the group at the same
point of training: DDP's own iteration counter (rankscope._ddp_clock: forwards with gradients
that synchronize, one per optimizer step under gradient accumulation), or, for FSDP2
(rankscope._fsdp2_attach), the optimizer steps since the first forward or the collectives issued
on the model's mesh, read at each optimizer step. On arrival each rank publishes its counter and
a lead (how far the counter advances in ``LEAD`` steps: ``LEAD`` itself for a counter of steps)
in the job's c10d store (one ``set`` and one ``add``); at each later step it reads the arrival
count (one ``add(key, 0)``) until every rank of the group has arrived, then reads the published
values and starts at ``max(counters) + max(leads)``. Every rank computes the same start from the
same immutable values, and none can have passed it: synchronous data parallelism keeps ranks
within one step of each other, so a rank sees the last arrival at most two steps after it was
published.

Contract: never blocks (no ``wait``; ``get`` only on keys known to exist); a store error gives up
on agreement and starts this rank a margin ahead, with a warning (its first steps may then be
missing on the collector). Thread safety: training thread only.
"""

from collections.abc import Callable

# Forwards between the newest arrival and the first reported step (see the module docstring
# for why 2 is enough; 2 more absorb a rank that arrives during its own forward).
LEAD = 4


class StartAgreement:
    """One rank's part in agreeing on the first reported step of one (job, group)."""

    def __init__(
        self,
        store,
        key: str,
        rank: int,
        world_size: int,
        iteration: int,
        warn: Callable[[str], None],
        lead: int = LEAD,
    ):
        self._store = store
        self._key = key
        self._world_size = world_size
        self._warn = warn
        self._lead = int(lead)
        self.start: int | None = None
        self.arrived = 0
        if store is None:
            self.start = iteration + self._lead
            return
        try:
            store.set(f"{key}/{rank}", f"{iteration} {self._lead}")
            self.arrived = int(store.add(f"{key}/n", 1))
        except Exception as e:  # a store problem must not stop training
            self._give_up(iteration, e)

    def poll(self, iteration: int) -> int | None:
        """The agreed first step (counter value) once every rank arrived, else None.
        ``iteration`` is this rank's counter now (used only when the store fails)."""
        if self.start is not None:
            return self.start
        try:
            self.arrived = int(self._store.add(f"{self._key}/n", 0))
            if self.arrived < self._world_size:
                return None
            published = [
                bytes(self._store.get(f"{self._key}/{r}")).decode().split()
                for r in range(self._world_size)
            ]
            counters = [int(p[0]) for p in published]
            leads = [int(p[1]) if len(p) > 1 else LEAD for p in published]
            self.start = max(counters) + max(leads)
        except Exception as e:
            self._give_up(iteration, e)
        return self.start

    def _give_up(self, iteration: int, e: Exception) -> None:
        self.start = iteration + self._lead
        self._warn(
            f"rankscope: could not agree on the first step through the c10d store "
            f"({e!r}); this rank starts at step {self.start}"
        )
