#!/usr/bin/env python3
"""Every PromQL expression rankscope ships: rules and dashboards.

    .venv/bin/python tests/ops/extract_promql.py [--repo DIR]   # one JSON object per line

Used by tests/python/test_prometheus_e2e.py, which runs each expression against a real Prometheus
and asserts it returns data. Grafana variables are left in place; `substitute` fills them in.
Dashboard variables of the form label_values(selector, label) become `group by (label) (selector)`
so they can be run too.
"""

import argparse
import dataclasses
import json
import pathlib
import re
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules" / "rankscope.rules.yml"
DASHBOARDS = REPO / "dashboards"


@dataclasses.dataclass(frozen=True)
class Expression:
    source: str  # where it comes from, for messages: "rules: RankscopeRankOutlier [2]", ...
    kind: str  # "record", "alert", "panel" or "variable"
    name: str  # recorded metric, alert name, panel title or variable name
    expr: str


def rule_expressions(path=RULES):
    doc = yaml.safe_load(path.read_text())
    out, seen = [], {}
    for group in doc["groups"]:
        for rule in group["rules"]:
            kind = "alert" if "alert" in rule else "record"
            name = rule[kind]
            seen[name] = seen.get(name, 0) + 1
            out.append(
                Expression(f"rules: {name} [{seen[name]}]", kind, name, rule["expr"].strip())
            )
    return out


_LABEL_VALUES = re.compile(
    r"^\s*label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$"
)


def dashboard_expressions(directory=DASHBOARDS):
    out = []
    for path in sorted(directory.glob("*.json")):
        dash = json.loads(path.read_text())
        for var in dash.get("templating", {}).get("list", []):
            if var.get("type") != "query":
                continue
            query = var["query"] if isinstance(var["query"], str) else var["query"].get("query", "")
            m = _LABEL_VALUES.match(query)
            if not m:
                raise ValueError(f"{path.name}: variable {var['name']}: cannot run {query!r}")
            out.append(
                Expression(
                    f"{path.name}: variable ${var['name']}",
                    "variable",
                    var["name"],
                    f"group by ({m['label']}) ({m['selector']})",
                )
            )
        panels = []
        for panel in dash.get("panels", []):
            panels.append(panel)
            panels.extend(panel.get("panels", []))  # collapsed rows hold their panels
        for panel in panels:
            for target in panel.get("targets", []):
                out.append(
                    Expression(
                        f'{path.name}: panel {panel["id"]} "{panel["title"]}" query {target["refId"]}',
                        "panel",
                        panel["title"],
                        target["expr"],
                    )
                )
    return out


def all_expressions(repo=REPO):
    return rule_expressions(
        repo / "deploy" / "prometheus" / "rules" / "rankscope.rules.yml"
    ) + dashboard_expressions(repo / "dashboards")


def substitute(expr, values):
    """Replaces $name and ${name} by values[name]; unknown variables raise KeyError."""

    def repl(m):
        return values[m.group(1) or m.group(2)]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, expr)


_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
}


def metric_names(expr):
    """Names of the series an expression selects (a lexical approximation, good for our rules)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS or re.fullmatch(r"\d+[smhdwy]", name):
            continue
        names.add(name)
    return sorted(names)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=pathlib.Path, default=REPO)
    args = parser.parse_args()
    for e in all_expressions(args.repo):
        print(json.dumps({**dataclasses.asdict(e), "metrics": metric_names(e.expr)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
