"""Panels, queries, variables and the dashboard envelope shared by rankscope's Grafana
dashboards (dashboards/overview.py, job.py, collector.py; written out by generate.py).

Every panel uses the `datasource` variable; `layout` assigns panel ids and grid positions.
"""

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


def threshold_steps(*steps):
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
        "thresholds": threshold_steps(),
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
        "thresholds": thresholds or threshold_steps(),
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
        "thresholds": threshold_steps(),
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


def group_var():
    """The data-parallel group(s) of the chosen job; "All" (.*) also matches a job with one group,
    whose series carry no group label."""
    return label_var("group", "Data-parallel group",
                     'label_values(rankscope_world_size{train_job="$train_job"}, group)', True,
                     all_value=".*",
                     description="Ranks are compared within a data-parallel group (label group; "
                                 "absent for a job with one group).")


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
