#!/usr/bin/env python3
"""Writes the rankscope Grafana dashboards, dashboards/*.json, from this file.

    /usr/bin/python3 dashboards/generate.py          # rewrite the JSON files
    /usr/bin/python3 dashboards/generate.py --check  # exit 1 if a JSON file is out of date

The JSON files are what Grafana loads (provisioning, ConfigMap, import); this script keeps the
three dashboards' conventions in one place: the `datasource` and `train_job` variables, units,
legends, threshold lines read from the `rankscope:threshold:*` recording rules. After changing a
dashboard in Grafana's UI, port the change here. tests/ops checks the files are current, valid
against Grafana's types (tests/ops/dashboard_check) and, end to end, that every query returns data.
"""
import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
SCHEMA_VERSION = 39  # Grafana 10.3 - 11.x; newer Grafana migrates it on load.
DS = {"type": "prometheus", "uid": "${datasource}"}
RUNBOOK = "https://github.com/rankscope/rankscope/blob/main/docs/runbook.md"
COLLECTOR_JOBS = 'job=~"rankscope-collector.*"'


# ---------------------------------------------------------------------------------------------
# Queries and panels


def q(expr, legend="__auto", ref="A", instant=False, fmt=None):
    target = {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "instant": instant,
        "legendFormat": legend,
        "range": not instant,
        "refId": ref,
    }
    if fmt:
        target["format"] = fmt
    return target


def _thresholds(*steps):
    out = [{"color": "green", "value": None}]
    for value, color in steps:
        out.append({"color": color, "value": value})
    return {"mode": "absolute", "steps": out}


def dashed_ref(ref, color):
    """Override drawing the series of query `ref` as a dashed line: thresholds and baselines."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "color", "value": {"fixedColor": color, "mode": "fixed"}},
        ],
    }


def timeseries(title, targets, unit="short", description="", overrides=(), min_=None, max_=None,
               legend_calcs=("lastNotNull", "max"), stack=False, draw="line"):
    defaults = {
        "color": {"mode": "palette-classic"},
        "custom": {
            "axisPlacement": "auto",
            "drawStyle": draw,
            "fillOpacity": 10 if stack else 0,
            "lineInterpolation": "linear",
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if stack else "none"},
            "thresholdsStyle": {"mode": "off"},
        },
        "thresholds": _thresholds(),
        "unit": unit,
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": {
            "legend": {"calcs": list(legend_calcs), "displayMode": "table" if legend_calcs else "list",
                       "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def stat(title, targets, unit="short", description="", thresholds=None, mappings=(), graph=True,
         no_value=None):
    defaults = {
        "color": {"mode": "thresholds"},
        "mappings": list(mappings),
        "thresholds": thresholds or _thresholds(),
        "unit": unit,
    }
    if no_value is not None:
        defaults["noValue"] = no_value
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "colorMode": "value",
            "graphMode": "area" if graph else "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "percentChangeColorMode": "standard",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showPercentChange": False,
            "textMode": "auto",
            "wideLayout": True,
        },
        "targets": targets,
    }


def table(title, targets, rename, description="", sort_by=None, overrides=(), no_value=None,
          hide=("Time",)):
    defaults = {
        "custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False},
        "thresholds": _thresholds(),
    }
    if no_value is not None:
        defaults["noValue"] = no_value
    options = {"cellHeight": "sm", "frameIndex": 0, "showHeader": True}
    if sort_by:
        options["sortBy"] = [{"desc": sort_by[1], "displayName": sort_by[0]}]
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": options,
        "targets": targets,
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {name: True for name in hide},
                "indexByName": {},
                "renameByName": rename,
            }},
        ],
    }


def heatmap(title, targets, description="", scheme="RdYlGn", reverse=False, min_=None, max_=None,
            unit="short"):
    color = {"exponent": 0.5, "fill": "dark-orange", "mode": "scheme", "reverse": reverse,
             "scale": "linear", "scheme": scheme, "steps": 64}
    if min_ is not None:
        color["min"] = min_
    if max_ is not None:
        color["max"] = max_
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {"custom": {"hideFrom": {"legend": False, "tooltip": False, "viz": False},
                                    "scaleDistribution": {"type": "linear"}}},
            "overrides": [],
        },
        "options": {
            "calculate": False,
            "cellGap": 1,
            "cellValues": {"unit": unit},
            "color": color,
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto", "value": "value"},
            "showValue": "never",
            "tooltip": {"mode": "single", "showColorScale": True, "yHistogram": False},
            "yAxis": {"axisLabel": "rank", "axisPlacement": "left", "reverse": False},
        },
        "targets": targets,
    }


def row(title):
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(*lines):
    """Each line: a row panel or a list of (width, height, panel). Assigns ids and gridPos."""
    panels, y, next_id = [], 0, 1
    for line in lines:
        if isinstance(line, dict):
            line["id"] = next_id
            line["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            next_id += 1
            y += 1
            panels.append(line)
            continue
        x, height = 0, 0
        for width, h, panel in line:
            if x + width > 24:
                raise ValueError(f"row overflows 24 columns at {panel['title']!r}")
            panel["id"] = next_id
            panel["gridPos"] = {"h": h, "w": width, "x": x, "y": y}
            next_id += 1
            x += width
            height = max(height, h)
            panels.append(panel)
        y += height
    return panels


# ---------------------------------------------------------------------------------------------
# Variables and the dashboard envelope


def datasource_var():
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "regex": "", "hide": 0, "includeAll": False, "multi": False, "refresh": 1, "options": [],
            "skipUrlSync": False}


def label_var(name, label, query, multi, all_value=None, description=""):
    var = {"name": name, "label": label, "description": description, "type": "query",
           "datasource": DS, "query": query, "regex": "", "hide": 0, "includeAll": multi,
           "multi": multi, "refresh": 2, "sort": 1, "options": [], "skipUrlSync": False}
    if multi:
        var["allValue"] = all_value or ".+"
    return var


def train_job_var(multi):
    return label_var("train_job", "Training job", "label_values(rankscope_world_size, train_job)",
                     multi, description="The training job (label train_job) reported by the collector.")


def dashboard(uid, title, description, variables, panels, time_from="now-3h"):
    return {
        "annotations": {"list": [{
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        }]},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [{
            "asDropdown": False, "icon": "external link", "includeVars": False, "keepTime": True,
            "tags": ["rankscope"], "targetBlank": False, "title": "rankscope dashboards",
            "tooltip": "", "type": "dashboards", "url": "",
        }, {
            "asDropdown": False, "icon": "doc", "includeVars": False, "keepTime": False,
            "tags": [], "targetBlank": True, "title": "Runbook", "tooltip": "What each alert means",
            "type": "link", "url": RUNBOOK,
        }],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["rankscope"],
        "templating": {"list": variables},
        "time": {"from": time_from, "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


JOB_LINK = ("/d/rankscope-job/rankscope-job?${__url_time_range}&var-datasource=${datasource}"
            "&var-train_job=${__value.raw}")


# ---------------------------------------------------------------------------------------------
# rankscope / Overview


def overview():
    sel = 'train_job=~"$train_job"'
    jobs_table = table(
        "Watched jobs (latest step)",
        [
            q(f"max by (train_job) (rankscope_world_size{{{sel}}})", ref="A", instant=True, fmt="table"),
            q(f"max by (train_job) (rankscope_ranks_reporting{{{sel}}})", ref="B", instant=True, fmt="table"),
            q(f"max by (train_job) (rankscope_step{{{sel}}})", ref="C", instant=True, fmt="table"),
            q(f"train_job:rankscope_steps:rate2m{{{sel}}}", ref="D", instant=True, fmt="table"),
            q(f"max by (train_job) (rankscope_loss_mean{{{sel}}})", ref="E", instant=True, fmt="table"),
            q(f"max by (train_job) (rankscope_loss_std_max_window{{{sel}}})", ref="F", instant=True, fmt="table"),
            q(f"max by (train_job) (rankscope_grad_norm_cv_max_window{{{sel}}})", ref="G", instant=True, fmt="table"),
            q(f"max by (train_job) (rankscope_grad_cosine_mean_min_window{{{sel}}})", ref="H", instant=True, fmt="table"),
            q(f'count by (train_job) (ALERTS{{alertname=~"Rankscope.*", alertstate="firing", {sel}}})',
              ref="I", instant=True, fmt="table"),
        ],
        rename={"train_job": "job", "Value #A": "world size", "Value #B": "ranks reporting",
                "Value #C": "step", "Value #D": "steps/s", "Value #E": "mean loss",
                "Value #F": "loss std (worst 60 s)", "Value #G": "grad-norm CV (worst 60 s)",
                "Value #H": "direction consistency (worst 60 s)", "Value #I": "firing alerts"},
        description="One row per training job. Click a job to open its job view.",
        sort_by=("firing alerts", True),
        overrides=[{
            "matcher": {"id": "byName", "options": "train_job"},
            "properties": [{"id": "links", "value": [{"title": "Open the job view", "url": JOB_LINK}]}],
        }],
    )
    return dashboard(
        "rankscope-overview", "rankscope / Overview",
        "Every training job rankscope watches: are its ranks consistent, and which job needs a look.",
        [datasource_var(), train_job_var(multi=True)],
        layout(
            [
                (4, 4, stat("Jobs watched", [q(f"count(max by (train_job) (rankscope_world_size{{{sel}}}))")],
                            graph=False)),
                (4, 4, stat("Ranks watched", [q(f"sum(max by (train_job) (rankscope_world_size{{{sel}}}))")],
                            graph=False)),
                (4, 4, stat("Ranks missing from the latest step",
                            [q(f"sum(train_job:rankscope_ranks_missing:latest{{{sel}}})")],
                            thresholds=_thresholds((1, "orange")), graph=False)),
                (4, 4, stat("Firing rankscope alerts",
                            [q('count(ALERTS{alertname=~"Rankscope.*", alertstate="firing"}) or vector(0)')],
                            thresholds=_thresholds((1, "red")), graph=False)),
                (4, 4, stat("Collectors up", [q(f"sum(up{{{COLLECTOR_JOBS}}})")], graph=False)),
                (4, 4, stat("Reports/s ingested",
                            [q(f"sum(rate(rankscope_reports_received_total{{{COLLECTOR_JOBS}}}[$__rate_interval]))")],
                            unit="reqps")),
            ],
            [(24, 9, jobs_table)],
            row("Consistency of each job"),
            [
                (12, 8, timeseries(
                    "Direction consistency (mean pairwise gradient cosine)",
                    [q(f"max by (train_job) (rankscope_grad_cosine_mean{{{sel}}})", "{{train_job}}")],
                    unit="none", max_=1,
                    description="1: all ranks' gradients point the same way; 0: no shared direction.")),
                (12, 8, timeseries(
                    "Loss dispersion, worst step of each 60 s (std of the ranks' local losses)",
                    [q(f"max by (train_job) (rankscope_loss_std_max_window{{{sel}}})", "{{train_job}}")],
                    min_=0)),
            ],
            [
                (12, 8, timeseries(
                    "Gradient-norm dispersion, worst step of each 60 s (CV of local gradient norms)",
                    [q(f"max by (train_job) (rankscope_grad_norm_cv_max_window{{{sel}}})", "{{train_job}}")],
                    unit="percentunit", min_=0)),
                (12, 8, timeseries(
                    "Steps per second",
                    [q(f"sum by (train_job) (rate(rankscope_steps_total{{{sel}}}[$__rate_interval]))",
                       "{{train_job}}")],
                    min_=0)),
            ],
            [(24, 8, table(
                "Firing rankscope alerts",
                [q('max by (alertname, severity, train_job, rank, instance) '
                   '(ALERTS{alertname=~"Rankscope.*", alertstate="firing"})',
                   ref="A", instant=True, fmt="table")],
                rename={"Value": "firing"}, hide=("Time", "Value"),
                no_value="No rankscope alert is firing.",
                description="Alerts of deploy/prometheus/rules/rankscope.rules.yml; runbook linked above."))],
        ),
    )


# ---------------------------------------------------------------------------------------------
# rankscope / Job


def job():
    sel = 'train_job="$train_job"'
    per_rank_table = table(
        "Most deviating ranks, latest step (capped to the collector's per-rank series limit)",
        [
            q(f"max by (rank) (rankscope_rank_grad_cosine{{{sel}}})", ref="A", instant=True, fmt="table"),
            q(f"max by (rank) (rankscope_rank_loss_z{{{sel}}})", ref="B", instant=True, fmt="table"),
            q(f"max by (rank) (rankscope_rank_grad_norm_z{{{sel}}})", ref="C", instant=True, fmt="table"),
            q(f"max by (rank) (rankscope_rank_outlier_score{{{sel}}})", ref="D", instant=True, fmt="table"),
            q(f"max by (rank) (rankscope_rank_step_time_seconds{{{sel}}})", ref="E", instant=True, fmt="table"),
            q(f"max by (rank) (rankscope_rank_replica_divergent{{{sel}}})", ref="F", instant=True, fmt="table"),
            q(f"max by (rank) (rankscope_rank_missing{{{sel}}})", ref="G", instant=True, fmt="table"),
            q(f"max by (rank) (rankscope_rank_step_time_z{{{sel}}})", ref="H", instant=True, fmt="table"),
        ],
        rename={"Value #A": "consensus cosine", "Value #B": "loss z", "Value #C": "grad-norm z",
                "Value #D": "outlier score", "Value #E": "step time (s)", "Value #F": "replica divergent",
                "Value #G": "missing", "Value #H": "step time z"},
        description=("Consensus cosine: the rank's gradient against the sum of the other ranks' "
                     "(healthy ranks sit close together; the culprit sits low). z: distance from the "
                     "ranks' mean in standard deviations."),
        sort_by=("consensus cosine", False),
    )
    return dashboard(
        "rankscope-job", "rankscope / Job",
        "One training job: the smooth global loss beside the dispersion it hides, the rank that "
        "disagrees, replica checks, noise scale and stragglers.",
        [datasource_var(), train_job_var(multi=False)],
        layout(
            [
                (4, 4, stat("Step", [q(f"max(rankscope_step{{{sel}}})")], graph=False)),
                (4, 4, stat("World size", [q(f"max(rankscope_world_size{{{sel}}})")], graph=False)),
                (4, 4, stat("Ranks in the latest step", [q(f"max(rankscope_ranks_reporting{{{sel}}})")],
                            graph=False)),
                (4, 4, stat("Steps/s", [q(f"train_job:rankscope_steps:rate2m{{{sel}}}")])),
                (4, 4, stat("Direction consistency", [q(f"max(rankscope_grad_cosine_mean{{{sel}}})")],
                            unit="none")),
                (4, 4, stat("Firing alerts",
                            [q(f'count(ALERTS{{alertname=~"Rankscope.*", alertstate="firing", {sel}}}) '
                               'or vector(0)')],
                            thresholds=_thresholds((1, "red")), graph=False)),
            ],
            row("The loss curve you watch, and what it hides"),
            [
                (6, 9, timeseries(
                    "Global mean loss",
                    [q(f"max(rankscope_loss_mean{{{sel}}})", "mean of the ranks' local losses")],
                    description="What the training log shows. It can stay smooth while the ranks disagree.",
                    legend_calcs=())),
                (6, 9, timeseries(
                    "Loss dispersion",
                    [q(f"max(rankscope_loss_std{{{sel}}})", "std (latest step)", "A"),
                     q(f"max(rankscope_loss_std_max_window{{{sel}}})", "std (worst in 60 s)", "B"),
                     q(f"max(rankscope_loss_range_max_window{{{sel}}})", "range max-min (worst in 60 s)", "C"),
                     q(f"max(rankscope:threshold:loss_std_max{{{sel}}})", "alert threshold", "T")],
                    min_=0, overrides=[dashed_ref("T", "red")],
                    description="Population std and range of the ranks' local losses.")),
                (6, 9, timeseries(
                    "Gradient-norm dispersion",
                    [q(f"max(rankscope_grad_norm_cv{{{sel}}})", "CV (latest step)", "A"),
                     q(f"max(rankscope_grad_norm_cv_max_window{{{sel}}})", "CV (worst in 60 s)", "B"),
                     q(f"max(rankscope:threshold:grad_norm_cv_max{{{sel}}})", "alert threshold", "T")],
                    unit="percentunit", min_=0, overrides=[dashed_ref("T", "red")],
                    description="Coefficient of variation (std/mean) of the exact local gradient norms.")),
                (6, 9, timeseries(
                    "Direction consistency",
                    [q(f"max(rankscope_grad_cosine_mean{{{sel}}})", "mean pairwise cosine (latest step)", "A"),
                     q(f"max(rankscope_grad_cosine_mean_min_window{{{sel}}})", "worst in 60 s", "B"),
                     q(f"train_job:rankscope_grad_cosine_mean:median30m{{{sel}}}", "baseline (30 m median)", "C"),
                     q(f"max(rankscope:threshold:grad_cosine_mean_min{{{sel}}})", "alert floor", "T"),
                     q(f"(1 - rankscope:threshold:grad_cosine_mean_drop_ratio{{{sel}}}) "
                       f"* train_job:rankscope_grad_cosine_mean:median30m{{{sel}}}",
                       "alert below baseline", "U")],
                    unit="none", max_=1,
                    overrides=[dashed_ref("C", "blue"), dashed_ref("T", "red"), dashed_ref("U", "orange")],
                    description="Mean pairwise cosine of the ranks' gradient sketches.")),
            ],
            row("Which rank?"),
            [
                (12, 9, heatmap(
                    "Consensus cosine per rank",
                    [q(f"max by (rank) (rankscope_rank_grad_cosine{{{sel}}})", "{{rank}}")],
                    min_=-1, max_=1,
                    description="cos(rank's gradient, sum of the others'). A rank in red disagrees.")),
                (12, 9, heatmap(
                    "Outlier score per rank",
                    [q(f"max by (rank) (rankscope_rank_outlier_score{{{sel}}})", "{{rank}}")],
                    reverse=True, min_=0,
                    description="Robust score combining loss z, grad-norm z and consensus cosine.")),
            ],
            [(24, 9, per_rank_table)],
            [
                (12, 8, timeseries(
                    "Loss z-score per rank",
                    [q(f"max by (rank) (rankscope_rank_loss_z{{{sel}}})", "rank {{rank}}")],
                    unit="none", legend_calcs=("lastNotNull",))),
                (12, 8, timeseries(
                    "Gradient-norm z-score per rank",
                    [q(f"max by (rank) (rankscope_rank_grad_norm_z{{{sel}}})", "rank {{rank}}")],
                    unit="none", legend_calcs=("lastNotNull",))),
            ],
            row("Replicas"),
            [
                (6, 8, stat(
                    "Ranks with diverged replicas (worst step in 60 s)",
                    [q(f"max(rankscope_replica_divergent_ranks{{{sel}}})")],
                    thresholds=_thresholds((1, "red")),
                    description="Ranks whose reduced gradients or parameters differ bit-wise from the majority.")),
                (6, 8, timeseries(
                    "Replica checks",
                    [q(f"sum(rate(rankscope_replica_checks_total{{{sel}}}[$__rate_interval]))",
                       "steps checked/s", "A"),
                     q(f"sum(rate(rankscope_replica_divergent_steps_total{{{sel}}}[$__rate_interval]))",
                       "steps with a divergent rank/s", "B")],
                    min_=0, overrides=[{
                        "matcher": {"id": "byFrameRefID", "options": "B"},
                        "properties": [{"id": "color", "value": {"fixedColor": "red", "mode": "fixed"}}],
                    }],
                    description="Every step's reduced-gradient fingerprints and, periodically, the "
                                "parameters' are compared across ranks.")),
                (12, 8, timeseries(
                    "Diverged replica per rank (1 = differs from the majority)",
                    [q(f"max by (rank) (rankscope_rank_replica_divergent{{{sel}}})", "rank {{rank}}")],
                    unit="none", min_=0, max_=1, draw="bars", legend_calcs=("max",))),
            ],
            row("Throughput, noise scale and stragglers"),
            [
                (8, 8, timeseries(
                    "Gradient noise scale B_simple",
                    [q(f"max(rankscope_grad_noise_scale{{{sel}}})", "B_simple (samples)")],
                    min_=0, description="tr(Sigma)/|G|^2 (McCandlish et al. 2018): the batch size "
                                        "beyond which more data per step stops helping.")),
                (8, 8, timeseries(
                    "Step time per rank (compute up to the gradient hook)",
                    [q(f"max by (rank) (rankscope_rank_step_time_seconds{{{sel}}})", "rank {{rank}}")],
                    unit="s", min_=0, description="The straggler is the top line "
                                                  "(RankscopeRankStraggler: robust z above 6).")),
                (8, 8, timeseries(
                    "Steps per second",
                    [q(f"sum(rate(rankscope_steps_total{{{sel}}}[$__rate_interval]))", "steps closed", "A"),
                     q(f"sum(rate(rankscope_steps_timed_out_total{{{sel}}}[$__rate_interval]))",
                       "closed on timeout (ranks missing)", "B"),
                     q(f"sum(rate(rankscope_steps_nonfinite_total{{{sel}}}[$__rate_interval]))",
                       "with a NaN/Inf loss or norm", "C")],
                    min_=0)),
            ],
            row("Delivery"),
            [
                (8, 8, timeseries(
                    "Ranks",
                    [q(f"max(rankscope_world_size{{{sel}}})", "world size", "A"),
                     q(f"max(rankscope_ranks_reporting{{{sel}}})", "in the latest step", "B"),
                     q(f"sum(rankscope_connected_agents{{{sel}}})", "agents connected", "C")],
                    min_=0)),
                (8, 8, timeseries(
                    "Ranks missing from the latest step",
                    [q(f"max by (rank) (rankscope_rank_missing{{{sel}}})", "rank {{rank}}")],
                    unit="none", min_=0, max_=1, draw="bars", legend_calcs=("max",))),
                (8, 8, timeseries(
                    "Reports dropped by the agents",
                    [q(f"sum(rate(rankscope_agent_dropped_reports_total{{{sel}}}[$__rate_interval]))",
                       "dropped/s")],
                    unit="reqps", min_=0)),
            ],
            [(24, 7, table(
                "Firing alerts of this job",
                [q(f'max by (alertname, severity, rank, signal, condition) '
                   f'(ALERTS{{alertname=~"Rankscope.*", alertstate="firing", {sel}}})',
                   ref="A", instant=True, fmt="table")],
                rename={}, hide=("Time", "Value"),
                no_value="No rankscope alert is firing for this job."))],
        ),
    )


# ---------------------------------------------------------------------------------------------
# rankscope / Collector


def collector():
    inst = f'{COLLECTOR_JOBS}, instance=~"$instance"'

    def p(quantile, metric, legend):
        return q(f"histogram_quantile({quantile}, sum by (instance, le) "
                 f"(rate({metric}_bucket{{{inst}}}[$__rate_interval])))", legend,
                 "A" if quantile == 0.5 else "B")

    return dashboard(
        "rankscope-collector", "rankscope / Collector",
        "The rankscope collector's own health: ingest, rejections, SQLite store, streams, scrapes.",
        [datasource_var(),
         label_var("instance", "Collector", f"label_values(up{{{COLLECTOR_JOBS}}}, instance)", True,
                   description="Collector instances (scrape targets of the rankscope-collector job)."),
         train_job_var(multi=True)],
        layout(
            [
                (6, 5, stat("Collector up", [q(f"up{{{inst}}}", "{{instance}}")],
                            thresholds={"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                                       {"color": "green", "value": 1}]},
                            mappings=[{"type": "value", "options": {
                                "0": {"color": "red", "index": 0, "text": "DOWN"},
                                "1": {"color": "green", "index": 1, "text": "UP"}}}],
                            graph=False)),
                (6, 5, stat("gRPC streams open", [q(f"sum(rankscope_streams_open{{{inst}}})")])),
                (6, 5, stat("Store queue depth", [q(f"sum(rankscope_store_queue_depth{{{inst}}})")],
                            thresholds=_thresholds((1000, "orange")))),
                (6, 5, stat("Series exported per scrape",
                            [q(f"sum(scrape_samples_scraped{{{inst}}})")],
                            description="Bounded: per-rank series are capped per job.")),
            ],
            row("Ingest"),
            [
                (8, 8, timeseries(
                    "Reports received",
                    [q(f"sum by (instance) (rate(rankscope_reports_received_total{{{inst}}}[$__rate_interval]))",
                       "{{instance}}")],
                    unit="reqps", min_=0)),
                (8, 8, timeseries(
                    "Reports rejected, by reason",
                    [q(f"sum by (reason) (rate(rankscope_reports_rejected_total{{{inst}}}[$__rate_interval]))",
                       "{{reason}}")],
                    unit="reqps", min_=0,
                    description="Never stored. A steady rate means a misconfigured agent (RankscopeIngestRejecting).")),
                (8, 8, timeseries(
                    "Late, duplicate and evicted",
                    [q(f"sum(rate(rankscope_reports_late_total{{{inst}}}[$__rate_interval]))",
                       "late reports/s", "A"),
                     q(f"sum(rate(rankscope_reports_duplicate_total{{{inst}}}[$__rate_interval]))",
                       "duplicate reports/s (resent after reconnect)", "B"),
                     q(f"sum(rate(rankscope_steps_evicted_total{{{inst}}}[$__rate_interval]))",
                       "open steps evicted/s", "C")],
                    unit="reqps", min_=0)),
            ],
            [
                (12, 8, timeseries(
                    "Ingest latency",
                    [p(0.5, "rankscope_ingest_latency_seconds", "p50 {{instance}}"),
                     p(0.99, "rankscope_ingest_latency_seconds", "p99 {{instance}}")],
                    unit="s", min_=0)),
                (12, 8, timeseries(
                    "Agents connected, by job",
                    [q('sum by (train_job) (rankscope_connected_agents{train_job=~"$train_job"})',
                       "{{train_job}}")],
                    min_=0, stack=True)),
            ],
            row("SQLite store"),
            [
                (6, 8, stat("Store healthy",
                            [q(f"min(rankscope_store_healthy{{{inst}}})", "{{instance}}")],
                            description="0 while SQLite commits fail (disk full, file unwritable, "
                                        "lock held): nothing is acked, agents hold their reports "
                                        "(RankscopeStoreFailing). The log says why.",
                            thresholds={"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                                       {"color": "green", "value": 1}]},
                            mappings=[{"type": "value", "options": {
                                "0": {"color": "red", "index": 0, "text": "FAILING"},
                                "1": {"color": "green", "index": 1, "text": "OK"}}}],
                            graph=False)),
                (6, 8, timeseries(
                    "Commit latency",
                    [p(0.5, "rankscope_store_commit_seconds", "p50 {{instance}}"),
                     p(0.99, "rankscope_store_commit_seconds", "p99 {{instance}}")],
                    unit="s", min_=0, description="Acks go to the agents after the commit.")),
                (6, 8, timeseries(
                    "Store queue depth",
                    [q(f"sum by (instance) (rankscope_store_queue_depth{{{inst}}})", "{{instance}}")],
                    min_=0)),
                (6, 8, timeseries(
                    "Store errors and dropped items",
                    [q(f"sum by (instance) (rate(rankscope_store_errors_total{{{inst}}}[$__rate_interval]))",
                       "failed commits/s {{instance}}", "A"),
                     q(f"sum by (instance) (rate(rankscope_store_dropped_items_total{{{inst}}}[$__rate_interval]))",
                       "items dropped unstored/s {{instance}}", "B")],
                    unit="reqps", min_=0,
                    description="Dropped items were never acked: their streams are ended so the "
                                "agents resend them.")),
            ],
            row("Scrapes of the collector"),
            [
                (12, 8, timeseries(
                    "Scrape duration",
                    [q(f"scrape_duration_seconds{{{inst}}}", "{{instance}}")],
                    unit="s", min_=0)),
                (12, 8, timeseries(
                    "Samples per scrape",
                    [q(f"scrape_samples_scraped{{{inst}}}", "{{instance}}")],
                    min_=0)),
            ],
        ),
    )


DASHBOARDS = {
    "rankscope-overview.json": overview,
    "rankscope-job.json": job,
    "rankscope-collector.json": collector,
}


def render(build):
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a JSON file is out of date")
    args = parser.parse_args()
    stale = []
    for name, build in DASHBOARDS.items():
        path = HERE / name
        text = render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run /usr/bin/python3 dashboards/generate.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
