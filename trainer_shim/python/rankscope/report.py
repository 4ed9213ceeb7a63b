"""rankscope.report: a one-page picture of a job's consistency, every rank (``rankscope report``).

    rankscope report --job exp-42 -o report.png [--db rankscope.db]

runs ``PYTHON -m rankscope.report --input EXPORT.json --job exp-42 -o report.png``
with the job's export (``rankscope export --format json``: ``{"steps": [...], "ranks": [...],
"rank_windows": [...], "downsampled_before_step": N}``, proto3 JSON, so 64-bit values are
strings and NaN is ``"NaN"``). A job's data-parallel group ("JOB/GROUP") is drawn as a job.
Panels, sharing the step axis:

1. loss mean with its dispersion (mean +/- population std band; the range on a second axis);
2. gradient-norm coefficient of variation and direction consistency (mean pairwise cosine);
3. rank x step heatmap of every rank's consensus cosine (the worst, lowest, value of a cell);
4. rank x step heatmap of every rank's outlier score (the worst, highest; >= 6 is an outlier);
5. events on the same rank axis: replica divergence, missing, non-finite, drifting and slow
   ranks, persistent outliers;
and, under the panels, where in the model the flagged ranks deviate (``where_lines``).

When there are more steps (ranks) than pixels, steps (ranks) are aggregated into columns (rows),
each cell showing its worst value, so one bad rank in 1,024 stays visible. Where the collector's
retention pruned the per-rank rows (steps below ``downsampled_before_step``), the heatmaps use
the downsampled rank windows (min cosine, max outlier score per window of steps) and the range
is shaded and labelled. A panel with nothing to show says so. Needs matplotlib and numpy
(Debian: python3-matplotlib).
"""

import argparse
import json
import math
import sys

# Heatmap resolution: at most this many columns (steps) and rows (ranks) of cells; beyond,
# neighbouring steps or ranks share a cell (its worst value).
MAX_COLUMNS = 800
MAX_ROWS = 320
OUTLIER_THRESHOLD = 6.0


def _f(v) -> float:
    if v is None:
        return math.nan
    return float(v)  # numbers, or proto3 JSON's "NaN" / "Infinity" strings


def load(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    steps = sorted(data.get("steps", []), key=lambda s: int(s.get("step", 0)))
    return {
        "steps": steps,
        "ranks": data.get("ranks", []),
        "rank_windows": data.get("rank_windows", []),
        "downsampled_before_step": int(data.get("downsampled_before_step", 0) or 0),
    }


class Grid:
    """Steps [first, last] x ranks [0, world) mapped to at most MAX_COLUMNS x MAX_ROWS cells."""

    def __init__(self, first: int, last: int, world: int):
        self.first, self.last, self.world = first, last, max(world, 1)
        span = last - first + 1
        self.steps_per_col = max(1, math.ceil(span / MAX_COLUMNS))
        self.cols = math.ceil(span / self.steps_per_col)
        self.ranks_per_row = max(1, math.ceil(self.world / MAX_ROWS))
        self.rows = math.ceil(self.world / self.ranks_per_row)

    def col(self, step: int) -> int:
        return min(self.cols - 1, max(0, (step - self.first) // self.steps_per_col))

    def cols_of(self, first_step: int, last_step: int) -> range:
        lo = max(first_step, self.first)
        hi = min(last_step, self.last)
        if lo > hi:
            return range(0)
        return range(self.col(lo), self.col(hi) + 1)

    def row(self, rank: int) -> int:
        return min(self.rows - 1, rank // self.ranks_per_row)

    def extent(self):
        # Cell edges in step and rank units, so the axes read real step and rank numbers.
        return (
            self.first - 0.5,
            self.first + self.cols * self.steps_per_col - 0.5,
            self.rows * self.ranks_per_row - 0.5,
            -0.5,
        )

    def x(self, col: int) -> float:
        return self.first + (col + 0.5) * self.steps_per_col - 0.5

    def y(self, row: int) -> float:
        return (row + 0.5) * self.ranks_per_row - 0.5

    def describe(self) -> str:
        parts = []
        if self.steps_per_col > 1:
            parts.append(f"{self.steps_per_col} steps")
        if self.ranks_per_row > 1:
            parts.append(f"{self.ranks_per_row} ranks")
        return f"cell = {' x '.join(parts)}, its worst value" if parts else "cell = one rank-step"


def heat_grids(data: dict, grid: "Grid"):
    """The worst (lowest) consensus cosine and worst (highest) outlier score per cell."""
    import numpy as np

    cos = np.full((grid.rows, grid.cols), np.nan)
    score = np.full((grid.rows, grid.cols), np.nan)

    def put(arr, r, c, v, worst):
        if not math.isfinite(v):
            return
        old = arr[r, c]
        arr[r, c] = v if math.isnan(old) else worst(old, v)

    for r in data["ranks"]:
        step = int(r.get("step", 0))
        if step < grid.first or step > grid.last:
            continue
        row, col = grid.row(int(r.get("rank", 0))), grid.col(step)
        put(cos, row, col, _f(r.get("grad_cosine")), min)
        put(score, row, col, _f(r.get("outlier_score")), max)
    for w in data["rank_windows"]:
        row = grid.row(int(w.get("rank", 0)))
        for col in grid.cols_of(int(w.get("first_step", 0)), int(w.get("last_step", 0))):
            put(cos, row, col, _f(w.get("grad_cosine_min")), min)
            put(score, row, col, _f(w.get("outlier_score_max")), max)
    return cos, score


def events(data: dict, grid: "Grid"):
    """Per event kind, the set of (col, row) cells where it happened."""
    kinds = {
        "replica divergent": set(),
        "missing": set(),
        "non-finite": set(),
        "drifting": set(),
        "slow": set(),
        "persistent outlier": set(),
    }
    for s in data["steps"]:
        step = int(s.get("step", 0))
        if step < grid.first or step > grid.last:
            continue
        c = grid.col(step)
        for key, kind in (
            ("replica_divergent_ranks", "replica divergent"),
            ("missing_ranks", "missing"),
            ("drifting_ranks", "drifting"),
            ("slow_ranks", "slow"),
            ("outlier_ranks", "persistent outlier"),
        ):
            for r in s.get(key, []):
                kinds[kind].add((c, grid.row(int(r))))
    for r in data["ranks"]:
        step = int(r.get("step", 0))
        if grid.first <= step <= grid.last and not (
            math.isfinite(_f(r.get("loss"))) and math.isfinite(_f(r.get("grad_norm")))
        ):
            kinds["non-finite"].add((grid.col(step), grid.row(int(r.get("rank", 0)))))
    for w in data["rank_windows"]:
        row = grid.row(int(w.get("rank", 0)))
        cols = grid.cols_of(int(w.get("first_step", 0)), int(w.get("last_step", 0)))
        if int(w.get("nonfinite", 0) or 0) > 0:
            kinds["non-finite"].update((c, row) for c in cols)
        if int(w.get("replica_bad", 0) or 0) > 0:
            kinds["replica divergent"].update((c, row) for c in cols)
    return kinds


def where_lines(data: dict, limit: int = 6) -> list:
    """Where in the model: for each rank whose rows name deviating buckets (the collector's
    ``deviating_buckets``), its newest such row, as "rank 5 (step 120): layers.20-23.mlp
    z=45.1; ...", newest first, at most ``limit`` ranks (and a line counting the rest)."""
    newest = {}
    for r in data["ranks"]:
        text = r.get("deviating_buckets") or r.get("deviatingBuckets") or ""
        if not text:
            continue
        rank, step = int(r.get("rank", 0)), int(r.get("step", 0))
        if rank not in newest or step > newest[rank][0]:
            newest[rank] = (step, text)
    ordered = sorted(newest.items(), key=lambda kv: (-kv[1][0], kv[0]))
    lines = [f"rank {rank} (step {step}): {text}" for rank, (step, text) in ordered[:limit]]
    if len(ordered) > limit:
        lines.append(f"... and {len(ordered) - limit} more ranks")
    return lines


def _say(ax, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=10,
        color="0.3",
        wrap=True,
    )


# Long: one figure's panels in order, each a few matplotlib calls on shared axes; split per panel,
# the figure and its shared step axis would be passed around.
def plot(data: dict, job: str, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    steps = data["steps"]
    x = [int(s.get("step", 0)) for s in steps]
    mean = [_f(s.get("loss_mean")) for s in steps]
    std = [_f(s.get("loss_std")) for s in steps]
    rng = [_f(s.get("loss_range")) for s in steps]
    cv = [_f(s.get("grad_norm_cv")) for s in steps]
    cos = [_f(s.get("grad_cosine_mean")) for s in steps]
    world = max(
        [int(s.get("world_size", 0) or 0) for s in steps]
        + [int(r.get("rank", 0)) + 1 for r in data["ranks"]]
        + [int(w.get("rank", 0)) + 1 for w in data["rank_windows"]]
        + [1]
    )
    first = min(x + [int(w.get("first_step", 0)) for w in data["rank_windows"]])
    last = max(x)
    grid = Grid(first, last, world)
    downsampled = data["downsampled_before_step"]

    fig, axes = plt.subplots(
        5, 1, figsize=(14, 15), sharex=True, gridspec_kw={"height_ratios": [2.2, 1.4, 3, 3, 3]}
    )
    ax = axes[0]
    ax.plot(x, mean, color="C0", label="loss mean")
    ax.fill_between(
        x,
        [m - s for m, s in zip(mean, std)],
        [m + s for m, s in zip(mean, std)],
        color="C0",
        alpha=0.25,
        label="mean ± std",
    )
    ax2 = ax.twinx()
    ax2.plot(x, rng, color="C1", lw=0.8, alpha=0.8, label="range (max − min)")
    ax2.set_ylabel("loss range", color="C1")
    ax.set_ylabel("loss")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    groups = "" if "/" not in job else " (a data-parallel group; ranks within the group)"
    ax.set_title(f"rankscope: job {job}{groups}: {len(steps)} steps {first}..{last}, {world} ranks")

    ax = axes[1]
    ax.plot(x, cv, color="C2", label="grad-norm CV")
    ax.set_ylabel("grad-norm CV", color="C2")
    ax3 = ax.twinx()
    ax3.plot(x, cos, color="C3", label="direction consistency")
    ax3.set_ylabel("mean pairwise\ncosine", color="C3")

    cos_grid, score_grid = heat_grids(data, grid)
    extent = grid.extent()
    cmap_cos = matplotlib.colormaps["RdYlGn"].copy()
    cmap_cos.set_bad("0.92")
    cmap_score = matplotlib.colormaps["magma_r"].copy()
    cmap_score.set_bad("0.92")
    for ax, arr, cmap, label, title, kw in (
        (
            axes[2],
            cos_grid,
            cmap_cos,
            "consensus cosine",
            "consensus cosine of every rank (lowest per cell)",
            {
                "vmin": min(
                    0.5, float(np.nanmin(cos_grid)) if np.isfinite(cos_grid).any() else 0.5
                ),
                "vmax": 1.0,
            },
        ),
        (
            axes[3],
            score_grid,
            cmap_score,
            "outlier score",
            f"outlier score of every rank (highest per cell; ≥ {OUTLIER_THRESHOLD:g}: outlier; "
            f"the scale stops at {2 * OUTLIER_THRESHOLD:g})",
            {"vmin": 0.0, "vmax": 2 * OUTLIER_THRESHOLD},
        ),
    ):
        ax.set_ylabel("rank")
        ax.set_title(f"{title} — {grid.describe()}", fontsize=9, loc="left")
        if not np.isfinite(arr).any():
            ax.set_ylim(world - 0.5, -0.5)
            _say(ax, "no per-rank values in these steps (no rank rows or rank windows stored)")
            continue
        im = ax.imshow(
            np.ma.masked_invalid(arr),
            aspect="auto",
            interpolation="nearest",
            extent=extent,
            cmap=cmap,
            **kw,
        )
        # The colour bar sits outside the axes (an inset), so every panel keeps the same width
        # and the step axes line up.
        cax = ax.inset_axes([1.01, 0.0, 0.012, 1.0])
        fig.colorbar(im, cax=cax, label=label, extend="max" if arr is score_grid else "neither")

    ax = axes[4]
    ax.set_ylabel("rank")
    ax.set_title(
        f"events per rank — {grid.describe().replace(', its worst value', '')}",
        fontsize=9,
        loc="left",
    )
    styles = {
        "replica divergent": ("s", "red"),
        "missing": ("|", "0.45"),
        "non-finite": ("x", "black"),
        "drifting": ("^", "darkorange"),
        "slow": ("v", "purple"),
        "persistent outlier": ("o", "deeppink"),
    }
    any_event = False
    size = max(4.0, min(30.0, 2000.0 / max(grid.rows, 1)))
    # Each kind has its own offset inside a cell's row, so that kinds on the same rank and step
    # (an outlier that is also drifting) do not hide each other.
    for k, (kind, cells) in enumerate(events(data, grid).items()):
        if not cells:
            continue
        any_event = True
        marker, color = styles[kind]
        dy = (k - (len(styles) - 1) / 2) * 0.8 * grid.ranks_per_row / len(styles)
        ax.scatter(
            [grid.x(c) for c, _ in cells],
            [grid.y(r) + dy for _, r in cells],
            s=size,
            marker=marker,
            color=color,
            label=f"{kind} ({len(cells)} cell{'s' if len(cells) != 1 else ''})",
            linewidths=1.0,
        )
    ax.set_ylim(grid.rows * grid.ranks_per_row - 0.5, -0.5)
    if any_event:
        ax.legend(
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=8,
            borderaxespad=0,
            markerscale=max(1.0, 20 / size),
        )
    else:
        _say(
            ax,
            "no replica divergence, missing, non-finite, drifting, slow or persistent "
            "outlier ranks in these steps",
        )
    ax.set_xlabel("step")
    ax.set_xlim(grid.first - 0.5, grid.last + 0.5)

    if downsampled > first:
        for a in axes[2:]:
            a.axvspan(first - 0.5, min(downsampled, last + 1) - 0.5, color="0.5", alpha=0.12, lw=0)
        windows = sorted(
            {
                int(w.get("last_step", 0)) - int(w.get("first_step", 0)) + 1
                for w in data["rank_windows"]
            }
        )
        size = f"{windows[0]}-step " if len(windows) == 1 else ""
        axes[2].set_title(
            f"{axes[2].get_title(loc='left')}\nshaded, steps < {downsampled}: per-rank rows pruned "
            f"by the collector's retention; heatmaps from {size}rank windows (flagged ranks kept "
            "their rows)",
            fontsize=9,
            loc="left",
        )
    for a in axes[2:]:
        a.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for a in axes[:2]:
        a.grid(alpha=0.3)
    # Fixed margins (not tight_layout): room on the right for the twin axes, the colour bars and
    # the events legend, the same for every panel.
    where = where_lines(data)
    if where:
        fig.text(
            0.07,
            0.005,
            "where in the model (robust z of each parameter group's gradient norm): "
            + " | ".join(where),
            fontsize=8,
            va="bottom",
            wrap=True,
        )
    fig.subplots_adjust(left=0.07, right=0.80, top=0.96, bottom=0.04, hspace=0.25)
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m rankscope.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        print(f"rankscope.report: needs matplotlib and numpy ({e})", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"rankscope.report: cannot write {args.output}: {e}", file=sys.stderr)
        return 1
    note = ""
    if data["downsampled_before_step"] > int(data["steps"][0].get("step", 0)):
        note = (
            f"; steps < {data['downsampled_before_step']} from "
            f"{len(data['rank_windows'])} downsampled rank windows"
        )
    print(f"wrote {args.output} ({len(data['steps'])} steps{note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
