#!/usr/bin/env python3
"""What "where in the model" (per-bucket gradient norms) costs: in the shim, on the wire and in
the collector's SQLite file.

    PYTHONPATH=build/python .venv/bin/python bench/where_cost.py [--layers 24] [--d 256]
    PYTHONPATH=build/python .venv/bin/python bench/where_cost.py --db rankscope.db --job J

Without --db: a transformer-shaped parameter set (embed, per layer attn q/k/v/o, mlp fc1/fc2,
ln1, ln2, then norm and head; float32 CPU gradients) is grouped by rankscope._buckets, and one
step's work is timed, median of --repeats, on one torch thread: the count sketch of every
gradient (the C++ kernel, what the shim does anyway) against the per-bucket norms (one
``torch._foreach_norm`` and one ``index_add_`` per DDP-sized bucket of --bucket-mb, what
BucketSketcher adds). Prints the buckets, the wire bytes (a report's bucket_norms and the
hello's names) and both times.

With --db: the bytes the where columns of rank_steps (deviating_buckets, bucket_norms,
bucket_z) hold per rank-step, for the flagged rows (deviating_buckets not empty or norms kept)
and the others.
"""

import argparse
import sqlite3
import statistics
import time


def storage(db: str, job: str) -> None:
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT length(deviating_buckets), coalesce(length(bucket_norms), 0), "
        "coalesce(length(bucket_z), 0) FROM rank_steps WHERE job = ?",
        (job,),
    ).fetchall()
    kept = [sum(r) for r in rows if r[1] > 0]
    rest = [sum(r) for r in rows if r[1] == 0]
    # Each of the three columns also costs one byte of record header (its serial type; a NULL
    # and an empty text have no body).
    print(f"{job}: {len(rows)} rank-steps, {len(kept)} with per-bucket norms kept")
    if kept:
        print(f"  kept rows: {statistics.mean(kept) + 3:.1f} bytes a rank-step (mean, + 3 header)")
    if rest:
        print(f"  other rows: {statistics.mean(rest) + 3:.1f} bytes a rank-step (mean, + 3 header)")
    total = sum(kept) + sum(rest) + 3 * len(rows)
    print(f"  all rows: {total / max(len(rows), 1):.2f} bytes a rank-step")


def shim(args) -> None:
    import torch

    from rankscope import _native
    from rankscope._buckets import group_parameters, wire_bytes

    torch.set_num_threads(1)
    d, ff = args.d, 4 * args.d
    shapes = [("embed.weight", (args.vocab, d))]
    for i in range(args.layers):
        for n in ("q", "k", "v", "o"):
            shapes.append((f"layers.{i}.attn.{n}.weight", (d, d)))
        shapes += [
            (f"layers.{i}.mlp.fc1.weight", (ff, d)),
            (f"layers.{i}.mlp.fc2.weight", (d, ff)),
            (f"layers.{i}.ln1.weight", (d,)),
            (f"layers.{i}.ln2.weight", (d,)),
        ]
    shapes += [("norm.weight", (d,)), ("head.weight", (args.vocab, d))]
    names = [n for n, _ in shapes]
    buckets, bucket_of = group_parameters(names, args.max_buckets)
    grads = [torch.randn(s) for _, s in shapes]
    offsets, total = [], 0
    for g in grads:
        offsets.append(total)
        total += g.numel()
    # DDP-sized buckets, in reverse parameter order as DDP fills them.
    cap = args.bucket_mb * 2**20 // 4
    ddp_buckets, cur, size = [], [], 0
    for k in reversed(range(len(grads))):
        cur.append(k)
        size += grads[k].numel()
        if size >= cap:
            ddp_buckets.append(cur)
            cur, size = [], 0
    if cur:
        ddp_buckets.append(cur)
    index = [torch.tensor([bucket_of[k] for k in b], dtype=torch.long) for b in ddp_buckets]
    sketch = _native.Sketch(args.sketch_dim, _native.DEFAULT_SKETCH_SEED, 1)

    def sketch_step():
        sketch.reset()
        for b in ddp_buckets:
            sketch.add_many(
                [grads[k].data_ptr() for k in b],
                [grads[k].numel() for k in b],
                [offsets[k] for k in b],
                _native.DTYPE_FLOAT32,
            )
        sketch.sum_squares()

    acc = torch.zeros(len(buckets))

    def norms_step():
        acc.zero_()
        for b, idx in zip(ddp_buckets, index):
            norms = torch._foreach_norm([grads[k] for k in b], 2, dtype=torch.float32)
            acc.index_add_(0, idx, torch.stack(norms).square())
        acc.sqrt().tolist()

    def timed(fn):
        fn()
        out = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    per_report, hello = wire_bytes(buckets)
    print(
        f"{total / 1e6:.1f} M float32 coordinates, {len(ddp_buckets)} DDP buckets of "
        f"{args.bucket_mb} MiB, {len(buckets)} rankscope buckets: {buckets[:3]} ... {buckets[-2:]}"
    )
    print(f"wire: {per_report} bytes a report (bucket_norms), {hello} bytes once (hello names)")
    t_sketch, t_norms = timed(sketch_step), timed(norms_step)
    print(
        f"one step, one thread: sketch {t_sketch * 1e3:.2f} ms, per-bucket norms "
        f"{t_norms * 1e3:.2f} ms ({100 * t_norms / t_sketch:.0f}% of the sketch)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db")
    p.add_argument("--job")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-buckets", type=int, default=32)
    p.add_argument("--bucket-mb", type=int, default=25)
    p.add_argument("--sketch-dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if args.db:
        storage(args.db, args.job)
    else:
        shim(args)


if __name__ == "__main__":
    main()
