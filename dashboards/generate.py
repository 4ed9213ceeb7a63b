#!/usr/bin/env python3
"""Writes the rankscope Grafana dashboards, dashboards/*.json, from the modules beside it.

    .venv/bin/python dashboards/generate.py          # rewrite the JSON files
    .venv/bin/python dashboards/generate.py --check  # exit 1 if a JSON file is out of date

Run it with the project's Python (.venv): it needs Grafana's Python SDK, grafana-foundation-sdk,
pinned to 1769699379!11.6.0 (types and builders for Grafana 11.6; the JSON has the schemaVersion
that SDK emits, 41). The JSON files are what Grafana loads (provisioning, ConfigMap, import). Each
dashboard is built in its own module (overview.py, job.py, collector.py) with the SDK's builders,
through the helpers in panels.py, which keep the three dashboards' conventions in one place: the
`datasource` and `train_job` variables, units, legends, threshold lines read from the
`rankscope:threshold:*` recording rules. The SDK's JSON encoder writes them, keys sorted, so the
output is deterministic. After changing a dashboard in Grafana's UI, port the change to its module.
tests/ops checks the files are current, that they decode into the SDK's typed models and encode
back unchanged, the layout, queries and variables (test_ops.py), and, end to end, that every query
returns data (tests/python/test_prometheus_e2e.py).
"""

import argparse
import importlib.metadata
import json
import pathlib
import sys

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from collector import collector
from job import job
from overview import overview

HERE = pathlib.Path(__file__).resolve().parent
# The SDK version the JSON files are generated with: another version writes other JSON.
SDK = "grafana-foundation-sdk"
SDK_VERSION = "1769699379!11.6.0"

DASHBOARDS = {
    "rankscope-overview.json": overview,
    "rankscope-job.json": job,
    "rankscope-collector.json": collector,
}


def render(build):
    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a JSON file is out of date")
    args = parser.parse_args()
    installed = importlib.metadata.version(SDK)
    if installed != SDK_VERSION:
        print(
            f"{SDK} {installed} installed; the dashboards are generated with {SDK_VERSION}",
            file=sys.stderr,
        )
        return 2
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
        print(
            f"out of date: {', '.join(stale)}; run .venv/bin/python dashboards/generate.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
