"""Where in the model: the parameter groups ("buckets") whose local gradient norms every report
carries, and their names (docs/shim.md "Where in the model").

A bucket here is rankscope's own group of parameters, fixed at attach from the model's parameter
names, identical on every rank and independent of the framework's communication buckets (DDP
rebuilds its buckets after the first iteration, FSDP and DeepSpeed have their own units): the
same names under every path. Pure: names in, groups out.

The rule. A parameter ``prefix.N.sub.rest`` (N the first all-digit component) belongs to the
repeated block ``(prefix, sub)`` at index N (``layers.20.mlp.fc1.weight``: block
``layers.*.mlp``, index 20); any other parameter to its module (``embed.weight``: ``embed``,
a top-level ``bias``: ``bias``). When the groups would exceed ``max_buckets``, the indices of
each repeated block are banded, ``band`` consecutive indices per group, with the smallest band
that fits: ``layers.20-23.mlp``. Groups are numbered in the order their first parameter comes in
``named_parameters()``.

Cost on the wire: 4 bytes a bucket per report (a packed float), and the names once per stream
in the hello (about 2 + len(name) bytes each); ``wire_bytes`` computes both.
"""

import math
from collections.abc import Iterable

# Default cap on the number of buckets: 32 buckets are 128 bytes a report (the 1,024-bin float32
# sketch is 4 KiB).
DEFAULT_MAX_BUCKETS = 32
# The collector's limits (agent.h kMaxBucketNames, kMaxBucketNameLength).
MAX_BUCKETS = 256
MAX_NAME_LENGTH = 128


def _block_key(name: str):
    """(prefix, index, sub) for a parameter in a repeated block, else (module, None, "")."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            prefix = ".".join(parts[:i])
            rest = parts[i + 1 : -1]
            sub = rest[0] if rest else ""
            return prefix, int(part), sub
    module = ".".join(parts[:-1]) or parts[-1]
    return module, None, ""


def _name(prefix: str, lo: int, hi: int, sub: str) -> str:
    index = str(lo) if lo == hi else f"{lo}-{hi}"
    name = ".".join(p for p in (prefix, index, sub) if p)
    if len(name) > MAX_NAME_LENGTH:
        name = name[: MAX_NAME_LENGTH - 3] + "..."
    return name


def group_parameters(names: Iterable[str], max_buckets: int = DEFAULT_MAX_BUCKETS):
    """Groups parameter names as the module docstring says.

    Returns ``(bucket_names, bucket_of)``: the buckets' names in order, and for each input name
    (same order) the index of its bucket. ``max_buckets`` (1 .. MAX_BUCKETS) bounds the count
    where banding can: a model with more distinct non-repeated modules than that keeps them and
    the last buckets merge into one named ``"rest"``.
    """
    names = list(names)
    if not 1 <= max_buckets <= MAX_BUCKETS:
        raise ValueError(f"max_buckets must be in [1, {MAX_BUCKETS}], got {max_buckets}")
    keys = [_block_key(n) for n in names]
    singles = {(p, s) for p, i, s in keys if i is None}
    blocks = {}  # (prefix, sub) -> sorted distinct indices
    for p, i, s in keys:
        if i is not None:
            blocks.setdefault((p, s), set()).add(i)
    blocks = {k: sorted(v) for k, v in blocks.items()}

    def count(band: int) -> int:
        return len(singles) + sum(math.ceil(len(v) / band) for v in blocks.values())

    longest = max((len(v) for v in blocks.values()), default=1)
    band = 1
    while band < longest and count(band) > max_buckets:
        band += 1

    # Each index's band: the band-th group of its block's sorted indices.
    band_of = {}
    for key, indices in blocks.items():
        for pos, index in enumerate(indices):
            start = (pos // band) * band
            chunk = indices[start : start + band]
            band_of[(key, index)] = _name(key[0], chunk[0], chunk[-1], key[1])

    bucket_names, index_of, bucket_of = [], {}, []
    for p, i, s in keys:
        label = p if i is None else band_of[((p, s), i)]
        if label not in index_of:
            if len(bucket_names) >= max_buckets - 1 and count(band) > max_buckets:
                label = "rest"  # too many distinct modules: the last bucket holds the rest
            if label not in index_of:
                index_of[label] = len(bucket_names)
                bucket_names.append(label)
        bucket_of.append(index_of[label])
    return bucket_names, bucket_of


def wire_bytes(bucket_names) -> tuple[int, int]:
    """(bytes a report's bucket_norms add, bytes the hello's bucket_names add) on the wire:
    a packed repeated float is a tag, a length and 4 bytes a value; a repeated string a tag, a
    length and the bytes, per name."""

    def varint(n: int) -> int:
        return max(1, (n.bit_length() + 6) // 7)

    payload = 4 * len(bucket_names)
    per_report = 0 if not bucket_names else 2 + varint(payload) + payload
    hello = sum(2 + varint(len(n.encode())) + len(n.encode()) for n in bucket_names)
    return per_report, hello
