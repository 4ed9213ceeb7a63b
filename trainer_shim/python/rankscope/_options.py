"""attach's option resolution (rankscope.torch): defaults read from the environment, the sketch
size from a byte budget and an encoding, the sketch threads, and the name of a model's
data-parallel group. Pure functions of their arguments and the process's environment; no
communication."""

import os

import torch
import torch.distributed as dist

from rankscope import _native

# Default parameter-fingerprint interval, from its measured cost (docs/PERFORMANCE.md, "Replica
# fingerprints"): one check costs 0.28-0.34 % of a CPU step (bench/fingerprint_overhead.py), so
# checking every 5 steps keeps it under 0.1 % of a step (0.07 %) while a diverged replica is named
# at most 4 steps after it diverged (50, the earlier default, took up to 49).
PARAM_CHECK_EVERY = 5

# Default aggregation-integrity interval (rankscope._integrity), from its measured cost
# (docs/PERFORMANCE.md "Aggregation integrity"): every step, one rank of the group sketches the
# reduced gradient once more.
INTEGRITY_EVERY = 1


def integrity_every_for(value) -> int:
    """attach's ``integrity_every``: the value given, else ``$RANKSCOPE_INTEGRITY_EVERY``, else
    rankscope._integrity.INTEGRITY_EVERY. Raises ValueError when it is not a whole number >= 0."""
    if value is None:
        env = os.environ.get("RANKSCOPE_INTEGRITY_EVERY", "").strip()
        value = env if env else INTEGRITY_EVERY
    try:
        every = int(value)
    except (TypeError, ValueError):
        every = -1
    if every < 0:
        raise ValueError(f"integrity_every must be a whole number >= 0, got {value!r}")
    return every


def replica_check_for(value, default: str = "exact") -> str:
    """attach's ``replica_check``: the value given, else ``$RANKSCOPE_REPLICA_CHECK``, else
    ``default`` (the framework path's choice, docs/shim.md's tables). Raises ValueError when it
    is not "exact" or "tolerance"."""
    if value is None:
        value = os.environ.get("RANKSCOPE_REPLICA_CHECK", "").strip().lower() or default
    if value not in ("exact", "tolerance"):
        raise ValueError(f"replica_check must be 'exact' or 'tolerance', got {value!r}")
    return value


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# At most this many threads sketch a CPU gradient bucket by default (rankscope/striped_sketch.h).
MAX_DEFAULT_SKETCH_THREADS = 8


def default_sketch_threads() -> int:
    """attach's default ``sketch_threads``: ``$RANKSCOPE_SKETCH_THREADS`` if set, else the cores
    this process may run on (its CPU affinity) that torch's intra-op threads leave free, at least
    1 and at most MAX_DEFAULT_SKETCH_THREADS. Raises ValueError on a bad environment value."""
    env = os.environ.get("RANKSCOPE_SKETCH_THREADS", "").strip()
    if env:
        try:
            threads = int(env)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"RANKSCOPE_SKETCH_THREADS must be a whole number >= 1, got {env!r}")
        return threads
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_SKETCH_THREADS, usable - torch.get_num_threads()))


def _group_ranks(pg) -> list:
    """The global ranks a process group spans, sorted; read locally, no communication."""
    if hasattr(dist, "get_process_group_ranks"):  # torch >= 2.0
        return sorted(dist.get_process_group_ranks(pg))
    from torch.distributed import distributed_c10d as c10d

    return sorted(c10d._pg_group_ranks[pg].keys())


def data_parallel_group(pg) -> str:
    """The name rankscope gives a DDP model's process group: "" (the job's only group) when it
    spans every rank of the job, else ``dp<lowest global rank>``, e.g. "dp1" for the odd ranks of
    a job laid out with tensor parallelism 2. Data-parallel groups of one model are disjoint, so
    their lowest ranks tell them apart; every rank of a group derives the same name."""
    if pg is None or dist.get_world_size(pg) == dist.get_world_size():
        return ""
    return f"dp{_group_ranks(pg)[0]}"


# What attach sends when told neither sketch_dim nor sketch_bytes: 4 KiB a rank a step in the
# most accurate encoding for that budget as measured (docs/PERFORMANCE.md "Sketch encodings":
# int8 bins, k = 4,096).
DEFAULT_SKETCH_BYTES = 4096
DEFAULT_SKETCH_ENCODING = "int8"


def sketch_dim_for(sketch_dim: int | None, sketch_bytes: int | None, sketch_encoding: str | None):
    """(k, encoding) from attach's sketch_dim / sketch_bytes / sketch_encoding.

    sketch_dim keeps its meaning from before encodings existed: k float32 bins unless an encoding
    is named. Otherwise k follows from the byte budget (default DEFAULT_SKETCH_BYTES) and the
    encoding (default DEFAULT_SKETCH_ENCODING). Raises ValueError on an unknown encoding, both
    sketch_dim and sketch_bytes, or a budget that is not a whole number of bins."""
    if sketch_encoding is None:
        sketch_encoding = "float32" if sketch_dim is not None else DEFAULT_SKETCH_ENCODING
    per_bin = _native.SKETCH_BYTES_PER_BIN.get(sketch_encoding)
    if per_bin is None:
        raise ValueError(
            f"sketch_encoding must be one of "
            f"{', '.join(_native.SKETCH_BYTES_PER_BIN)}, got {sketch_encoding!r}"
        )
    if sketch_dim is not None:
        if sketch_bytes is not None:
            raise ValueError("give sketch_dim or sketch_bytes, not both")
        return int(sketch_dim), sketch_encoding
    if sketch_bytes is None:
        sketch_bytes = DEFAULT_SKETCH_BYTES
    sketch_bytes = int(sketch_bytes)
    if sketch_bytes < per_bin or sketch_bytes % per_bin != 0:
        raise ValueError(
            f"sketch_bytes {sketch_bytes} is not a positive multiple of "
            f"{per_bin} bytes ({sketch_encoding} bins)"
        )
    return sketch_bytes // per_bin, sketch_encoding
