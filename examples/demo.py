#!/usr/bin/env python3
"""The paper's three settings end to end: start a collector, train examples/train_ddp.py in
settings S1-1, S1-2 and S1-3 (4 DDP ranks each, reporting through rankscope.torch), then read the
collector's SQLite back and print, per setting, the mean loss dispersion, grad-norm CV and
direction consistency, and plot the three metrics over steps.

    PYTHONPATH=build/python .venv/bin/python examples/demo.py --build-dir build --steps 100

Writes <out>/rankscope.db, <out>/demo.png and <out>/demo.md (the table) and prints the table.
"""

import argparse
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_ddp  # noqa: E402

sys.path.insert(0, str(HERE.parent / "bench"))
import detection  # noqa: E402  (the collector's start-up)

METRICS = (
    ("loss_std", "loss dispersion (std)"),
    ("grad_norm_cv", "grad-norm CV"),
    ("grad_cosine_mean", "direction consistency (mean pairwise cosine)"),
)


def start_collector(build_dir: Path, db: Path, out: Path):
    """bench/detection.py's collector (gRPC and metrics on free ports, no web server), its log in
    out/collector.log. Returns (process, gRPC address)."""
    binary = build_dir / "bin" / "rankscope-collector"
    if not binary.exists():
        sys.exit(f"demo: {binary} not found; build first (cmake --build {build_dir})")
    proc, address, _, _, _ = detection.start_collector(
        binary, out, db=db, step_timeout=None, metrics=True
    )
    return proc, address


def read_steps(db: Path, job: str):
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(
            "SELECT step, ranks, loss_std, grad_norm_cv, grad_cosine_mean FROM step_stats "
            "WHERE job = ? ORDER BY step",
            (job,),
        ).fetchall()
    finally:
        con.close()


def read_rank_consensus(db: Path, job: str, skip: int):
    """rank -> mean consensus cosine (cos of the rank's sketch with the sum of the others')."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return dict(
            con.execute(
                "SELECT rank, AVG(grad_cosine) FROM rank_steps WHERE job = ? AND step >= ? "
                "GROUP BY rank ORDER BY rank",
                (job, skip),
            ).fetchall()
        )
    finally:
        con.close()


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def table(results, consensus, skip: int) -> str:
    lines = [
        "| setting | steps (complete) | mean loss std | mean grad-norm CV | "
        "mean direction consistency | least consistent rank: its consensus cosine "
        "(others' mean) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for setting, rows in results.items():
        used = [r for r in rows if r[0] >= skip]
        complete = sum(1 for r in rows if r[1] == 4)
        per_rank = consensus.get(setting) or {}
        culprit = "-"
        if len(per_rank) > 1:
            worst = min(per_rank, key=lambda r: per_rank[r])
            others = mean(v for r, v in per_rank.items() if r != worst)
            culprit = f"rank {worst}: {per_rank[worst]:.3f} ({others:.3f})"
        lines.append(
            f"| {setting} | {len(rows)} ({complete}) | {mean(r[2] for r in used):.4f} | "
            f"{mean(r[3] for r in used):.4f} | {mean(r[4] for r in used):.4f} | "
            f"{culprit} |"
        )
    return "\n".join(lines)


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(METRICS), 1, figsize=(8, 8), sharex=True)
    for ax, (column, title) in zip(axes, METRICS):
        i = 2 + [m[0] for m in METRICS].index(column)
        for setting, rows in results.items():
            ax.plot([r[0] for r in rows], [r[i] for r in rows], label=setting, linewidth=1)
        ax.set_ylabel(column)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[-1].set_xlabel("optimizer step")
    fig.suptitle("rankscope: 4-rank DDP char-transformer on GPL-3, settings S1-1/2/3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.environ.get("RANKSCOPE_BUILD_DIR", "build"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="demo-out")
    p.add_argument(
        "--skip",
        type=int,
        default=10,
        help="warm-up steps left out of the table's means (the plot shows all)",
    )
    p.add_argument("--settings", nargs="+", default=list(train_ddp.SETTINGS))
    p.add_argument("--base-seed", type=int, default=train_ddp.BASE_SEED)
    p.add_argument(
        "--skip-init-sync",
        action="store_true",
        help="train_ddp.py --skip-init-sync: the replicas' initial weights differ",
    )
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "rankscope.db"
    for f in (db, Path(str(db) + "-wal"), Path(str(db) + "-shm")):
        f.unlink(missing_ok=True)
    proc, address = start_collector(Path(args.build_dir), db, out)
    print(f"demo: collector at {address}, database {db}", file=sys.stderr)
    results = {}
    try:
        for setting in args.settings:
            job = f"demo-{setting}"
            extra = ["--skip-init-sync"] if args.skip_init_sync else []
            train_ddp.main(
                [
                    "--setting",
                    setting,
                    "--steps",
                    str(args.steps),
                    "--collector",
                    address,
                    "--job",
                    job,
                    "--base-seed",
                    str(args.base_seed),
                ]
                + extra
            )
            results[setting] = read_steps(db, job)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    consensus = {}
    for setting in results:  # after the collector closed every open step
        results[setting] = read_steps(db, f"demo-{setting}")
        consensus[setting] = read_rank_consensus(db, f"demo-{setting}", args.skip)

    md = table(results, consensus, args.skip)
    (out / "demo.md").write_text(md + "\n")
    print(f"\nper setting, means over steps >= {args.skip} (from {db}):\n")
    print(md)
    try:
        plot(results, out / "demo.png")
        print(f"\nplot: {out / 'demo.png'}")
    except ImportError:
        print("\n(no matplotlib in this Python: pip install matplotlib for the plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
