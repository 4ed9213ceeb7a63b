"""rankscope / Job: one training job: the smooth global loss beside the dispersion it hides,
the rank that disagrees, replica checks, noise scale and stragglers."""

from panels import (
    by_ref,
    dashboard,
    dashed_ref,
    datasource_var,
    fixed_color,
    group_var,
    heatmap,
    layout,
    q,
    row,
    stat,
    steps,
    table,
    table_q,
    timeseries,
    train_job_var,
)


# Long: the dashboard's panels as data, in their order on the page: one list reads as the dashboard
# does.
def job():
    # Series of the chosen data-parallel group(s); a job with one group has no group label,
    # which the "All" value (.*) matches. Thresholds are per job only (tsel).
    sel = 'train_job="$train_job", group=~"$group"'
    tsel = 'train_job="$train_job"'
    firing = f'alertname=~"Rankscope.*", alertstate="firing", {sel}'

    def rate(metric):
        return f"sum(rate({metric}{{{sel}}}[$__rate_interval]))"

    per_rank_table = table(
        "Most deviating ranks, latest step (capped to the collector's per-rank series limit)",
        [
            table_q(f"max by (rank) (rankscope_rank_grad_cosine{{{sel}}})", "A"),
            table_q(f"max by (rank) (rankscope_rank_loss_z{{{sel}}})", "B"),
            table_q(f"max by (rank) (rankscope_rank_grad_norm_z{{{sel}}})", "C"),
            table_q(f"max by (rank) (rankscope_rank_outlier_score{{{sel}}})", "D"),
            table_q(f"max by (rank) (rankscope_rank_step_time_seconds{{{sel}}})", "E"),
            table_q(f"max by (rank) (rankscope_rank_replica_divergent{{{sel}}})", "F"),
            table_q(f"max by (rank) (rankscope_rank_missing{{{sel}}})", "G"),
            table_q(f"max by (rank) (rankscope_rank_step_time_z{{{sel}}})", "H"),
        ],
        rename={
            "Value #A": "consensus cosine",
            "Value #B": "loss z",
            "Value #C": "grad-norm z",
            "Value #D": "outlier score",
            "Value #E": "step time (s)",
            "Value #F": "replica divergent",
            "Value #G": "missing",
            "Value #H": "step time z",
        },
        description=(
            "Consensus cosine: the rank's gradient against the sum of the other ranks' "
            "(healthy ranks sit close together; the culprit sits low). z: distance from "
            "the ranks' mean in standard deviations."
        ),
        sort_by=("consensus cosine", False),
    )
    return dashboard(
        "rankscope-job",
        "rankscope / Job",
        "One training job: the smooth global loss beside the dispersion it hides, the rank that "
        "disagrees, replica checks, noise scale and stragglers.",
        [datasource_var(), train_job_var(multi=False), group_var()],
        layout(
            [
                (4, 4, stat("Step", [q(f"max(rankscope_step{{{sel}}})")], graph=False)),
                (4, 4, stat("World size", [q(f"max(rankscope_world_size{{{sel}}})")], graph=False)),
                (
                    4,
                    4,
                    stat(
                        "Ranks in the latest step",
                        [q(f"max(rankscope_ranks_reporting{{{sel}}})")],
                        graph=False,
                    ),
                ),
                (4, 4, stat("Steps/s", [q(f"max(train_job:rankscope_steps:rate2m{{{sel}}})")])),
                (
                    4,
                    4,
                    stat(
                        "Direction consistency",
                        [q(f"max(rankscope_grad_cosine_mean{{{sel}}})")],
                        unit="none",
                    ),
                ),
                (
                    4,
                    4,
                    stat(
                        "Firing alerts",
                        [q(f"count(ALERTS{{{firing}}}) or vector(0)")],
                        thresholds=steps((1, "red")),
                        graph=False,
                    ),
                ),
            ],
            row("The loss curve you watch, and what it hides"),
            [
                (
                    6,
                    9,
                    timeseries(
                        "Global mean loss",
                        [
                            q(
                                f"max(rankscope_loss_mean{{{sel}}})",
                                "mean of the ranks' local losses",
                            )
                        ],
                        description="What the training log shows. It can stay smooth while the ranks "
                        "disagree.",
                        legend_calcs=(),
                    ),
                ),
                (
                    6,
                    9,
                    timeseries(
                        "Loss dispersion",
                        [
                            q(f"max(rankscope_loss_std{{{sel}}})", "std (latest step)", "A"),
                            q(
                                f"max(rankscope_loss_std_max_window{{{sel}}})",
                                "std (worst in 60 s)",
                                "B",
                            ),
                            q(
                                f"max(rankscope_loss_range_max_window{{{sel}}})",
                                "range max-min (worst in 60 s)",
                                "C",
                            ),
                            q(
                                f"max(rankscope:threshold:loss_std_max{{{tsel}}})",
                                "alert threshold",
                                "T",
                            ),
                        ],
                        min_=0,
                        overrides=[dashed_ref("T", "red")],
                        description="Population std and range of the ranks' local losses.",
                    ),
                ),
                (
                    6,
                    9,
                    timeseries(
                        "Gradient-norm dispersion",
                        [
                            q(f"max(rankscope_grad_norm_cv{{{sel}}})", "CV (latest step)", "A"),
                            q(
                                f"max(rankscope_grad_norm_cv_max_window{{{sel}}})",
                                "CV (worst in 60 s)",
                                "B",
                            ),
                            q(
                                f"max(rankscope:threshold:grad_norm_cv_max{{{tsel}}})",
                                "alert threshold",
                                "T",
                            ),
                        ],
                        unit="percentunit",
                        min_=0,
                        overrides=[dashed_ref("T", "red")],
                        description="Coefficient of variation (std/mean) of the exact local gradient "
                        "norms.",
                    ),
                ),
                (
                    6,
                    9,
                    timeseries(
                        "Direction consistency",
                        [
                            q(
                                f"max(rankscope_grad_cosine_mean{{{sel}}})",
                                "mean pairwise cosine (latest step)",
                                "A",
                            ),
                            q(
                                f"max(rankscope_grad_cosine_mean_min_window{{{sel}}})",
                                "worst in 60 s",
                                "B",
                            ),
                            q(
                                f"train_job:rankscope_grad_cosine_mean:median30m{{{sel}}}",
                                "baseline (30 m median)",
                                "C",
                            ),
                            q(
                                f"max(rankscope:threshold:grad_cosine_mean_min{{{tsel}}})",
                                "alert floor",
                                "T",
                            ),
                            q(
                                f"(1 - rankscope:threshold:grad_cosine_mean_drop_ratio{{{tsel}}}) "
                                "* on (train_job) group_right () "
                                f"train_job:rankscope_grad_cosine_mean:median30m{{{sel}}}",
                                "alert below baseline",
                                "U",
                            ),
                        ],
                        unit="none",
                        max_=1,
                        overrides=[
                            dashed_ref("C", "blue"),
                            dashed_ref("T", "red"),
                            dashed_ref("U", "orange"),
                        ],
                        description="Mean pairwise cosine of the ranks' gradient sketches.",
                    ),
                ),
            ],
            row("Which rank?"),
            [
                (
                    12,
                    9,
                    heatmap(
                        "Consensus cosine per rank",
                        [q(f"max by (rank) (rankscope_rank_grad_cosine{{{sel}}})", "{{rank}}")],
                        min_=-1,
                        max_=1,
                        description="cos(rank's gradient, sum of the others'). A rank in red "
                        "disagrees.",
                    ),
                ),
                (
                    12,
                    9,
                    heatmap(
                        "Outlier score per rank",
                        [q(f"max by (rank) (rankscope_rank_outlier_score{{{sel}}})", "{{rank}}")],
                        reverse=True,
                        min_=0,
                        description="Robust score combining loss z, grad-norm z and consensus "
                        "cosine, held over the rank's last 3 steps (the smallest; above "
                        "6: a persistent outlier).",
                    ),
                ),
            ],
            [
                (
                    12,
                    8,
                    heatmap(
                        "Drift score per rank (CUSUM)",
                        [q(f"max by (rank) (rankscope_rank_drift_score{{{sel}}})", "{{rank}}")],
                        reverse=True,
                        min_=0,
                        max_=2,
                        description="Sequential (CUSUM) score of a small but persistent shift in the "
                        "rank's loss, gradient norm or consensus cosine, as a fraction of "
                        "its threshold: at 1 the rank is named drifting.",
                    ),
                ),
                (
                    12,
                    8,
                    heatmap(
                        "Slow score per rank (CUSUM)",
                        [q(f"max by (rank) (rankscope_rank_slow_score{{{sel}}})", "{{rank}}")],
                        reverse=True,
                        min_=0,
                        max_=2,
                        description="Sequential (CUSUM) score of the rank's share of the step time, "
                        "as a fraction of its threshold: at 1 the rank is named slow "
                        "(a straggler).",
                    ),
                ),
            ],
            [(24, 9, per_rank_table)],
            [
                (
                    12,
                    8,
                    timeseries(
                        "Loss z-score per rank",
                        [q(f"max by (rank) (rankscope_rank_loss_z{{{sel}}})", "rank {{rank}}")],
                        unit="none",
                        legend_calcs=("lastNotNull",),
                    ),
                ),
                (
                    12,
                    8,
                    timeseries(
                        "Gradient-norm z-score per rank",
                        [
                            q(
                                f"max by (rank) (rankscope_rank_grad_norm_z{{{sel}}})",
                                "rank {{rank}}",
                            )
                        ],
                        unit="none",
                        legend_calcs=("lastNotNull",),
                    ),
                ),
            ],
            row("Replicas"),
            [
                (
                    6,
                    8,
                    stat(
                        "Ranks with diverged replicas (worst step in 60 s)",
                        [q(f"max(rankscope_replica_divergent_ranks{{{sel}}})")],
                        thresholds=steps((1, "red")),
                        description="Ranks whose reduced gradients or parameters differ bit-wise from "
                        "the majority.",
                    ),
                ),
                (
                    6,
                    8,
                    timeseries(
                        "Replica checks",
                        [
                            q(rate("rankscope_replica_checks_total"), "steps checked/s", "A"),
                            q(
                                rate("rankscope_replica_divergent_steps_total"),
                                "steps with a divergent rank/s",
                                "B",
                            ),
                        ],
                        min_=0,
                        overrides=[by_ref("B", fixed_color("red"))],
                        description="Every step's reduced-gradient fingerprints and, periodically, "
                        "the parameters' are compared across ranks.",
                    ),
                ),
                (
                    12,
                    8,
                    timeseries(
                        "Diverged replica per rank (1 = differs from the majority)",
                        [
                            q(
                                f"max by (rank) (rankscope_rank_replica_divergent{{{sel}}})",
                                "rank {{rank}}",
                            )
                        ],
                        unit="none",
                        min_=0,
                        max_=1,
                        draw="bars",
                        legend_calcs=("max",),
                    ),
                ),
            ],
            row("Throughput, noise scale and stragglers"),
            [
                (
                    8,
                    8,
                    timeseries(
                        "Gradient noise scale B_simple",
                        [q(f"max(rankscope_grad_noise_scale{{{sel}}})", "B_simple (samples)")],
                        min_=0,
                        description="tr(Sigma)/|G|^2 (McCandlish et al. 2018): the batch size "
                        "beyond which more data per step stops helping.",
                    ),
                ),
                (
                    8,
                    8,
                    timeseries(
                        "Step time per rank (compute up to the gradient hook)",
                        [
                            q(
                                f"max by (rank) (rankscope_rank_step_time_seconds{{{sel}}})",
                                "rank {{rank}}",
                            )
                        ],
                        unit="s",
                        min_=0,
                        description="The straggler is the top line "
                        "(RankscopeRankStraggler: robust z above 6).",
                    ),
                ),
                (
                    8,
                    8,
                    timeseries(
                        "Steps per second",
                        [
                            q(rate("rankscope_steps_total"), "steps closed", "A"),
                            q(
                                rate("rankscope_steps_timed_out_total"),
                                "closed on timeout (ranks missing)",
                                "B",
                            ),
                            q(
                                rate("rankscope_steps_nonfinite_total"),
                                "with a NaN/Inf loss or norm",
                                "C",
                            ),
                        ],
                        min_=0,
                    ),
                ),
            ],
            row("Delivery"),
            [
                (
                    8,
                    8,
                    timeseries(
                        "Ranks",
                        [
                            q(f"max(rankscope_world_size{{{sel}}})", "world size", "A"),
                            q(
                                f"max(rankscope_ranks_reporting{{{sel}}})",
                                "in the latest step",
                                "B",
                            ),
                            q(f"sum(rankscope_connected_agents{{{sel}}})", "agents connected", "C"),
                        ],
                        min_=0,
                    ),
                ),
                (
                    8,
                    8,
                    timeseries(
                        "Ranks missing from the latest step",
                        [q(f"max by (rank) (rankscope_rank_missing{{{sel}}})", "rank {{rank}}")],
                        unit="none",
                        min_=0,
                        max_=1,
                        draw="bars",
                        legend_calcs=("max",),
                    ),
                ),
                (
                    8,
                    8,
                    timeseries(
                        "Reports dropped by the agents",
                        [q(rate("rankscope_agent_dropped_reports_total"), "dropped/s")],
                        unit="reqps",
                        min_=0,
                    ),
                ),
            ],
            [
                (
                    24,
                    7,
                    table(
                        "Firing alerts of this job",
                        [
                            table_q(
                                "max by (alertname, severity, rank, signal, condition) "
                                f"(ALERTS{{{firing}}})"
                            )
                        ],
                        rename={},
                        hide=("Time", "Value"),
                        no_value="No rankscope alert is firing for this job.",
                    ),
                )
            ],
        ),
    )
