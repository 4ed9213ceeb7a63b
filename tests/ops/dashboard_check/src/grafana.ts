// Grafana's dashboard model as it appears in dashboard JSON, from @grafana/schema (the types
// Grafana's own frontend uses), plus the panel plugins' option types for the panels rankscope uses.
//
// Json<T> turns TypeScript string enums (FieldColorModeId, ThresholdsMode, ...) into the union of
// their string values, which is what a JSON file holds; everything else is checked as declared.
import type {
  Dashboard,
  FieldConfig,
  FieldConfigSource,
  Panel,
  RowPanel,
  VariableModel,
} from '@grafana/schema';
import type * as Heatmap from '@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen';
import type * as Stat from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type * as Table from '@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen';
import type * as TimeSeries from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

export type Json<T> = T extends string
  ? `${T}`
  : T extends number | boolean | null | undefined
    ? T
    : T extends ReadonlyArray<infer U>
      ? Array<Json<U>>
      : T extends object
        ? { [K in keyof T]: Json<T[K]> }
        : T;

/** Grafana's dashboard model, unchanged. */
export type GrafanaDashboard = Json<Dashboard>;

// ---- rankscope's stricter profile of that model -------------------------------------------

/** Every query and panel goes through the dashboard's `datasource` variable. */
export interface DatasourceVariableRef {
  type: 'prometheus';
  uid: '${datasource}';
}

/** A Prometheus query as Grafana's Prometheus data source stores it (PromQuery). */
export interface PrometheusQuery {
  refId: string;
  datasource: DatasourceVariableRef;
  expr: string;
  editorMode?: 'code' | 'builder';
  legendFormat?: string;
  instant?: boolean;
  range?: boolean;
  format?: 'time_series' | 'table' | 'heatmap';
  interval?: string;
  intervalFactor?: number;
  exemplar?: boolean;
  hide?: boolean;
}

type PanelWith<TType extends string, TOptions, TCustom> = Omit<
  Panel,
  'type' | 'options' | 'fieldConfig' | 'targets' | 'datasource'
> & {
  type: TType;
  datasource: DatasourceVariableRef;
  options: TOptions;
  fieldConfig: {
    defaults: Omit<FieldConfig, 'custom'> & { custom?: TCustom };
    overrides: FieldConfigSource['overrides'];
  };
  targets: [PrometheusQuery, ...PrometheusQuery[]];
};

export type TimeSeriesPanel = Json<PanelWith<'timeseries', TimeSeries.Options, TimeSeries.FieldConfig>>;
export type StatPanel = Json<PanelWith<'stat', Stat.Options, never>>;
export type TablePanel = Json<PanelWith<'table', Table.Options, Table.FieldConfig>>;
export type HeatmapPanel = Json<PanelWith<'heatmap', Heatmap.Options, Heatmap.FieldConfig>>;
export type RankscopePanel = TimeSeriesPanel | StatPanel | TablePanel | HeatmapPanel;

type DatasourceVariable = Json<VariableModel> & {
  type: 'datasource';
  name: 'datasource';
  query: 'prometheus';
};

export type RankscopeDashboard = Json<Omit<Dashboard, 'panels' | 'templating' | 'uid' | 'title'>> & {
  uid: string;
  title: string;
  panels: Array<RankscopePanel | Json<RowPanel>>;
  templating: { list: [DatasourceVariable, ...Array<Json<VariableModel>>] };
};
