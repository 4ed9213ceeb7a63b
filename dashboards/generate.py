#!/usr/bin/env python3
"""Writes the rankscope Grafana dashboards, dashboards/*.json, from the modules beside it.

    /usr/bin/python3 dashboards/generate.py          # rewrite the JSON files
    /usr/bin/python3 dashboards/generate.py --check  # exit 1 if a JSON file is out of date

The JSON files are what Grafana loads (provisioning, ConfigMap, import). Each dashboard is built
in its own module (overview.py, job.py, collector.py) from the helpers in panels.py, which keep the
three dashboards' conventions in one place: the `datasource` and `train_job` variables, units,
legends, threshold lines read from the `rankscope:threshold:*` recording rules. After changing a
dashboard in Grafana's UI, port the change to its module. tests/ops checks the files are current,
valid against Grafana's types (tests/ops/dashboard_check) and, end to end, that every query
returns data.
"""
import argparse
import json
import pathlib
import sys

from collector import collector
from job import job
from overview import overview

HERE = pathlib.Path(__file__).resolve().parent

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
