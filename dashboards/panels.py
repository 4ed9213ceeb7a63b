"""Panels, queries, variables and the dashboard envelope shared by rankscope's Grafana
dashboards (dashboards/overview.py, job.py, collector.py; written out by generate.py).

Everything is built with Grafana's Python SDK, grafana-foundation-sdk (pinned 11.6, for Grafana
11.6): its builders set typed models, so a misspelt option or a wrong enum value fails here, not in
Grafana. Every panel and query uses the `datasource` variable; `layout` assigns panel ids and grid
positions.
"""

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import heatmap as heatmap_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import table as table_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models.prometheus import PromQueryFormat, QueryEditorMode

RUNBOOK = "https://github.com/rankscope/rankscope/blob/main/docs/runbook.md"
COLLECTOR_JOBS = 'job=~"rankscope-collector.*"'
GRID_COLUMNS = 24


def datasource():
    """The Prometheus data source chosen by the `datasource` variable."""
    return model.DataSourceRef(type_val="prometheus", uid="${datasource}")


# ---------------------------------------------------------------------------------------------
# Queries, thresholds, overrides


def q(expr, legend="__auto", ref="A", instant=False, fmt=None):
    """A Prometheus query; fmt "table" for the instant queries of table panels."""
    query = (
        prometheus_b.Dataquery()
        .datasource(datasource())
        .editor_mode(QueryEditorMode.CODE)
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref)
    )
    if instant:
        query.instant()
    else:
        query.range()
    if fmt:
        query.format(PromQueryFormat(fmt))
    return query


def table_q(expr, ref="A"):
    """An instant query of a table panel: a row per series, the value in column "Value #<ref>"
    (just "Value" when it is the panel's only query)."""
    return q(expr, ref=ref, instant=True, fmt="table")


def steps(*steps, base="green"):
    """Absolute thresholds: `base` below the first step, then (value, color) steps."""
    return (
        dashboard_b.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps(
            [model.Threshold(value=None, color=base)]
            + [model.Threshold(value=value, color=color) for value, color in steps]
        )
    )


def value_map(*entries):
    """Value mapping: entries (value, color, text), e.g. (0, "red", "DOWN")."""
    return model.ValueMap(
        options={
            str(value): model.ValueMappingResult(color=color, index=index, text=text)
            for index, (value, color, text) in enumerate(entries)
        }
    )


def by_ref(ref, *properties):
    """Override for the series of query `ref`."""
    return (
        dashboard_b.DashboardFieldConfigSourceOverrides()
        .matcher(model.MatcherConfig(id_val="byFrameRefID", options=ref))
        .properties(list(properties))
    )


def by_name(name, *properties):
    """Override for the field called `name`."""
    return (
        dashboard_b.DashboardFieldConfigSourceOverrides()
        .matcher(model.MatcherConfig(id_val="byName", options=name))
        .properties(list(properties))
    )


def fixed_color(color):
    return model.DynamicConfigValue(
        id_val="color",
        value=dashboard_b.FieldColor()
        .mode(model.FieldColorModeId.FIXED)
        .fixed_color(color)
        .build(),
    )


def dashed_line():
    # An override's property value is untyped in the SDK (DynamicConfigValue.value: object); the
    # value itself is the typed LineStyle the timeseries field config uses.
    return model.DynamicConfigValue(
        id_val="custom.lineStyle", value=common_b.LineStyle().fill("dash").dash([10, 10]).build()
    )


def field_link(title, url):
    # The SDK has no type for a field's data link (Grafana's DataLink); FieldConfig.links and the
    # panels' data_links() use DashboardLink, which is what we use too. Grafana reads its title and
    # url and ignores the dashboard-link fields it also writes.
    return model.DynamicConfigValue(
        id_val="links", value=[dashboard_b.DashboardLink(title).url(url).build()]
    )


def dashed_ref(ref, color):
    """Draws the series of query `ref` as a dashed line: thresholds and baselines."""
    return by_ref(ref, dashed_line(), fixed_color(color))


# ---------------------------------------------------------------------------------------------
# Panels


def _common(panel, title, description, targets):
    return (
        panel.title(title).description(description).datasource(datasource()).targets(list(targets))
    )


def timeseries(
    title,
    targets,
    unit="short",
    description="",
    overrides=(),
    min_=None,
    max_=None,
    legend_calcs=("lastNotNull", "max"),
    stack=False,
    draw="line",
):
    panel = (
        _common(timeseries_b.Panel(), title, description, targets)
        .color_scheme(dashboard_b.FieldColor().mode(model.FieldColorModeId.PALETTE_CLASSIC))
        .axis_placement(common.AxisPlacement.AUTO)
        .draw_style(common.GraphDrawStyle(draw))
        .fill_opacity(10 if stack else 0)
        .line_interpolation(common.LineInterpolation.LINEAR)
        .line_width(1)
        .show_points(common.VisibilityMode.NEVER)
        .span_nulls(False)
        .stacking(
            common_b.StackingConfig()
            .group("A")
            .mode(common.StackingMode.NORMAL if stack else common.StackingMode.NONE)
        )
        .thresholds_style(
            common_b.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.OFF)
        )
        .thresholds(steps())
        .unit(unit)
        .overrides(list(overrides))
        .legend(
            common_b.VizLegendOptions()
            .calcs(list(legend_calcs))
            .display_mode(
                common.LegendDisplayMode.TABLE if legend_calcs else common.LegendDisplayMode.LIST
            )
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_b.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if min_ is not None:
        panel.min(min_)
    if max_ is not None:
        panel.max(max_)
    return panel


def stat(
    title,
    targets,
    unit="short",
    description="",
    thresholds=None,
    mappings=(),
    graph=True,
    no_value=None,
):
    panel = (
        _common(stat_b.Panel(), title, description, targets)
        .color_scheme(dashboard_b.FieldColor().mode(model.FieldColorModeId.THRESHOLDS))
        .mappings(list(mappings))
        .thresholds(thresholds or steps())
        .unit(unit)
        .overrides([])
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.AREA if graph else common.BigValueGraphMode.NONE)
        .justify_mode(common.BigValueJustifyMode.AUTO)
        .orientation(common.VizOrientation.AUTO)
        .percent_change_color_mode(common.PercentChangeColorMode.STANDARD)
        .reduce_options(
            common_b.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)
        )
        .show_percent_change(False)
        .text_mode(common.BigValueTextMode.AUTO)
        .wide_layout(True)
    )
    if no_value is not None:
        panel.no_value(no_value)
    return panel


def table(
    title,
    targets,
    rename,
    description="",
    sort_by=None,
    overrides=(),
    no_value=None,
    hide=("Time",),
):
    """A table of instant queries merged into one row per label set; `rename` names the columns
    (Grafana calls query X's value column "Value #X"), `hide` drops columns."""
    panel = (
        _common(table_b.Panel(), title, description, targets)
        .align(common.FieldTextAlignment.AUTO)
        .cell_options(common.TableAutoCellOptions())
        .inspect(False)
        .thresholds(steps())
        .overrides(list(overrides))
        .cell_height(common.TableCellHeight.SM)
        .frame_index(0)
        .show_header(True)
        # The SDK types a transformation's envelope (DataTransformerConfig) but not the options
        # of each transformer (`options: object`): merge and organize take theirs as Grafana
        # stores them.
        .transformations(
            [
                model.DataTransformerConfig(id_val="merge", options={}),
                model.DataTransformerConfig(
                    id_val="organize",
                    options={
                        "excludeByName": {name: True for name in hide},
                        "indexByName": {},
                        "renameByName": rename,
                    },
                ),
            ]
        )
    )
    if sort_by:
        name, desc = sort_by
        panel.sort_by([common_b.TableSortByFieldState().display_name(name).desc(desc)])
    if no_value is not None:
        panel.no_value(no_value)
    return panel


def heatmap(
    title,
    targets,
    description="",
    scheme="RdYlGn",
    reverse=False,
    min_=None,
    max_=None,
    unit="short",
):
    """One row per series (rank), colored by value; no bucketing (calculate off)."""
    color = (
        heatmap_b.HeatmapColorOptions()
        .exponent(0.5)
        .fill("dark-orange")
        .mode(heatmap_m.HeatmapColorMode.SCHEME)
        .reverse(reverse)
        .scale(heatmap_m.HeatmapColorScale.LINEAR)
        .scheme(scheme)
        .steps(64)
    )
    if min_ is not None:
        color.min(min_)
    if max_ is not None:
        color.max(max_)
    return (
        _common(heatmap_b.Panel(), title, description, targets)
        .hide_from(common_b.HideSeriesConfig().legend(False).tooltip(False).viz(False))
        .scale_distribution(
            common_b.ScaleDistributionConfig().type(common.ScaleDistribution.LINEAR)
        )
        .overrides([])
        .calculate(False)
        .cell_gap(1)
        # Hide no cell: Grafana's default filter hides values <= 1e-9, which would hide a
        # negative consensus cosine (the rank that disagrees) and every zero score.
        .filter_values(heatmap_b.FilterValueRange().le((min_ if min_ is not None else 0) - 1))
        .cell_values(heatmap_b.CellValues().unit(unit))
        .color(color)
        .exemplars_color("rgba(255,0,255,0.7)")
        .show_legend()
        .rows_frame(
            heatmap_b.RowsHeatmapOptions().layout(common.HeatmapCellLayout.AUTO).value("value")
        )
        .show_value(common.VisibilityMode.NEVER)
        .mode(common.TooltipDisplayMode.SINGLE)
        .show_color_scale(True)
        .hide_y_histogram()
        .y_axis(
            heatmap_b.YAxisConfig()
            .axis_label("rank")
            .axis_placement(common.AxisPlacement.LEFT)
            .reverse(False)
        )
    )


def row(title):
    """A row header. It stays expanded and holds no panels: the panels after it, up to the next
    row, are its panels (Grafana drops panels nested in an expanded row)."""
    return dashboard_b.Row(title).collapsed(False)


def layout(*lines):
    """Each line: a row, or a list of (width, height, panel) filling the 24 columns left to right.
    Assigns ids (1, 2, ...) and grid positions; returns the panels and rows in order."""
    out, y, next_id = [], 0, 1
    for line in lines:
        if isinstance(line, dashboard_b.Row):
            out.append(line.id(next_id).grid_pos(model.GridPos(h=1, w=GRID_COLUMNS, x=0, y=y)))
            next_id += 1
            y += 1
            continue
        x, height = 0, 0
        for width, h, panel in line:
            if x + width > GRID_COLUMNS:
                raise ValueError(
                    f"line overflows {GRID_COLUMNS} columns at {panel.build().title!r}"
                )
            out.append(panel.id(next_id).grid_pos(model.GridPos(h=h, w=width, x=x, y=y)))
            next_id += 1
            x += width
            height = max(height, h)
        y += height
    return out


# ---------------------------------------------------------------------------------------------
# Variables and the dashboard envelope


def datasource_var():
    # DatasourceVariable has no refresh or options: Grafana lists data sources on every load.
    return (
        dashboard_b.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .regex("")
        .hide(model.VariableHide.DONT_HIDE)
        .include_all(False)
        .multi(False)
    )


def label_var(name, label, query, multi, all_value=None, description=""):
    """A query variable over label values; with `multi`, "All" and several values."""
    var = (
        dashboard_b.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(datasource())
        .query(query)
        .regex("")
        .hide(model.VariableHide.DONT_HIDE)
        .include_all(multi)
        .multi(multi)
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .options([])
    )
    if multi:
        var.all_value(all_value or ".+")
    return var


def train_job_var(multi):
    return label_var(
        "train_job",
        "Training job",
        "label_values(rankscope_world_size, train_job)",
        multi,
        description="The training job (label train_job) reported by the collector.",
    )


def group_var():
    """The data-parallel group(s) of the chosen job; "All" (.*) also matches a job with one group,
    whose series carry no group label."""
    return label_var(
        "group",
        "Data-parallel group",
        'label_values(rankscope_world_size{train_job="$train_job"}, group)',
        True,
        all_value=".*",
        description="Ranks are compared within a data-parallel group (label group; "
        "absent for a job with one group).",
    )


def dashboard(uid, title, description, variables, panels, time_from="now-3h"):
    """The dashboard model (grafana_foundation_sdk.models.dashboard.Dashboard); `panels` from
    layout(). The SDK sets schemaVersion (41 for Grafana 11.6)."""
    builder = (
        dashboard_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .editable()
        .fiscal_year_start_month(0)
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .tags(["rankscope"])
        .time(time_from, "now")
        .timezone("browser")
        .version(1)
        .week_start("")
        .annotation(
            dashboard_b.AnnotationQuery()
            .built_in(1)
            .datasource(model.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .name("Annotations & Alerts")
            .type("dashboard")
        )
        .links(
            [
                dashboard_b.DashboardLink("rankscope dashboards")
                .type(model.DashboardLinkType.DASHBOARDS)
                .icon("external link")
                .tags(["rankscope"])
                .as_dropdown(False)
                .include_vars(False)
                .keep_time(True)
                .target_blank(False)
                .tooltip("")
                .url(""),
                dashboard_b.DashboardLink("Runbook")
                .type(model.DashboardLinkType.LINK)
                .icon("doc")
                .tags([])
                .as_dropdown(False)
                .include_vars(False)
                .keep_time(False)
                .target_blank(True)
                .tooltip("What each alert means")
                .url(RUNBOOK),
            ]
        )
        .variables(variables)
    )
    for panel in panels:
        if isinstance(panel, dashboard_b.Row):
            builder.with_row(panel)
        else:
            builder.with_panel(panel)
    return builder.build()
