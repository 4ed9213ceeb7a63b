"""Static checks of rankscope's operations files (issue 5): rules, rule unit tests, dashboards,
deploy files. Each uses the real tool where this machine has it (promtool, amtool,
systemd-analyze, kubectl kustomize, docker-compose) and says so when it skips. The dashboards are
checked against Grafana's types as grafana-foundation-sdk (the project's pinned Python package)
has them, so run this with the project's Python:

    .venv/bin/python -m pytest -q tests/ops
"""

# One file, several parts (Prometheus rules; Prometheus and Alertmanager configuration; dashboards;
# Kubernetes, compose and systemd files), kept together on purpose: the static checks of the
# operations files, which share the tool lookups and the paths at the top and run as one pass of
# ./run test.

import enum
import json
import pathlib
import re
import shutil
import subprocess
import sys
import types
import typing

import pytest
import yaml

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
RULES = REPO / "deploy" / "prometheus" / "rules" / "rankscope.rules.yml"
OVERRIDES = REPO / "deploy" / "prometheus" / "rules" / "rankscope.overrides.yml"
RULE_TESTS = sorted(HERE.glob("*.test.yml"))
RUNBOOK = REPO / "docs" / "runbook.md"

sys.path.insert(0, str(HERE))
import extract_promql  # noqa: E402


def run(cmd, timeout=120, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed on this machine")
    return path


def alert_rules():
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


# ---------------------------------------------------------------------------------------------
# Prometheus rules


def test_rules_pass_promtool_check():
    r = run([tool("promtool"), "check", "rules", str(RULES), str(OVERRIDES)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_rule_unit_tests_pass():
    assert RULE_TESTS, "no tests/ops/*.test.yml"
    r = run([tool("promtool"), "test", "rules", *map(str, RULE_TESTS)], cwd=HERE)
    assert r.returncode == 0, r.stdout + r.stderr


REQUIRED_ALERTS = {
    "RankscopeDirectionConsistencyLow",
    "RankscopeLossDispersionHigh",
    "RankscopeGradNormDispersionHigh",
    "RankscopeRankOutlier",
    "RankscopeReplicaDivergence",
    "RankscopeRankSilent",
    "RankscopeCollectorDown",
    "RankscopeAgentDropping",
    "RankscopeIngestRejecting",
}  # plus RankscopeRankStraggler and RankscopeStoreFailing


def test_issue_5_alerts_exist():
    assert REQUIRED_ALERTS <= {r["alert"] for r in alert_rules()}


def test_every_alert_has_a_firing_case_and_a_near_miss():
    fires, quiet = set(), set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fires == set(), "alerts no unit test fires"
    assert names - quiet == set(), "alerts with no near miss evaluated to silence"


def test_every_rule_of_an_alert_fires_in_some_unit_test():
    """Alerts with several rules (one per condition/signal/scope): each rule's labels are tested."""
    tested = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                for exp in check.get("exp_alerts") or []:
                    labels = exp["exp_labels"]
                    tested.add(
                        (
                            check["alertname"],
                            labels.get("condition"),
                            labels.get("signal"),
                            labels.get("scope"),
                        )
                    )
    for rule in alert_rules():
        labels = rule["labels"]
        key = (rule["alert"], labels.get("condition"), labels.get("signal"), labels.get("scope"))
        assert key in tested, f"no unit test fires {key}"


def github_anchors(markdown):
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


def test_alerts_have_severity_summary_naming_job_and_rank_and_a_runbook_anchor():
    anchors = github_anchors(RUNBOOK.read_text())
    for rule in alert_rules():
        name, ann = rule["alert"], rule.get("annotations", {})
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert ann.get("summary") and ann.get("description"), name
        grouping = " ".join(re.findall(r"\bby\s*\(([^)]*)\)", rule["expr"]))
        if "train_job" in grouping:
            assert "$labels.train_job" in ann["summary"], f"{name}: summary must name the job"
        if re.search(r"\brank\b", grouping):
            assert "$labels.rank" in ann["summary"], f"{name}: summary must name the rank"
        url = ann.get("runbook_url", "")
        assert url.split("#")[0].endswith("docs/runbook.md"), f"{name}: runbook_url {url}"
        anchor = url.split("#", 1)[1]
        assert anchor == name.lower(), f"{name}: anchor {anchor}"
        assert anchor in anchors, f"{name}: docs/runbook.md has no heading for #{anchor}"


def test_rules_never_merge_data_parallel_groups():
    """Ranks of different groups are different processes (docs/DESIGN.md "Who a rank is"): every
    aggregation that keeps train_job keeps group; joins keep group except against the per-job
    thresholds, which need group_left/group_right; alerts name the group, per-rank ones the host."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        if group["name"] == "rankscope-thresholds":  # per train_job by design
            continue
        for rule in group["rules"]:
            name, expr = rule.get("alert") or rule["record"], rule["expr"]
            grouping = set()
            for by in re.findall(r"\bby\s*\(([^)]*)\)", expr):
                labels = {label.strip() for label in by.split(",")}
                grouping |= labels
                if "train_job" in labels:
                    assert "group" in labels, f"{name}: by ({by}) merges a job's groups"
            for m in re.finditer(r"\bon\s*\(([^)]*)\)\s*(group_left|group_right)?", expr):
                labels = {label.strip() for label in m.group(1).split(",")}
                if labels == {"train_job"}:
                    # Only against a per-job threshold, the side holding the groups being the many.
                    assert m.group(2), (
                        f"{name}: on (train_job) without group_left/right: one job's groups collide"
                    )
                elif "train_job" in labels:
                    assert "group" in labels, f"{name}: on ({m.group(1)}) merges a job's groups"
            if "alert" in rule and "group" in grouping:
                ann = rule["annotations"]
                assert (
                    "$labels.group" in ann["summary"] and "$labels.group" in ann["description"]
                ), name
                if "rank" in grouping:
                    assert "rankscope_rank_info{train_job=%q,group=%q,rank=%q}" in ann["summary"], (
                        name
                    )
                    assert "rank_info" not in expr, (
                        f"{name}: firing must not depend on rankscope_rank_info"
                    )


# Each mutant weakens or shifts one rule; the unit tests must fail on every one, i.e. the near
# misses sit right at the thresholds and `for` durations they claim to test.
MUTANTS = [
    ("+ 0.05)", "+ 0.07)"),  # direction floor
    ("+ 0.4)", "+ 0.3)"),  # allowed drop from baseline
    (
        "rankscope_world_size) + 0.5)\n      # Coeff",
        "rankscope_world_size) + 0.48)\n      # Coeff",
    ),  # loss std
    ("+ 0.3)", "+ 0.28)"),  # grad-norm CV
    ("+ 0.1)", "+ 0.02)"),  # consensus guard
    ("+ 3)", "+ 2.8)"),  # |z|
    ("+ 6)\n      # Robust z", "+ 5.8)\n      # Robust z"),  # outlier score
    ("+ 6)\n      # Reports", "+ 5.8)\n      # Reports"),  # step time z
    ("for: 2m", "for: 1m30s"),
    ("for: 1m\n", "for: 30s\n"),
    ("for: 5m", "for: 4m"),
    ("for: 3m", "for: 2m"),
    ("increase(rankscope_steps_total[2m])) > 0", "increase(rankscope_steps_total[2m])) >= 0"),
    ("rate(rankscope_reports_rejected_total[2m])", "rate(rankscope_reports_rejected_total[10m])"),
    ("rate(rankscope_store_errors_total[2m])", "rate(rankscope_store_errors_total[10m])"),
    ("unless on (train_job, group)", "or on (train_job, group)"),
    (
        "max by (train_job, group, rank) (rankscope_rank_missing) > 0",
        "max by (train_job, group, rank) (rankscope_rank_missing) >= 0",
    ),
    ("+ 0.2)", "+ 0.1)"),  # share of steps with duplicate ranks
    ("[10m])) >= 5", "[10m])) >= 3"),  # at least 5 duplicate steps
    # Data-parallel groups merged again (the tests with a two-group job must catch each).
    (
        "max by (train_job, group, rank) (rankscope_rank_grad_cosine)",
        "max by (train_job, rank) (rankscope_rank_grad_cosine)",
    ),
    (
        "max by (train_job, group, rank) (abs(rankscope_rank_loss_z))",
        "max by (train_job, rank) (abs(rankscope_rank_loss_z))",
    ),
    (
        "max by (train_job, group) (rankscope_grad_cosine_mean_min_window)",
        "max by (train_job) (rankscope_grad_cosine_mean_min_window)",
    ),
    ("expr: max by (train_job, group) (avg_over_time(", "expr: max by (train_job) (avg_over_time("),
    (
        "sqrt(max by (train_job, group) (rankscope_ranks_reporting) - 1)",
        "sqrt(max by (train_job) (rankscope_ranks_reporting) - 1)",
    ),
    (
        "and on (train_job, group)\n          max by (train_job, group) (increase(rankscope_steps_total[2m]))",
        "and on (train_job)\n          max by (train_job) (increase(rankscope_steps_total[2m]))",
    ),
    (
        "max by (train_job, group, rank) (rankscope_rank_step_time_z)",
        "max by (train_job, rank) (rankscope_rank_step_time_z)",
    ),
    ("+ 600)", "+ 590)"),  # seconds without a step before a stall
    ("(rankscope_reporting_enabled) == 0", "(rankscope_reporting_enabled) >= 0"),
    (
        "max by (train_job, group) (rankscope_connected_agents) > 0",
        "max by (train_job, group) (rankscope_connected_agents) >= 0",
    ),
    (
        "max by (train_job, group) (rankscope_last_step_timestamp_seconds)",
        "max by (train_job) (rankscope_last_step_timestamp_seconds)",
    ),
    ("(rankscope_rank_drift_score) > 1", "(rankscope_rank_drift_score) >= 1"),  # drift threshold
    ("(rankscope_rank_slow_score) > 1", "(rankscope_rank_slow_score) >= 1"),  # slow threshold
]


@pytest.mark.parametrize("old,new", MUTANTS, ids=[m[1].strip()[:40] for m in MUTANTS])
def test_rule_unit_tests_kill_mutant(tmp_path, old, new):
    promtool = tool("promtool")
    text = RULES.read_text()
    assert old in text, f"mutant site {old!r} not found"
    rules_dir = tmp_path / "deploy" / "prometheus" / "rules"
    rules_dir.mkdir(parents=True)
    (rules_dir / RULES.name).write_text(text.replace(old, new))
    ops = tmp_path / "tests" / "ops"
    shutil.copytree(HERE / "fixtures", ops / "fixtures")
    for path in RULE_TESTS:
        shutil.copy(path, ops / path.name)
    r = run([promtool, "test", "rules", *[p.name for p in RULE_TESTS]], cwd=ops)
    assert r.returncode != 0, f"unit tests still pass with {old!r} -> {new!r}"


# ---------------------------------------------------------------------------------------------
# Prometheus and Alertmanager configuration


def test_prometheus_config_passes_promtool():
    r = run([tool("promtool"), "check", "config", str(REPO / "deploy" / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 rule files found" in r.stdout


def test_alertmanager_config_and_routes():
    amtool = tool("amtool")
    config = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
    r = run([amtool, "check-config", str(config)])
    assert r.returncode == 0, r.stdout + r.stderr
    for labels, receiver in [
        (
            ["alertname=RankscopeReplicaDivergence", "severity=critical", "train_job=exp-42"],
            "rankscope-pager",
        ),
        (
            ["alertname=RankscopeRankOutlier", "severity=warning", "train_job=exp-42"],
            "rankscope-chat",
        ),
    ]:
        r = run([amtool, "config", "routes", "test", f"--config.file={config}", *labels])
        assert r.returncode == 0 and r.stdout.strip() == receiver, (labels, r.stdout, r.stderr)


# ---------------------------------------------------------------------------------------------
# Dashboards


DASHBOARDS = REPO / "dashboards"
DASHBOARD_FILES = sorted(p.name for p in DASHBOARDS.glob("*.json"))
PANEL_TYPES = {"timeseries", "stat", "table", "heatmap"}  # the panel plugins rankscope uses
DATASOURCE_VAR = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's built-in variables (global variables and those of data links).
GRAFANA_VARS = {
    "__rate_interval",
    "__rate_interval_ms",
    "__interval",
    "__interval_ms",
    "__range",
    "__range_s",
    "__range_ms",
    "__from",
    "__to",
    "__url_time_range",
    "__timezone",
    "__dashboard",
    "__org",
    "__user",
    "__all_variables",
    "__value",
    "__data",
    "__field",
    "__series",
}


def dashboard_json(name):
    return json.loads((DASHBOARDS / name).read_text())


def all_panels(dash):
    """Top-level panels and rows, then the panels of collapsed rows."""
    panels = list(dash.get("panels", []))
    return panels + [p for row in panels if row["type"] == "row" for p in row.get("panels", [])]


def variables_used(text):
    return re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text)


def grafana_sdk():
    """Registers the SDK's panel and data-source types, which its from_json decodes into."""
    try:
        from grafana_foundation_sdk.cog import plugins
    except ImportError:
        pytest.fail(
            f"grafana-foundation-sdk is not installed for {sys.executable}: run tests/ops "
            "with the project's Python, .venv/bin/python"
        )
    plugins.register_default_plugins()


def sdk_type_errors(value, hint, path):
    """Where `value`, decoded by the SDK's from_json, does not fit the SDK's annotation `hint`:
    enum and literal values, numbers, strings, booleans, lists, nested models. from_json decodes
    without checking (an enum stays the JSON string); this is the check."""
    from grafana_foundation_sdk.cog import runtime, variants

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (typing.Any, object):
        # Untyped in the dashboard model (a panel's options and custom field config): the panel
        # plugin's hook has decoded them into its own model where it has one.
        return sdk_model_errors(value, path) if hasattr(value, "to_json") else []
    if origin in (typing.Union, types.UnionType):
        for arg in args:  # a decoded model picks its branch (Panel or RowPanel)
            if isinstance(arg, type) and hasattr(arg, "to_json") and isinstance(value, arg):
                return sdk_type_errors(value, arg, path)
        results = [sdk_type_errors(value, arg, path) for arg in args if arg is not type(None)]
        if (value is None and type(None) in args) or any(not r for r in results):
            return []
        return results[0] if len(results) == 1 else [f"{path}: {value!r} fits none of {args}"]
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {value!r} is not a list"]
        return [e for i, v in enumerate(value) for e in sdk_type_errors(v, args[0], f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {value!r} is not an object"]
        return [e for k, v in value.items() for e in sdk_type_errors(v, args[1], f"{path}.{k}")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        ok = value in {m.value for m in hint}
        return [] if ok else [f"{path}: {value!r} is not a value of {hint.__name__}"]
    if hint in (bool, int, float, str):
        ok = isinstance(value, (int, float) if hint is float else hint)
        ok = ok and (hint is bool or not isinstance(value, bool))
        return [] if ok else [f"{path}: {value!r} is not of type {hint.__name__}"]
    if hint is variants.Dataquery:
        if isinstance(value, runtime.UnknownDataquery) or not isinstance(value, hint):
            return [f"{path}: a query of no data source the SDK knows"]
        return sdk_model_errors(value, path)
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        if isinstance(value, dict):  # from_json leaves some nested objects as JSON (links, ...)
            value = hint.from_json(value)
        if not isinstance(value, hint):
            return [f"{path}: {value!r} is not a {hint.__name__}"]
        return sdk_model_errors(value, path)
    raise TypeError(f"{path}: no check for the annotation {hint!r}")


def sdk_model_errors(obj, path):
    return [
        e
        for name, hint in typing.get_type_hints(type(obj)).items()
        for e in sdk_type_errors(getattr(obj, name), hint, f"{path}.{name}")
    ]


def test_dashboards_are_generated_from_generate_py():
    r = run([sys.executable, str(REPO / "dashboards" / "generate.py"), "--check"])
    assert r.returncode == 0, r.stderr


def test_dashboards_exist():
    assert DASHBOARD_FILES == [
        "rankscope-collector.json",
        "rankscope-job.json",
        "rankscope-overview.json",
    ]


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_dashboard_round_trips_through_the_sdk_model(name):
    """Grafana's types for Grafana 11.6 as the SDK has them: decoded into its Dashboard model (each
    panel's options and field config by its plugin's model, each query by the Prometheus model)
    and encoded again, nothing is lost or changed: no key the types do not know."""
    grafana_sdk()
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    dash = dashboard_json(name)
    model = Dashboard.from_json(dash)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == dash
    assert dash["schemaVersion"] == Dashboard().schema_version


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_dashboard_values_fit_the_sdk_types(name):
    grafana_sdk()
    from grafana_foundation_sdk.models.dashboard import Dashboard

    assert sdk_model_errors(Dashboard.from_json(dashboard_json(name)), name) == []


def test_sdk_type_check_catches_wrong_values():
    grafana_sdk()
    from grafana_foundation_sdk.models.dashboard import Dashboard

    dash = dashboard_json("rankscope-job.json")
    kinds = set()
    for panel in dash["panels"]:
        kinds.add(panel["type"])
        if panel["type"] == "row":
            panel["collapsed"] = "no"
        elif panel["type"] == "timeseries":
            panel["fieldConfig"]["defaults"]["custom"]["drawStyle"] = "bar"
        elif panel["type"] == "stat":
            panel["options"]["graphMode"] = "areas"
        elif panel["type"] == "table":
            panel["options"]["cellHeight"] = "xl"
        elif panel["type"] == "heatmap":
            panel["options"]["yAxis"]["axisPlacement"] = "middle"
        panel["gridPos"]["w"] = str(panel["gridPos"]["w"])
        for target in panel.get("targets", []):
            target["format"] = "tabel"
    assert kinds == PANEL_TYPES | {"row"}
    errors = "\n".join(sdk_model_errors(Dashboard.from_json(dash), "job"))
    for wrong in [
        "'no' is not of type bool",
        "'4' is not of type int",
        "'bar' is not a value of GraphDrawStyle",
        "'areas' is not a value of BigValueGraphMode",
        "'xl' is not a value of TableCellHeight",
        "'middle' is not a value of AxisPlacement",
        "'tabel' is not a value of PromQueryFormat",
    ]:
        assert wrong in errors, wrong


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_dashboard_variables(name):
    dash = dashboard_json(name)
    assert 0 < len(dash["uid"]) <= 40 and dash["uid"] == name.removesuffix(".json")
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert dash["templating"]["list"][0]["name"] == "datasource"
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["train_job"]["type"] == "query"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DATASOURCE_VAR, var["name"]
            query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
            assert set(variables_used(query)) <= set(variables) - {var["name"]}, var["name"]


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_dashboard_panels_and_queries(name):
    """Known panel types, all through the `datasource` variable, every query with a refId of its
    own and only variables the dashboard defines (or Grafana's own); links likewise."""
    dash = dashboard_json(name)
    defined = {v["name"] for v in dash["templating"]["list"]} | GRAFANA_VARS
    for link in dash.get("links", []):
        assert set(variables_used(link.get("url", ""))) <= defined, link["title"]
    for panel in all_panels(dash):
        where = f"{name}: panel {panel['id']} {panel.get('title')!r}"
        if panel["type"] == "row":
            # Grafana drops the panels nested in an expanded row.
            assert panel["collapsed"] or panel["panels"] == [], where
            continue
        assert panel["type"] in PANEL_TYPES, where
        assert panel["title"], where
        assert panel["datasource"] == DATASOURCE_VAR, where
        assert panel["targets"], f"{where}: no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert all(refs) and len(set(refs)) == len(refs), f"{where}: refIds {refs}"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE_VAR, f"{where} {target['refId']}"
            assert target["expr"].strip(), f"{where} {target['refId']}"
            undefined = set(variables_used(target["expr"])) - defined
            assert not undefined, f"{where} {target['refId']}: undefined {undefined}"
        for override in panel["fieldConfig"]["overrides"]:
            for prop in override["properties"]:
                for link in prop["value"] if prop["id"] == "links" else []:
                    assert set(variables_used(link["url"])) <= defined, where


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_dashboard_ids_and_grid(name):
    """Panel ids unique; every panel (rows too) inside the 24 columns, none overlapping."""
    dash = dashboard_json(name)
    ids = [p["id"] for p in all_panels(dash)]
    assert len(set(ids)) == len(ids), ids
    cells = {}
    for panel in dash["panels"]:
        g = panel["gridPos"]
        where = f"{name}: panel {panel['id']} {panel.get('title')!r} at {g}"
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, where
        assert g["x"] + g["w"] <= 24, where
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{where} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = panel["id"]


def test_dashboards_have_the_panels_issue_5_asks_for():
    exprs = {e.expr for e in extract_promql.dashboard_expressions()}
    joined = "\n".join(exprs)
    for metric in [
        "rankscope_loss_mean",
        "rankscope_loss_std",
        "rankscope_grad_norm_cv",
        "rankscope_grad_cosine_mean",
        "rankscope_rank_grad_cosine",
        "rankscope_rank_outlier_score",
        "rankscope_replica_divergent_ranks",
        "rankscope_rank_replica_divergent",
        "rankscope_grad_noise_scale",
        "rankscope_rank_step_time_seconds",
        "rankscope_reports_received_total",
        "rankscope_reports_rejected_total",
        "rankscope_ingest_latency_seconds_bucket",
        "rankscope_connected_agents",
    ]:
        assert metric in joined, f"no dashboard panel shows {metric}"
    titles = {json.loads(p.read_text())["uid"] for p in (REPO / "dashboards").glob("*.json")}
    assert titles == {"rankscope-overview", "rankscope-job", "rankscope-collector"}


def test_metric_name_extraction():
    assert extract_promql.metric_names(
        'max by (train_job, rank) (rankscope_rank_grad_cosine{train_job="$train_job"}) < on (train_job) '
        "group_left () (rankscope:threshold:x * train_job:y:avg2m) and rate(z_total[5m]) > 0"
    ) == ["rankscope:threshold:x", "rankscope_rank_grad_cosine", "train_job:y:avg2m", "z_total"]
    assert extract_promql.metric_names(
        "histogram_quantile(0.99, sum by (le) (rate(a_bucket[$__rate_interval])))"
    ) == ["a_bucket"]
    assert (
        extract_promql.substitute(
            'x{a="$train_job"}[${__rate_interval}]', {"train_job": "j", "__rate_interval": "1m"}
        )
        == 'x{a="j"}[1m]'
    )


# ---------------------------------------------------------------------------------------------
# Kubernetes, compose, systemd


K8S = REPO / "deploy" / "kubernetes"


def k8s_objects():
    objs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path
            objs[(doc["kind"], doc["metadata"]["name"])] = doc
    return objs


def test_k8s_generated_manifests_match_rules_and_dashboards():
    r = run([sys.executable, str(K8S / "generate.py"), "--check"])
    assert r.returncode == 0, r.stderr
    objs = k8s_objects()
    assert objs[("PrometheusRule", "rankscope")]["spec"] == yaml.safe_load(RULES.read_text())
    data = objs[("ConfigMap", "rankscope-dashboards")]["data"]
    assert data == {p.name: p.read_text() for p in (REPO / "dashboards").glob("*.json")}


def test_k8s_manifests_are_consistent():
    objs = k8s_objects()
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    dep = objs[("Deployment", "rankscope-collector")]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    svc = objs[("Service", "rankscope-collector")]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    mon = objs[("ServiceMonitor", "rankscope-collector")]
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= {
        p["name"] for p in svc["spec"]["ports"]
    }
    # The alerts select job=~"rankscope-collector.*"; the operator names the job after the Service.
    assert svc["metadata"]["name"].startswith("rankscope-collector")
    sc = container["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"]
        and not sc["allowPrivilegeEscalation"]
        and sc["capabilities"]["drop"] == ["ALL"]
    )
    claim = pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objs
    assert dep["spec"]["strategy"]["type"] == "Recreate"


def test_k8s_kustomization_renders():
    r = run([tool("kubectl"), "kustomize", str(K8S)])
    assert r.returncode == 0, r.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(r.stdout))
    assert kinds == sorted(
        [
            "Namespace",
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            "ServiceMonitor",
            "PrometheusRule",
            "ConfigMap",
        ]
    )


def test_every_yaml_file_parses():
    paths = [p for p in (REPO / "deploy").rglob("*") if p.suffix in {".yml", ".yaml"}]
    paths += list(HERE.rglob("*.yml"))
    assert len(paths) > 10
    for path in paths:
        list(yaml.safe_load_all(path.read_text()))


def test_compose_file_is_valid():
    compose = REPO / "deploy" / "compose" / "compose.yaml"
    doc = yaml.safe_load(compose.read_text())
    assert {"collector", "prometheus", "grafana", "alertmanager"} <= set(doc["services"])
    for service in doc["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (compose.parent / source).exists(), f"compose mounts missing {source}"
    r = run([tool("docker-compose"), "-f", str(compose), "config", "-q"])
    assert r.returncode == 0, r.stdout + r.stderr


def test_systemd_unit_verifies(tmp_path):
    analyze = tool("systemd-analyze")
    unit = REPO / "deploy" / "systemd" / "rankscope-collector.service"
    binary = REPO / "build" / "bin" / "rankscope-collector"
    exe = str(binary) if binary.exists() else "/bin/true"  # verify needs an executable ExecStart
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace("/usr/local/bin/rankscope-collector", exe))
    r = run([analyze, "verify", str(copy)])
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stdout + r.stderr
    r = run([analyze, "security", "--offline=true", "--threshold=20", str(copy)])
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
    assert m and float(m.group(1)) <= 2.0, r.stdout[-2000:] + r.stderr
    text = unit.read_text()
    for directive in [
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "StateDirectory=rankscope",
        "NoNewPrivileges=yes",
    ]:
        assert directive in text


K8S_FLEET = REPO / "deploy" / "kubernetes-fleet"


def test_k8s_fleet_is_a_statefulset_of_shards_behind_a_headless_service():
    """deploy/kubernetes-fleet (docs/deploy.md "A fleet of collectors"): the base with its one
    collector replaced by N shards; Prometheus discovers every shard through the base's
    ServiceMonitor; rules and dashboards are the base's, unchanged; the agents' list names every
    shard by its stable DNS name."""
    r = run([tool("kubectl"), "kustomize", str(K8S_FLEET)])
    assert r.returncode == 0, r.stderr
    objs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout)}
    assert sorted(kind for kind, _ in objs) == sorted(
        [
            "Namespace",
            "StatefulSet",
            "Service",
            "ServiceMonitor",
            "PrometheusRule",
            "ConfigMap",
            "ConfigMap",
        ]
    )
    base = k8s_objects()
    sts = objs[("StatefulSet", "rankscope-collector")]
    replicas = sts["spec"]["replicas"]
    assert replicas >= 2
    pod = sts["spec"]["template"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # The shard's pod is the single collector's: same image, flags, probes, limits, security,
    # plus the fleet's list (the agents' ConfigMap) for the web view.
    container = dict(pod["spec"]["containers"][0])
    single = base[("Deployment", "rankscope-collector")]["spec"]["template"]["spec"]
    assert container.pop("args") == single["containers"][0]["args"] + [
        "--fleet=$(RANKSCOPE_COLLECTOR)"
    ]
    assert container.pop("env") == [
        {
            "name": "RANKSCOPE_COLLECTOR",
            "valueFrom": {
                "configMapKeyRef": {"name": "rankscope-agents", "key": "RANKSCOPE_COLLECTOR"}
            },
        }
    ]
    assert container == {
        k: v for k, v in single["containers"][0].items() if k not in ("args", "env")
    }
    assert pod["spec"]["securityContext"] == single["securityContext"]
    # One volume per shard, mounted where the single collector mounts its PVC.
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert {m["name"] for m in container["volumeMounts"]} <= claims | {
        v["name"] for v in pod["spec"]["volumes"]
    }
    assert "data" in claims and all(
        "persistentVolumeClaim" not in v for v in pod["spec"]["volumes"]
    )
    # Headless, and a shard that is down stays in DNS (retried, never skipped).
    svc = objs[("Service", sts["spec"]["serviceName"])]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= {
        p["name"] for p in container["ports"]
    }
    # Every shard is scraped: the ServiceMonitor selects the headless Service; the alerts'
    # job=~"rankscope-collector.*" matches the job label the operator derives from its name.
    mon = objs[("ServiceMonitor", "rankscope-collector")]
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= {
        p["name"] for p in svc["spec"]["ports"]
    }
    assert svc["metadata"]["name"].startswith("rankscope-collector")
    assert objs[("PrometheusRule", "rankscope")]["spec"] == yaml.safe_load(RULES.read_text())
    assert (
        objs[("ConfigMap", "rankscope-dashboards")]["data"]
        == base[("ConfigMap", "rankscope-dashboards")]["data"]
    )
    # The agents' list: every shard once, by the name the StatefulSet gives it.
    ns = sts["metadata"]["namespace"]
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    listed = objs[("ConfigMap", "rankscope-agents")]["data"]["RANKSCOPE_COLLECTOR"].split(",")
    assert listed == [
        f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}.{ns}.svc:{grpc_port}"
        for i in range(replicas)
    ]
