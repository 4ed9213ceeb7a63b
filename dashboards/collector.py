"""rankscope / Collector: the collector's own health: ingest, rejections, SQLite store,
streams, scrapes."""

from panels import (
    COLLECTOR_JOBS,
    dashboard,
    datasource_var,
    label_var,
    layout,
    q,
    row,
    stat,
    steps,
    timeseries,
    train_job_var,
    value_map,
)


# Long: the dashboard's panels as data, in their order on the page: one list reads as the dashboard
# does.
def collector():
    inst = f'{COLLECTOR_JOBS}, instance=~"$instance"'

    def up_or_not():
        return steps((1, "green"), base="red")

    def p(quantile, metric, legend):
        return q(
            f"histogram_quantile({quantile}, sum by (instance, le) "
            f"(rate({metric}_bucket{{{inst}}}[$__rate_interval])))",
            legend,
            "A" if quantile == 0.5 else "B",
        )

    def rate(metric, by):
        return f"sum by ({by}) (rate({metric}{{{inst}}}[$__rate_interval]))"

    return dashboard(
        "rankscope-collector",
        "rankscope / Collector",
        "The rankscope collector's own health: ingest, rejections, SQLite store, streams, scrapes.",
        [
            datasource_var(),
            label_var(
                "instance",
                "Collector",
                f"label_values(up{{{COLLECTOR_JOBS}}}, instance)",
                True,
                description="Collector instances (scrape targets of the rankscope-collector job).",
            ),
            train_job_var(multi=True),
        ],
        layout(
            [
                (
                    6,
                    5,
                    stat(
                        "Collector up",
                        [q(f"up{{{inst}}}", "{{instance}}")],
                        thresholds=up_or_not(),
                        mappings=[value_map((0, "red", "DOWN"), (1, "green", "UP"))],
                        graph=False,
                    ),
                ),
                (6, 5, stat("gRPC streams open", [q(f"sum(rankscope_streams_open{{{inst}}})")])),
                (
                    6,
                    5,
                    stat(
                        "Store queue depth",
                        [q(f"sum(rankscope_store_queue_depth{{{inst}}})")],
                        thresholds=steps((1000, "orange")),
                    ),
                ),
                (
                    6,
                    5,
                    stat(
                        "Series exported per scrape",
                        [q(f"sum(scrape_samples_scraped{{{inst}}})")],
                        description="Bounded: per-rank series are capped per job.",
                    ),
                ),
            ],
            row("Ingest"),
            [
                (
                    8,
                    8,
                    timeseries(
                        "Reports received",
                        [q(rate("rankscope_reports_received_total", "instance"), "{{instance}}")],
                        unit="reqps",
                        min_=0,
                    ),
                ),
                (
                    8,
                    8,
                    timeseries(
                        "Reports rejected, by reason",
                        [q(rate("rankscope_reports_rejected_total", "reason"), "{{reason}}")],
                        unit="reqps",
                        min_=0,
                        description="Never stored. A steady rate means a misconfigured agent "
                        "(RankscopeIngestRejecting).",
                    ),
                ),
                (
                    8,
                    8,
                    timeseries(
                        "Late, duplicate and evicted",
                        [
                            q(
                                f"sum(rate(rankscope_reports_late_total{{{inst}}}[$__rate_interval]))",
                                "late reports/s",
                                "A",
                            ),
                            q(
                                f"sum(rate(rankscope_reports_duplicate_total{{{inst}}}"
                                "[$__rate_interval]))",
                                "duplicate reports/s (resent after reconnect)",
                                "B",
                            ),
                            q(
                                f"sum(rate(rankscope_steps_evicted_total{{{inst}}}[$__rate_interval]))",
                                "open steps evicted/s",
                                "C",
                            ),
                        ],
                        unit="reqps",
                        min_=0,
                    ),
                ),
            ],
            [
                (
                    12,
                    8,
                    timeseries(
                        "Ingest latency",
                        [
                            p(0.5, "rankscope_ingest_latency_seconds", "p50 {{instance}}"),
                            p(0.99, "rankscope_ingest_latency_seconds", "p99 {{instance}}"),
                        ],
                        unit="s",
                        min_=0,
                    ),
                ),
                (
                    12,
                    8,
                    timeseries(
                        "Agents connected, by job",
                        [
                            q(
                                'sum by (train_job) (rankscope_connected_agents{train_job=~"$train_job"})',
                                "{{train_job}}",
                            )
                        ],
                        min_=0,
                        stack=True,
                    ),
                ),
            ],
            row("SQLite store"),
            [
                (
                    6,
                    8,
                    stat(
                        "Store healthy",
                        [q(f"min(rankscope_store_healthy{{{inst}}})", "{{instance}}")],
                        description="0 while SQLite commits fail (disk full, file unwritable, "
                        "lock held): nothing is acked, agents hold their reports "
                        "(RankscopeStoreFailing). The log says why.",
                        thresholds=up_or_not(),
                        mappings=[value_map((0, "red", "FAILING"), (1, "green", "OK"))],
                        graph=False,
                    ),
                ),
                (
                    6,
                    8,
                    timeseries(
                        "Commit latency",
                        [
                            p(0.5, "rankscope_store_commit_seconds", "p50 {{instance}}"),
                            p(0.99, "rankscope_store_commit_seconds", "p99 {{instance}}"),
                        ],
                        unit="s",
                        min_=0,
                        description="Acks go to the agents after the commit.",
                    ),
                ),
                (
                    6,
                    8,
                    timeseries(
                        "Store queue depth",
                        [
                            q(
                                f"sum by (instance) (rankscope_store_queue_depth{{{inst}}})",
                                "{{instance}}",
                            )
                        ],
                        min_=0,
                    ),
                ),
                (
                    6,
                    8,
                    timeseries(
                        "Store errors and dropped items",
                        [
                            q(
                                rate("rankscope_store_errors_total", "instance"),
                                "failed commits/s {{instance}}",
                                "A",
                            ),
                            q(
                                rate("rankscope_store_dropped_items_total", "instance"),
                                "items dropped unstored/s {{instance}}",
                                "B",
                            ),
                        ],
                        unit="reqps",
                        min_=0,
                        description="Dropped items were never acked: their streams are ended so the "
                        "agents resend them.",
                    ),
                ),
            ],
            row("Scrapes of the collector"),
            [
                (
                    12,
                    8,
                    timeseries(
                        "Scrape duration",
                        [q(f"scrape_duration_seconds{{{inst}}}", "{{instance}}")],
                        unit="s",
                        min_=0,
                    ),
                ),
                (
                    12,
                    8,
                    timeseries(
                        "Samples per scrape",
                        [q(f"scrape_samples_scraped{{{inst}}}", "{{instance}}")],
                        min_=0,
                    ),
                ),
            ],
        ),
    )
