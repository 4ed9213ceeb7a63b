"""rankscope.report: a one-page plot of a job's consistency over steps (``rankscope report``).

    rankscope report --job exp-42 -o report.png [--db rankscope.db]

runs ``/usr/bin/python3 -m rankscope.report --input EXPORT.json --job exp-42 -o report.png``
with the job's export (``rankscope export --format json``: ``{"steps": [...], "ranks": [...]}``,
proto3 JSON, so uint64 values are strings and NaN is ``"NaN"``). Panels, sharing the step axis:

1. loss mean with its dispersion (mean +/- population std band; the range on a second axis);
2. gradient-norm coefficient of variation;
3. direction consistency (mean pairwise cosine of the ranks' gradient sketches);
4. replica checks: every checked step (green), and each rank whose fingerprints diverged (red);
5. outlier ranks: each flagged (rank, step), the marker's size growing with the outlier score.

Outlier steps are also marked on the loss panel. Needs matplotlib (Debian: python3-matplotlib).
"""

import argparse
import json
import math
import sys


def _f(v) -> float:
    if v is None:
        return math.nan
    return float(v)  # numbers, or proto3 JSON's "NaN" / "Infinity" strings


def load(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    steps = sorted(data.get("steps", []), key=lambda s: int(s.get("step", 0)))
    ranks = data.get("ranks", [])
    return {"steps": steps, "ranks": ranks}


def plot(data: dict, job: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = data["steps"]
    x = [int(s.get("step", 0)) for s in steps]
    mean = [_f(s.get("loss_mean")) for s in steps]
    std = [_f(s.get("loss_std")) for s in steps]
    rng = [_f(s.get("loss_range")) for s in steps]
    cv = [_f(s.get("grad_norm_cv")) for s in steps]
    cos = [_f(s.get("grad_cosine_mean")) for s in steps]

    fig, axes = plt.subplots(5, 1, figsize=(11, 13), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 2, 1.5, 2]})
    ax = axes[0]
    ax.plot(x, mean, color="C0", label="loss mean")
    ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    color="C0", alpha=0.25, label="mean ± std")
    ax2 = ax.twinx()
    ax2.plot(x, rng, color="C1", lw=0.8, alpha=0.8, label="range (max − min)")
    ax2.set_ylabel("loss range", color="C1")
    outlier_steps = [(xi, m) for xi, m, s in zip(x, mean, steps) if s.get("outlier_ranks")]
    if outlier_steps:
        ax.scatter([p[0] for p in outlier_steps], [p[1] for p in outlier_steps], marker="x",
                   color="red", zorder=3, label="step with outlier ranks")
    ax.set_ylabel("loss")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax.set_title(f"rankscope: job {job} ({len(steps)} steps)")

    axes[1].plot(x, cv, color="C2")
    axes[1].set_ylabel("grad-norm CV")
    axes[2].plot(x, cos, color="C3")
    axes[2].set_ylabel("mean pairwise cosine")

    ax = axes[3]
    checked = [xi for xi, s in zip(x, steps) if s.get("replica_checked")]
    ax.scatter(checked, [-1] * len(checked), marker="|", color="green", label="checked")
    div_x, div_r = [], []
    for xi, s in zip(x, steps):
        for r in s.get("replica_divergent_ranks", []):
            div_x.append(xi)
            div_r.append(int(r))
    if div_x:
        ax.scatter(div_x, div_r, marker="s", color="red", label="divergent rank")
    ax.set_ylabel("replica\n(rank)")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[4]
    score = {}
    for r in data["ranks"]:
        score[(int(r.get("step", 0)), int(r.get("rank", 0)))] = _f(r.get("outlier_score"))
    ox, orank, osize = [], [], []
    for xi, s in zip(x, steps):
        for r in s.get("outlier_ranks", []):
            v = score.get((xi, int(r)), math.nan)
            ox.append(xi)
            orank.append(int(r))
            osize.append(20 + 4 * min(v, 50.0) if math.isfinite(v) else 60)
    if ox:
        ax.scatter(ox, orank, s=osize, color="red", alpha=0.6, label="outlier rank")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_ylabel("outlier\n(rank)")
    ax.set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    for a in axes[3:]:
        a.yaxis.set_major_locator(MaxNLocator(integer=True))
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m rankscope.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="export JSON (rankscope export --format json)")
    p.add_argument("--job", default="", help="job name for the title")
    p.add_argument("-o", "--output", required=True, help="image file (png, pdf, svg)")
    args = p.parse_args(argv)
    try:
        data = load(args.input)
    except (OSError, ValueError) as e:
        print(f"rankscope.report: cannot read {args.input}: {e}", file=sys.stderr)
        return 1
    if not data["steps"]:
        print(f"rankscope.report: no steps in {args.input}", file=sys.stderr)
        return 1
    try:
        plot(data, args.job, args.output)
    except ImportError as e:
        print(f"rankscope.report: needs matplotlib ({e})", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"rankscope.report: cannot write {args.output}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({len(data['steps'])} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
