"""rankscope / Overview: every training job rankscope watches (are its ranks consistent,
which job needs a look); a job links to rankscope / Job."""

from panels import (
    COLLECTOR_JOBS,
    by_name,
    dashboard,
    datasource_var,
    field_link,
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

JOB_LINK = (
    "/d/rankscope-job/rankscope-job?${__url_time_range}&var-datasource=${datasource}"
    "&var-train_job=${__value.raw}"
)


# Long: the dashboard's panels as data, in their order on the page: one list reads as the dashboard
# does.
def overview():
    sel = 'train_job=~"$train_job"'
    firing = 'alertname=~"Rankscope.*", alertstate="firing"'
    jobs_table = table(
        "Watched jobs (latest step)",
        [
            table_q(f"max by (train_job) (rankscope_world_size{{{sel}}})", "A"),
            table_q(f"max by (train_job) (rankscope_ranks_reporting{{{sel}}})", "B"),
            table_q(f"max by (train_job) (rankscope_step{{{sel}}})", "C"),
            table_q(f"max by (train_job) (train_job:rankscope_steps:rate2m{{{sel}}})", "D"),
            table_q(f"max by (train_job) (rankscope_loss_mean{{{sel}}})", "E"),
            table_q(f"max by (train_job) (rankscope_loss_std_max_window{{{sel}}})", "F"),
            table_q(f"max by (train_job) (rankscope_grad_norm_cv_max_window{{{sel}}})", "G"),
            table_q(f"max by (train_job) (rankscope_grad_cosine_mean_min_window{{{sel}}})", "H"),
            table_q(f"count by (train_job) (ALERTS{{{firing}, {sel}}})", "I"),
        ],
        rename={
            "train_job": "job",
            "Value #A": "world size",
            "Value #B": "ranks reporting",
            "Value #C": "step",
            "Value #D": "steps/s",
            "Value #E": "mean loss",
            "Value #F": "loss std (worst 60 s)",
            "Value #G": "grad-norm CV (worst 60 s)",
            "Value #H": "direction consistency (worst 60 s)",
            "Value #I": "firing alerts",
        },
        description="One row per training job. Click a job to open its job view.",
        sort_by=("firing alerts", True),
        overrides=[by_name("train_job", field_link("Open the job view", JOB_LINK))],
    )
    return dashboard(
        "rankscope-overview",
        "rankscope / Overview",
        "Every training job rankscope watches: are its ranks consistent, and which job needs a "
        "look.",
        [datasource_var(), train_job_var(multi=True)],
        layout(
            [
                (
                    4,
                    4,
                    stat(
                        "Jobs watched",
                        [q(f"count(max by (train_job) (rankscope_world_size{{{sel}}}))")],
                        graph=False,
                    ),
                ),
                (
                    4,
                    4,
                    stat(
                        "Ranks watched",
                        [q(f"sum(max by (train_job) (rankscope_world_size{{{sel}}}))")],
                        graph=False,
                    ),
                ),
                (
                    4,
                    4,
                    stat(
                        "Ranks missing from the latest step",
                        [q(f"sum(train_job:rankscope_ranks_missing:latest{{{sel}}})")],
                        thresholds=steps((1, "orange")),
                        graph=False,
                    ),
                ),
                (
                    4,
                    4,
                    stat(
                        "Firing rankscope alerts",
                        [q(f"count(ALERTS{{{firing}}}) or vector(0)")],
                        thresholds=steps((1, "red")),
                        graph=False,
                    ),
                ),
                (4, 4, stat("Collectors up", [q(f"sum(up{{{COLLECTOR_JOBS}}})")], graph=False)),
                (
                    4,
                    4,
                    stat(
                        "Reports/s ingested",
                        [
                            q(
                                "sum(rate(rankscope_reports_received_total"
                                f"{{{COLLECTOR_JOBS}}}[$__rate_interval]))"
                            )
                        ],
                        unit="reqps",
                    ),
                ),
            ],
            [(24, 9, jobs_table)],
            row("Consistency of each job"),
            [
                (
                    12,
                    8,
                    timeseries(
                        "Direction consistency (mean pairwise gradient cosine)",
                        [
                            q(
                                f"max by (train_job) (rankscope_grad_cosine_mean{{{sel}}})",
                                "{{train_job}}",
                            )
                        ],
                        unit="none",
                        max_=1,
                        description="1: all ranks' gradients point the same way; 0: no shared "
                        "direction.",
                    ),
                ),
                (
                    12,
                    8,
                    timeseries(
                        "Loss dispersion, worst step of each 60 s (std of the ranks' local losses)",
                        [
                            q(
                                f"max by (train_job) (rankscope_loss_std_max_window{{{sel}}})",
                                "{{train_job}}",
                            )
                        ],
                        min_=0,
                    ),
                ),
            ],
            [
                (
                    12,
                    8,
                    timeseries(
                        "Gradient-norm dispersion, worst step of each 60 s (CV of local gradient "
                        "norms)",
                        [
                            q(
                                f"max by (train_job) (rankscope_grad_norm_cv_max_window{{{sel}}})",
                                "{{train_job}}",
                            )
                        ],
                        unit="percentunit",
                        min_=0,
                    ),
                ),
                (
                    12,
                    8,
                    timeseries(
                        "Steps per second",
                        [
                            q(
                                f"sum by (train_job) (rate(rankscope_steps_total{{{sel}}}"
                                "[$__rate_interval]))",
                                "{{train_job}}",
                            )
                        ],
                        min_=0,
                    ),
                ),
            ],
            [
                (
                    24,
                    8,
                    table(
                        "Firing rankscope alerts",
                        [
                            table_q(
                                "max by (alertname, severity, train_job, rank, instance) "
                                f"(ALERTS{{{firing}}})"
                            )
                        ],
                        rename={"Value": "firing"},
                        hide=("Time", "Value"),
                        no_value="No rankscope alert is firing.",
                        description="Alerts of deploy/prometheus/rules/rankscope.rules.yml; runbook "
                        "linked above.",
                    ),
                )
            ],
        ),
    )
