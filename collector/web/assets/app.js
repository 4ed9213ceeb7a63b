// rankscope web view: the jobs list (/) and a job's live page (/job/JOB[?group=G]), drawn with
// plain canvas from the collector's JSON API (/api/v1/...). No framework, no network beyond the
// collector. The page's state is kept in window.rankscope (tests read it) and mirrored in the DOM
// (data-* attributes on the jobs table and the flagged-ranks list).
//
// One file, several parts (the API reads, the jobs list, the heatmap, the groups picture, the rank
// panel), kept together on purpose: they share the page's one state (window.rankscope) and its one
// refresh loop, and the page is one embedded asset with no bundler; split, they would be several
// script tags sharing globals.
"use strict";

(function () {
  const REFRESH_MS = 2000;
  // Steps the page holds: the API's default windows (web_api.h kDefaultStepsWindow and
  // kDefaultRanksWindow).
  const STEPS_WINDOW = 300, RANKS_WINDOW = 120;
  const OUTLIER_THRESHOLD = 6;  // collector/rank_diagnostics.h
  const state = (window.rankscope = { page: null, refreshes: 0, errors: 0 });
  const $ = (id) => document.getElementById(id);

  // ---- API -------------------------------------------------------------------------------
  function token() { return sessionStorage.getItem("rankscope_token") || ""; }

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(path) {
    const headers = {};
    if (token()) headers["Authorization"] = "Bearer " + token();
    const r = await fetch("/api/v1" + path, { headers, cache: "no-store" });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      const msg = body.error ? body.error.message : r.statusText;
      throw new ApiError(r.status, msg);
    }
    return body;
  }

  function enc(key) { return key.split("/").map(encodeURIComponent).join("%2F"); }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  }

  function setStatus(text, isError) {
    const s = $("status");
    s.textContent = text;
    s.className = isError ? "error" : "";
  }

  function showTokenForm(err) {
    const main = $("main");
    main.replaceChildren(el("form", { class: "token-form", id: "token-form" },
      el("div", { text: err.status === 403 ? "The token was refused." :
                                             "This collector requires its shared token." }),
      el("input", { type: "password", id: "token-input", placeholder: "token",
                    autocomplete: "off" }),
      el("button", { type: "submit", text: "Open" })));
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem("rankscope_token", $("token-input").value.trim());
      location.reload();
    });
  }

  // Runs `tick` now and again REFRESH_MS after each run ends (never two at once).
  function every(tick) {
    const run = async () => {
      try {
        await tick();
        state.refreshes += 1;
        setStatus("live · updated " + new Date().toLocaleTimeString());
      } catch (err) {
        state.errors += 1;
        if (err.status === 401 || err.status === 403) { showTokenForm(err); return; }
        setStatus("error: " + err.message + " (retrying)", true);
      }
      setTimeout(run, REFRESH_MS);
    };
    run();
  }

  // ---- formatting and colours ------------------------------------------------------------
  function fmt(v, digits) {
    if (v === null || v === undefined) return "–";
    if (!isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
    return v.toFixed(digits === undefined ? 3 : digits);
  }
  function rankList(ranks) {
    if (!ranks.length) return "";
    return ranks.length > 8 ? ranks.slice(0, 8).join(", ") + ", +" + (ranks.length - 8)
                            : ranks.join(", ");
  }
  function lerp(a, b, t) { return a + (b - a) * t; }
  function ramp(stops, t) {  // stops: [[t, r, g, b], ...]
    t = Math.max(0, Math.min(1, t));
    for (let i = 1; i < stops.length; i++) {
      if (t <= stops[i][0]) {
        const [t0, r0, g0, b0] = stops[i - 1], [t1, r1, g1, b1] = stops[i];
        const u = (t - t0) / (t1 - t0 || 1);
        return [lerp(r0, r1, u), lerp(g0, g1, u), lerp(b0, b1, u)];
      }
    }
    return stops[stops.length - 1].slice(1);
  }
  // The one colour scale of the rank heatmap and the groups picture (as the report's): 1 is what healthy looks like (green), 0 a full
  // deviation (red). Each metric maps its value to 0..1 against a healthy anchor (scaleFor()).
  // The top tenth is one green, so the healthy ranks' own spread below their median reads as
  // one colour and only a deviation changes it.
  const HEALTH = [[0, 165, 0, 38], [0.3, 244, 109, 67], [0.55, 254, 224, 139],
                  [0.78, 145, 207, 96], [0.9, 26, 152, 80], [1, 26, 152, 80]];
  const METRICS = {
    // Anchored to the window's healthy cosine (the median of every rank's cells, most ranks being
    // healthy): the median and above is green, min(0, median - 0.5) and below red. A rank whose
    // direction disagrees (cosine ~0 where healthy ranks sit at ~0.95) is red at any rank count.
    cosine: { label: "consensus cosine", worst: Math.min },
    // Already a robust z against the other ranks (rank_diagnostics.h): 0 to half the threshold
    // green, the threshold yellow, twice it red.
    outlier: { label: "outlier score", worst: Math.max },
  };
  // Cells that have no value to colour, each apart from the ramp and from the page's white:
  // a missing rank (no row: silent or timed out) dark grey, non-finite (the stored verdict) black,
  // a divergent replica purple, a row without this metric (a late report) light grey. A cell
  // covering several ranks or steps shows its worst: non-finite, divergent, missing, then the
  // worst value (cosine lowest, outlier score highest). Ticks in the marks gutters (and the
  // flagged list) use MARK_CSS.
  const MARK = { missing: [96, 96, 96], nonfinite: [0, 0, 0], divergent: [142, 36, 170],
                 novalue: [222, 222, 222] };
  const MARK_CODE = { missing: 1, divergent: 2, nonfinite: 3 };  // priority: higher wins
  const MARK_OF_CODE = [null, MARK.missing, MARK.divergent, MARK.nonfinite];
  const BACKGROUND = [255, 255, 255];
  const MARK_CSS = { missing: "#c62828", nonfinite: "#000", divergent: "#8e24aa",
                     outlier: "#e08a00", drifting: "#1565c0", slow: "#6d4c41" };
  // A colour per 1/1023 of the 0..1 health scale, so a 4,096 x 120 heatmap needs no per-cell
  // ramp().
  function lut(stops) {
    const t = new Uint8ClampedArray(1024 * 3);
    for (let i = 0; i < 1024; i++) {
      const [r, g, b] = ramp(stops, i / 1023);
      t[i * 3] = Math.round(r); t[i * 3 + 1] = Math.round(g); t[i * 3 + 2] = Math.round(b);
    }
    return t;
  }
  const HEALTH_LUT = lut(HEALTH);
  // The colour of a value already mapped to the 0..1 health scale (clamped), as [r, g, b].
  function healthColor(t) {
    const k = Math.round(Math.max(0, Math.min(1, t)) * 1023) * 3;
    return [HEALTH_LUT[k], HEALTH_LUT[k + 1], HEALTH_LUT[k + 2]];
  }
  // The median of the finite values of the arrays `lists` (cosines: a histogram of 2,001 bins
  // over -1..1).
  function medianCosine(lists) {
    const bins = new Uint32Array(2001);
    let n = 0;
    for (const list of lists) {
      for (const v of list) {
        if (v === null || v === undefined || !isFinite(v)) continue;
        bins[Math.max(0, Math.min(2000, Math.round((v + 1) * 1000)))] += 1;
        n += 1;
      }
    }
    if (!n) return null;
    let seen = 0;
    for (let i = 0; i < bins.length; i++) {
      seen += bins[i];
      if (seen * 2 >= n) return i / 1000 - 1;
    }
    return null;
  }
  // The metric's mapping to the 0..1 health scale, and its legend: {t(v), lo, hi, healthy}.
  function scaleFor(metric, steps) {
    if (metric === "outlier") {
      // Healthy ranks' scores spread over 0 .. half the threshold (a robust z of a few
      // signals): that band is green, the threshold yellow, twice it red.
      const hi = 2 * OUTLIER_THRESHOLD, ok = OUTLIER_THRESHOLD / 2;
      return { t: (v) => (v <= ok ? 1 - (0.1 * v) / ok : 0.9 - (0.9 * (v - ok)) / (hi - ok)),
               lo: hi + "+", hi: "0", healthy: 0,
               text: "outlier score: 0 to " + ok + " green, " + OUTLIER_THRESHOLD +
                     " (threshold) yellow, " + hi + "+ red" };
    }
    return cosineScale(medianCosine(steps.map((s) => s.cosine)), "consensus cosine");
  }
  // A cosine's mapping to the health scale, anchored to the healthy median `med` (null: none
  // known, 1): the median and above green, min(0, median - 0.5) and below red. The rank
  // heatmap's consensus cosine and the groups picture's direction consistency both use it.
  function cosineScale(med, label) {
    const healthy = med === null ? 1 : med;
    const lo = Math.min(0, healthy - 0.5), span = Math.max(healthy - lo, 1e-6);
    return { t: (v) => (v - lo) / span, lo: fmt(lo, 2), hi: fmt(healthy, 2), healthy,
             text: label + ": healthy (the median, " + fmt(healthy, 3) +
                   ") and above green, " + fmt(lo, 2) + " and below red" };
  }

  // ---- canvas line charts ----------------------------------------------------------------
  function sizeCanvas(canvas, cssW, cssH) {
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
    canvas.style.width = cssW + "px";
    canvas.style.height = cssH + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }

  // series: [{xs, ys, color, band: [lo[], hi[]] (optional)}]; marks: [{x, color}] vertical lines.
  function lineChart(canvas, series, opts) {
    const cssW = canvas.parentElement.clientWidth - 16 || 600, cssH = 170;
    const ctx = sizeCanvas(canvas, cssW, cssH);
    const L = 56, R = 8, T = 8, B = 22, W = cssW - L - R, H = cssH - T - B;
    let xmin = Infinity, xmax = -Infinity, ymin = Infinity, ymax = -Infinity;
    for (const s of series) {
      s.xs.forEach((x, i) => {
        const lo = s.band ? s.band[0][i] : s.ys[i], hi = s.band ? s.band[1][i] : s.ys[i];
        for (const y of [s.ys[i], lo, hi]) {
          if (y === null || !isFinite(y)) continue;
          xmin = Math.min(xmin, x); xmax = Math.max(xmax, x);
          ymin = Math.min(ymin, y); ymax = Math.max(ymax, y);
        }
      });
    }
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#6a737d";
    if (!isFinite(xmin)) { ctx.fillText("no data yet", L + 8, T + 20); return; }
    if (opts && opts.ymin !== undefined) ymin = Math.min(ymin, opts.ymin);
    if (opts && opts.ymax !== undefined) ymax = Math.max(ymax, opts.ymax);
    if (ymax === ymin) { ymax += Math.abs(ymax) * 0.05 || 1; ymin -= Math.abs(ymin) * 0.05 || 1; }
    const pad = (ymax - ymin) * 0.06; ymin -= pad; ymax += pad;
    if (xmax === xmin) xmax = xmin + 1;
    const X = (x) => L + ((x - xmin) / (xmax - xmin)) * W;
    const Y = (y) => T + (1 - (y - ymin) / (ymax - ymin)) * H;
    ctx.strokeStyle = "#d9dee3"; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = ymin + ((ymax - ymin) * i) / 4;
      ctx.beginPath(); ctx.moveTo(L, Y(y)); ctx.lineTo(L + W, Y(y)); ctx.stroke();
      ctx.fillText(fmt(y, 3), L - 4, Y(y));
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (let i = 0; i <= 4; i++) {
      const x = xmin + ((xmax - xmin) * i) / 4;
      ctx.fillText(String(Math.round(x)), X(x), T + H + 5);
    }
    for (const m of (opts && opts.marks) || []) {
      ctx.strokeStyle = m.color; ctx.beginPath(); ctx.moveTo(X(m.x), T); ctx.lineTo(X(m.x), T + H);
      ctx.stroke();
    }
    for (const s of series) {
      if (s.band) {
        ctx.fillStyle = s.bandColor || "rgba(11, 92, 173, 0.18)";
        ctx.beginPath();
        let started = false;
        s.xs.forEach((x, i) => {
          const y = s.band[1][i]; if (y === null || !isFinite(y)) return;
          if (!started) { ctx.moveTo(X(x), Y(y)); started = true; } else ctx.lineTo(X(x), Y(y));
        });
        for (let i = s.xs.length - 1; i >= 0; i--) {
          const y = s.band[0][i]; if (y === null || !isFinite(y)) continue;
          ctx.lineTo(X(s.xs[i]), Y(y));
        }
        ctx.closePath(); ctx.fill();
      }
      ctx.strokeStyle = s.color; ctx.lineWidth = 1.5; ctx.beginPath();
      let pen = false;
      s.xs.forEach((x, i) => {
        const y = s.ys[i];
        if (y === null || !isFinite(y)) { pen = false; return; }
        if (!pen) { ctx.moveTo(X(x), Y(y)); pen = true; } else ctx.lineTo(X(x), Y(y));
      });
      ctx.stroke();
    }
  }

  function chartBox(id, title) {
    return el("div", { class: "chart" }, el("div", { class: "title", text: title }),
              el("canvas", { id }));
  }

  // ---- jobs page -------------------------------------------------------------------------
  function alertsOf(latest) {
    const out = [];
    if (!latest) return out;
    if (latest.divergent_ranks.length) out.push(["divergent", "divergent replicas: " + rankList(latest.divergent_ranks), latest.divergent_ranks]);
    if (latest.outlier_ranks.length) out.push(["outlier", "outlier ranks: " + rankList(latest.outlier_ranks), latest.outlier_ranks]);
    if (latest.missing_ranks) out.push(["missing", "missing ranks: " + latest.missing_ranks, []]);
    // The sequential verdicts, as `rankscope show` (DRIFTING, SLOW) and the alerts
    // (RankscopeRankDrifting, RankscopeRankStraggler) name them.
    if (latest.drifting_ranks.length) out.push(["drifting", "drifting ranks: " + rankList(latest.drifting_ranks), latest.drifting_ranks]);
    if (latest.slow_ranks.length) out.push(["slow", "slow ranks: " + rankList(latest.slow_ranks), latest.slow_ranks]);
    // The aggregation check (RankscopeAggregationIntegrity): the all-reduce returned a wrong sum
    // on every rank; the rank whose contribution was missing, doubled or corrupted when named.
    if (latest.integrity_fault) {
      const named = latest.integrity_rank === null || latest.integrity_rank === undefined ? [] : [latest.integrity_rank];
      out.push(["integrity", "aggregation integrity: " + latest.integrity_fault +
        (named.length ? " (rank " + named[0] + ")" : " (no single rank)"), named]);
    }
    return out;
  }

  function jobsPage() {
    state.page = "jobs";
    document.title = "rankscope · jobs";
    $("main").replaceChildren(
      el("h2", { text: "Jobs" }),
      el("table", { class: "jobs", id: "jobs" },
         el("thead", null, el("tr", null,
            ...["job / group", "state", "world size", "connected", "last step",
                "direction consistency", "alerts"].map((h) => el("th", { text: h })))),
         el("tbody", { id: "jobs-body" })),
      el("p", { class: "muted", text: "Alerts are the latest stored step's: divergent replicas " +
        "(fingerprints that disagree), outlier ranks (persistent), missing ranks (timed out), " +
        "drifting and slow ranks (sequential tests), a failed aggregation check (when that " +
        "step was checked), as `rankscope show` names them." }));
    every(async () => {
      const data = await api("/jobs");
      state.jobs = data.jobs;
      const byJob = new Map();
      for (const j of data.jobs) {
        if (!byJob.has(j.job)) byJob.set(j.job, []);
        byJob.get(j.job).push(j);
      }
      const rows = [];
      for (const [job, keys] of byJob) {
        const grouped = keys.length > 1 || keys[0].group !== "";
        const active = keys.some((k) => k.state === "active");
        const alerts = keys.flatMap((k) => alertsOf(k.latest).map((a) =>
          grouped ? [a[0], k.group + ": " + a[1]] : a));
        const lastStep = Math.max(...keys.map((k) => k.last_step));
        const cos = grouped ? Math.min(...keys.map((k) => k.latest ? k.latest.grad_cosine_mean : Infinity))
                            : (keys[0].latest ? keys[0].latest.grad_cosine_mean : null);
        // A fleet (--fleet): a job another shard holds is named with its collector, whose web
        // view shows it; this collector's own jobs link to their page as always.
        const remote = keys.every((k) => k.remote);
        rows.push(jobRow({ name: job, href: remote ? null : "/job/" + encodeURIComponent(job),
          collector: keys[0].collector || "",
          state: active ? "active" : "idle",
          world: keys.reduce((a, k) => a + k.world_size, 0),
          connected: keys.reduce((a, k) => a + k.connected_ranks, 0), lastStep,
          cos: isFinite(cos) ? cos : null, alerts, groups: grouped ? keys.length : 0,
          key: grouped ? job : keys[0].key, cls: "job" }));
        if (grouped) {
          for (const k of keys) {
            rows.push(jobRow({ name: k.group || "(default)", collector: k.collector || "",
              href: k.remote ? null
                : "/job/" + encodeURIComponent(job) + "?group=" + encodeURIComponent(k.group),
              state: k.state, world: k.world_size, connected: k.connected_ranks,
              lastStep: k.last_step, cos: k.latest ? k.latest.grad_cosine_mean : null,
              alerts: alertsOf(k.latest), key: k.key, cls: "group" }));
          }
        }
      }
      if (!rows.length) {
        rows.push(el("tr", null, el("td", { colspan: 7, class: "muted",
          text: "No jobs yet: start agents with RANKSCOPE_COLLECTOR pointing at this collector." })));
      }
      $("jobs-body").replaceChildren(...rows);
    });
  }

  function jobRow(r) {
    const alerts = el("td", { class: "alerts" });
    if (!r.alerts.length) alerts.append(el("span", { class: "ok", text: "none" }));
    for (const [kind, text] of r.alerts) alerts.append(el("span", { class: "alert " + kind, text }));
    const name = el("td", { class: "name" },
      r.href ? el("a", { href: r.href, text: r.name }) : el("span", { text: r.name }));
    if (r.groups) name.append(el("span", { class: "muted", text: "  " + r.groups + " groups" }));
    if (!r.href && r.collector) {
      name.append(el("span", { class: "muted", text: "  on " + r.collector }));
    }
    return el("tr", { class: r.cls, "data-key": r.key, "data-state": r.state,
                      "data-collector": r.collector,
                      "data-alerts": [...new Set(r.alerts.map((a) => a[0]))].join(",") },
      name, el("td", { class: "state-" + r.state, text: r.state }),
      el("td", { class: "num", text: String(r.world) }),
      el("td", { class: "num", text: String(r.connected) }),
      el("td", { class: "num", text: String(r.lastStep) }),
      el("td", { class: "num", text: fmt(r.cos, 3) }), alerts);
  }

  // ---- job page --------------------------------------------------------------------------
  async function jobPage(job, group) {
    state.page = "job";
    state.job = job;
    document.title = "rankscope · " + job;
    $("crumb").replaceChildren(el("span", { text: "/ " }),
      el("a", { href: "/job/" + encodeURIComponent(job), text: job }),
      el("span", { text: group !== null ? " / group " + group : "" }));
    let keys;
    try {
      keys = (await api("/jobs")).jobs.filter((j) => j.job === job);
    } catch (err) {
      if (err.status === 401 || err.status === 403) return showTokenForm(err);
      $("main").replaceChildren(el("p", { class: "error", text: err.message }));
      return;
    }
    if (!keys.length) {
      // Not (yet) known: a page opened before the job's first hello shows it once it arrives.
      $("main").replaceChildren(el("p", { class: "error", id: "not-found",
        text: "No job " + job + " on this collector yet; waiting for it." }),
        el("a", { href: "/", text: "all jobs" }));
      setStatus("waiting for job " + job);
      setTimeout(() => jobPage(job, group), REFRESH_MS);
      return;
    }
    const grouped = keys.length > 1 || keys[0].group !== "";
    if (grouped && group === null) return groupsPage(job, keys);
    // A job's only group (or, beside named groups, its unnamed one) is the job's own key.
    const key = group ? job + "/" + group : job;
    if (!keys.some((k) => k.key === key)) {
      $("main").replaceChildren(el("p", { class: "error", id: "not-found",
        text: "Job " + job + " has no group " + group + "." }));
      return;
    }
    return groupDetail(key);
  }

  // A job with several data-parallel groups: groups x steps of direction consistency.
  function groupsPage(job, keys) {
    state.page = "groups";
    $("main").replaceChildren(
      el("h2", { text: "Direction consistency per data-parallel group" }),
      el("p", { class: "muted", text: "Each row is a group, each column a step; colour is the " +
        "group's mean pairwise gradient cosine, on the rank heatmap's scale (the groups' median " +
        "and above green). A group that is off stands out as a redder row." }),
      el("div", { class: "heat-controls" }, el("canvas", { id: "legend" })),
      el("div", { id: "scale-info", class: "muted" }),
      el("canvas", { id: "groups-picture" }),
      el("h2", { text: "Groups" }),
      el("ul", { id: "groups-list" }));
    every(async () => {
      const fresh = (await api("/jobs")).jobs.filter((j) => j.job === job);
      const series = await Promise.all(fresh.map((k) => api("/jobs/" + enc(k.key) + "/steps")));
      state.groups = fresh.map((k, i) => ({ group: k.group, key: k.key,
        steps: series[i].steps.map((s) => s.step),
        cosine: series[i].steps.map((s) => s.grad_cosine_mean) }));
      // Anchored as the heatmap's cosine: most groups are healthy, so their median is.
      const scale = cosineScale(medianCosine(state.groups.map((g) => g.cosine)),
                                "direction consistency");
      drawLegend($("legend"), { label: "direction consistency", stops: HEALTH,
                                lo: scale.lo, hi: scale.hi });
      $("scale-info").textContent = scale.text;
      drawGroupsPicture($("groups-picture"), state.groups, scale);
      let worst = null;
      for (const g of state.groups) {
        const last = g.cosine.length ? g.cosine[g.cosine.length - 1] : null;
        g.latest = last;
        if (last !== null && (worst === null || last < worst.latest)) worst = g;
      }
      state.worstGroup = worst ? worst.group : null;
      $("groups-list").replaceChildren(...state.groups.map((g) =>
        el("li", { "data-group": g.group, "data-worst": String(worst === g) },
           el("a", { href: "/job/" + encodeURIComponent(job) + "?group=" + encodeURIComponent(g.group),
                     text: g.group || "(default)" }),
           el("span", { text: "  latest direction consistency " + fmt(g.latest, 3) +
                        (worst === g && state.groups.length > 1 ? " (least consistent)" : "") }))));
    });
  }

  // Groups x steps, each cell the group's direction consistency coloured by `scale`
  // (cosineScale()); the geometry is kept in state.groupsLayout (tests read the pixels).
  function drawGroupsPicture(canvas, groups, scale) {
    const steps = [...new Set(groups.flatMap((g) => g.steps))].sort((a, b) => a - b);
    const labelW = 140, rowH = Math.max(6, Math.min(28, Math.floor(480 / Math.max(groups.length, 1))));
    const cols = steps.length, plotW = Math.max(300, Math.min(1100, cols * 3));
    const cssW = labelW + plotW + 10, cssH = groups.length * rowH + 26;
    const ctx = sizeCanvas(canvas, cssW, cssH);
    const col = new Map(steps.map((s, i) => [s, i]));
    const cw = plotW / Math.max(cols, 1);
    state.groupsLayout = { labelW, rowH, cw, cols, steps };
    ctx.font = "12px system-ui, sans-serif"; ctx.textBaseline = "middle"; ctx.textAlign = "right";
    groups.forEach((g, r) => {
      ctx.fillStyle = "#1d232b";
      if (rowH >= 10) ctx.fillText(g.group || "(default)", labelW - 6, r * rowH + rowH / 2);
      ctx.fillStyle = "#eee"; ctx.fillRect(labelW, r * rowH, plotW, rowH - (rowH > 8 ? 1 : 0));
      g.steps.forEach((s, i) => {
        const v = g.cosine[i];
        const [R, G, B] = v === null ? MARK.missing : healthColor(scale.t(v));
        ctx.fillStyle = `rgb(${R | 0},${G | 0},${B | 0})`;
        // Whole-pixel columns (as the heatmap's): no seam between steps.
        const x0 = Math.floor(col.get(s) * cw), x1 = Math.floor((col.get(s) + 1) * cw);
        ctx.fillRect(labelW + x0, r * rowH, Math.max(1, x1 - x0), rowH - (rowH > 8 ? 1 : 0));
      });
    });
    ctx.fillStyle = "#6a737d"; ctx.textAlign = "center"; ctx.textBaseline = "top";
    if (cols) {
      for (let i = 0; i <= 4; i++) {
        const c = Math.min(cols - 1, Math.round(((cols - 1) * i) / 4));
        ctx.fillText(String(steps[c]), labelW + (c + 0.5) * cw, groups.length * rowH + 6);
      }
    }
  }

  function drawLegend(canvas, metric) {
    const ctx = sizeCanvas(canvas, 360, 30);
    ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#1d232b"; ctx.textBaseline = "top";
    ctx.fillText(metric.label + ":", 0, 2);
    const x0 = Math.max(110, Math.ceil(ctx.measureText(metric.label + ":").width) + 8), w = 160;
    for (let i = 0; i < w; i++) {
      const [r, g, b] = ramp(metric.stops, i / (w - 1));
      ctx.fillStyle = `rgb(${r | 0},${g | 0},${b | 0})`; ctx.fillRect(x0 + i, 2, 1, 12);
    }
    ctx.fillStyle = "#1d232b"; ctx.textAlign = "left"; ctx.fillText(metric.lo, x0, 17);
    ctx.textAlign = "right"; ctx.fillText(metric.hi, x0 + w, 17);
  }

  function groupDetail(key) {
    state.page = "job";
    state.key = key;
    state.metric = "cosine";
    state.selectedRank = null;
    $("main").replaceChildren(
      el("h2", { text: "Over steps" }),
      el("div", { class: "charts" },
         chartBox("chart-loss", "loss mean ± std across ranks"),
         chartBox("chart-cv", "gradient-norm CV (std / mean)"),
         chartBox("chart-cos", "direction consistency (mean pairwise cosine)"),
         chartBox("chart-noise", "gradient noise scale B_simple")),
      el("p", { class: "muted", text: "Vertical lines: steps that closed with ranks missing " +
        "(red) or with divergent replicas (purple)." }),
      el("h2", { text: "Ranks × steps" }),
      el("div", { class: "heat-controls" },
         el("label", null, "colour: ", el("select", { id: "metric" },
            el("option", { value: "cosine", text: "consensus cosine" }),
            el("option", { value: "outlier", text: "outlier score" }))),
         el("canvas", { id: "legend" }),
         el("span", { class: "key" },
            ...["missing", "nonfinite", "divergent", "novalue"].map((k) => el("span", null,
              el("i", { class: "cell-" + k }),
              { missing: "missing", nonfinite: "non-finite", divergent: "divergent replica",
                novalue: "no value" }[k])),
            ...["outlier", "missing", "nonfinite", "divergent", "drifting", "slow"].map((k) => el("span", null,
              el("i", { class: "swatch-" + k }), k === "nonfinite" ? "non-finite" : k)),
            el("span", null, "(flagged-rank ticks)")),
         el("span", { id: "heat-info", class: "muted" })),
      el("div", { class: "heat-controls" },
         el("span", null, "steps: "),
         el("button", { id: "heat-older", text: "◀ older" }),
         el("button", { id: "heat-newer", text: "newer ▶" }),
         el("button", { id: "heat-zoom-out", text: "more steps" }),
         el("button", { id: "heat-zoom-in", text: "fewer steps" }),
         el("button", { id: "heat-live", text: "live" }),
         el("span", null, " ranks: drag over the heatmap to zoom into a band, "),
         el("button", { id: "heat-all-ranks", text: "all ranks" }),
         el("span", { id: "heat-window", class: "muted" })),
      el("div", { id: "scale-info", class: "muted" }),
      el("div", { class: "heat-wrap" },
         el("div", { class: "heat-scroll" }, el("canvas", { id: "heatmap" })),
         el("div", null, el("div", { class: "title", text: "Flagged ranks (click to open)" }),
            el("ul", { id: "flagged" }))),
      el("div", { id: "rank-panel" }),
      el("div", { id: "tooltip" }));
    for (const k of Object.keys(MARK_CSS)) {
      document.querySelectorAll(".swatch-" + k).forEach((i) => { i.style.background = MARK_CSS[k]; });
    }
    for (const k of Object.keys(MARK)) {
      document.querySelectorAll(".cell-" + k).forEach((i) => {
        i.style.background = `rgb(${MARK[k].join(",")})`;
      });
    }
    // The cell colours the page draws with (tests compare the canvas's pixels against them).
    state.colors = { ...MARK, background: BACKGROUND };
    $("metric").addEventListener("change", (ev) => {
      state.metric = ev.target.value;
      if (state.matrix) drawHeatmap();
    });
    const heat = $("heatmap");
    heat.addEventListener("mousemove", (ev) => {
      const cell = heatCell(ev);
      const tip = $("tooltip");
      if (!cell) { tip.style.display = "none"; return; }
      const steps = state.matrix.steps.slice(cell.col, cell.lastCol + 1);
      const worst = METRICS[state.metric].worst;
      let v = null, missing = false, nonfinite = false, divergent = false;
      for (const s of steps) {
        for (let r = cell.rank; r <= cell.lastRank; r++) {
          const x = s[state.metric][r];
          if (x !== null && x !== undefined) v = v === null ? x : worst(v, x);
          missing = missing || s.missing.includes(r);
          nonfinite = nonfinite || s.nonfinite.includes(r);
          divergent = divergent || s.divergent.includes(r);
        }
      }
      let what = state.metric + " " + fmt(v, 3) + (steps.length > 1 || cell.lastRank > cell.rank
                                                     ? " (worst)" : "");
      if (missing) what += ", missing";
      if (nonfinite) what += ", non-finite";
      if (divergent) what += ", divergent replica";
      const span = (a, b) => (a === b ? String(a) : a + "–" + b);
      tip.textContent = (cell.lastRank > cell.rank ? "ranks " : "rank ") +
        span(cell.rank, cell.lastRank) + " · step" + (steps.length > 1 ? "s " : " ") +
        span(steps[0].step, steps[steps.length - 1].last ?? steps[steps.length - 1].step) +
        (steps.some((s) => s.downsampled) ? " (downsampled window)" : "") + " · " + what;
      tip.style.left = ev.clientX + 12 + "px"; tip.style.top = ev.clientY + 12 + "px";
      tip.style.display = "block";
    });
    heat.addEventListener("mouseleave", () => { $("tooltip").style.display = "none"; });
    // Brushing: a vertical drag of 4 px or more selects the band of ranks it covers; a click
    // (less) opens the rank.
    let brushFrom = null, brushed = false;
    heat.addEventListener("mousedown", (ev) => { brushFrom = { y: ev.clientY, cell: heatCell(ev) }; });
    heat.addEventListener("mouseup", (ev) => {
      const from = brushFrom;
      brushFrom = null;
      brushed = false;
      if (!from || !from.cell || Math.abs(ev.clientY - from.y) < 4) return;
      const to = heatCell(ev);
      if (!to) return;
      brushed = true;
      const lo = Math.min(from.cell.rank, to.rank), hi = Math.max(from.cell.lastRank, to.lastRank);
      state.band = [lo, hi];
      drawHeatmap();
    });
    heat.addEventListener("click", (ev) => {
      if (brushed) { brushed = false; return; }
      const cell = heatCell(ev);
      // The rank, at the cell's (newest) step: its panel says which buckets deviate there.
      if (cell) selectRank(cell.rank, state.matrix.steps[cell.lastCol].last ??
                                      state.matrix.steps[cell.lastCol].step);
    });
    $("heat-all-ranks").addEventListener("click", () => { state.band = null; drawHeatmap(); });
    // History: the heatmap's window of steps pans (half a window at a time) and zooms (30 to
    // 960 steps, several steps a pixel column beyond the plot's width); away from the newest
    // steps it stops following them until "live".
    state.view = { live: true, span: RANKS_WINDOW };
    state.band = null;  // [first rank, last rank] brushed, or every rank
    const showWindow = async (first, last) => {
      first = Math.max(0, first);
      const m = await api("/jobs/" + enc(key) + "/ranks?first=" + first + "&last=" + last);
      m.requested = [first, last];
      state.matrix = withWindows(m);
      state.changes = m.changes;
      drawHeatmap();
    };
    const newest = () => Math.max(state.lastStep || 0,
                                  state.matrix ? lastOf(state.matrix.steps) || 0 : 0);
    const heldFirst = () => (state.matrix && state.matrix.steps.length ? state.matrix.steps[0].step
                                                                        : newest());
    const heldLast = () => (state.matrix && state.matrix.steps.length
                            ? lastOf(state.matrix.steps) : newest());
    const live = () => { state.view.live = true; return showWindow(newest() - state.view.span + 1, newest()); };
    $("heat-older").addEventListener("click", () => {
      state.view.live = false;
      const first = Math.max(0, heldFirst() - Math.floor(state.view.span / 2));
      return showWindow(first, first + state.view.span - 1);
    });
    $("heat-newer").addEventListener("click", () => {
      const last = heldLast() + Math.floor(state.view.span / 2);
      if (last >= newest()) return live();
      return showWindow(last - state.view.span + 1, last);
    });
    const zoom = (span) => {
      state.view.span = span;
      if (state.view.live) return live();
      // About the window's centre; a window that reaches the newest step goes live.
      const first = Math.max(0, Math.floor((heldFirst() + heldLast() - span) / 2));
      if (first + span - 1 >= newest()) return live();
      return showWindow(first, first + span - 1);
    };
    $("heat-zoom-out").addEventListener("click", () => zoom(Math.min(960, state.view.span * 2)));
    $("heat-zoom-in").addEventListener("click", () => zoom(Math.max(30, Math.floor(state.view.span / 2))));
    $("heat-live").addEventListener("click", live);
    // The first read takes the API's default windows; every later one only the steps after the
    // newest the page holds (?since=), merged in, the oldest dropped beyond the window. The rank
    // matrix's reads also pass the cursor of the previous answer (?changes=) and the first step
    // the page holds (&first=): the collector answers again every held step whose rows were
    // stored since (a late report for a step however old, a step that closed after newer ones),
    // and only those; the page replaces them. Away from the newest steps (history) the reads
    // ask for the held window's changed steps alone. Where the collector cannot say what changed
    // (it restarted, or the cursor is older than its change log), the answer holds every held
    // step ("resync") and replaces them all.
    const lastOf = (a) => (a && a.length ? a[a.length - 1].step : null);
    // `held` with the steps of `fresh` (an answer's, ascending) put in: a step the page has is
    // replaced, a new one inserted; with `resync`, every held step up to `upTo` is replaced.
    // Then at most `window` steps back from the newest (live; null: history keeps its window).
    const merge = (held, fresh, window, resync, upTo) => {
      if (!fresh.length && !resync) return held;
      const byStep = new Map();
      for (const s of held) if (!(resync && s.step <= upTo)) byStep.set(s.step, s);
      for (const s of fresh) byStep.set(s.step, s);
      const out = [...byStep.values()].sort((a, b) => a.step - b.step);
      if (window === null || !out.length) return out;
      const newest = out[out.length - 1].step;
      return out.filter((s) => s.step + window > newest);
    };
    // The steps answer (line charts): only newer steps, appended.
    const mergeSteps = (held, fresh, window) => {
      if (!fresh.length) return held;
      const out = held.filter((s) => s.step < fresh[0].step).concat(fresh);
      const newest = out[out.length - 1].step;
      return out.filter((s) => s.step + window > newest);
    };
    state.fetches = [];  // per read: the queries and the steps each answer held
    every(async () => {
      const f0 = performance.now();
      const m0 = state.matrix, live = state.view.live;
      const stepsSince = lastOf(state.steps), ranksSince = m0 ? lastOf(m0.steps) : null;
      const stepsQ = stepsSince === null ? "" : "?since=" + stepsSince;
      let ranksQ = "";
      if (!live && m0 && m0.requested && state.changes) {
        ranksQ = "?first=" + m0.requested[0] + "&last=" + m0.requested[1] + "&changes=" +
                 state.changes;
      } else if (live && ranksSince !== null && state.changes) {
        ranksQ = "?since=" + ranksSince + "&first=" + m0.steps[0].step + "&changes=" +
                 state.changes;
      }
      const [steps, matrix] = await Promise.all([
        api("/jobs/" + enc(key) + "/steps" + stepsQ),
        // History without a cursor (never, past the first window's answer): nothing to read.
        live || ranksQ ? api("/jobs/" + enc(key) + "/ranks" + ranksQ)
                       : Promise.resolve(null)]);
      state.fetchMs = performance.now() - f0;  // both answers, fetched and parsed
      state.fetches.push({ steps: stepsQ, ranks: ranksQ, step_rows: steps.steps.length,
                           rank_steps: matrix ? matrix.steps.map((s) => s.step) : [],
                           resync: !!(matrix && matrix.resync) });
      if (state.fetches.length > 200) state.fetches.shift();
      state.steps = stepsQ ? mergeSteps(state.steps, steps.steps, STEPS_WINDOW) : steps.steps;
      let matrixChanged = false;
      // A pan or zoom while this read was in flight replaced the matrix: its answer is stale.
      if (matrix && state.matrix === m0 && state.view.live === live) {
        if (!ranksQ) {
          matrixChanged = true;
          state.matrix = withWindows(matrix);
        } else {
          const fresh = matrix.resync ? withWindows(matrix).steps : matrix.steps;
          matrixChanged = fresh.length > 0 || !!matrix.resync;
          const upTo = live ? ranksSince : m0.requested[1];
          m0.steps = merge(m0.steps, fresh, live ? state.view.span : null, !!matrix.resync, upTo);
          m0.world_size = Math.max(m0.world_size, matrix.world_size);
          if (matrix.resync) m0.downsampled_before = matrix.downsampled_before;
          if (live) { m0.truncated = matrix.truncated; m0.last = matrix.last; }
        }
        state.changes = matrix.changes;
      }
      state.lastStep = lastOf(state.steps);
      const changed = !stepsQ || steps.steps.length || matrixChanged;
      if (!changed) return;
      drawCharts();
      const t0 = performance.now();
      drawHeatmap();
      state.heatmapMs = performance.now() - t0;  // the heatmap and its flagged list, drawn
      state.updateMs = performance.now() - f0;  // this read: fetched, parsed, merged and drawn
      state.draws = (state.draws || 0) + 1;
      // From navigation start to the first heatmap on screen (performance.now() counts from it).
      if (state.firstHeatmapAt === undefined && state.matrix && state.matrix.steps.length) {
        state.firstHeatmapAt = performance.now();
      }
      if (state.selectedRank !== null) await loadRank(state.selectedRank);
    });
  }

  function drawCharts() {
    const st = state.steps, xs = st.map((s) => s.step);
    const marks = st.filter((s) => s.timed_out || s.divergent_ranks.length)
      .map((s) => ({ x: s.step, color: s.divergent_ranks.length ? "rgba(142,36,170,0.5)"
                                                             : "rgba(198,40,40,0.25)" }));
    lineChart($("chart-loss"), [{ xs, ys: st.map((s) => s.loss_mean), color: "#0b5cad",
      band: [st.map((s) => s.loss_mean - s.loss_std), st.map((s) => s.loss_mean + s.loss_std)] }],
      { marks });
    lineChart($("chart-cv"), [{ xs, ys: st.map((s) => s.grad_norm_cv), color: "#e08a00" }],
      { ymin: 0, marks });
    lineChart($("chart-cos"), [{ xs, ys: st.map((s) => s.grad_cosine_mean), color: "#2e7d32" }],
      { marks });
    lineChart($("chart-noise"), [{ xs, ys: st.map((s) => s.grad_noise_scale), color: "#6a1b9a" }],
      { marks });
  }

  // Layout of the heatmap in whole canvas pixels (1 CSS px = 1 canvas px): every cell is an
  // integer rectangle, so no background shows between columns or rows. Up to 1,024 ranks each get
  // their own row (1..14 px); above, ranksPerRow ranks share a 1 px row. Up to 960 steps each get
  // their own column (1..32 px); above, stepsPerCol steps share a 1 px column. A shared cell
  // shows its worst (MARK above).
  function heatLayout(W, S) {
    const ranksPerRow = W <= 1024 ? 1 : Math.ceil(W / 1024);
    const nRows = Math.max(1, Math.ceil(W / ranksPerRow));
    const rowH = Math.max(1, Math.min(14, Math.floor(720 / nRows)));
    const stepsPerCol = S <= 960 ? 1 : Math.ceil(S / 960);
    const nCols = Math.max(1, Math.ceil(S / stepsPerCol));
    const colW = Math.max(1, Math.min(32, Math.floor(960 / nCols)));
    const gutter = 56, marks = 12, top = 8;
    const plotW = nCols * colW, plotH = nRows * rowH;
    const x0 = gutter + marks;
    // emphasis: pixel rows a flagged row's band covers on each side (drawHeatmap).
    return { ranksPerRow, nRows, rowH, stepsPerCol, nCols, colW, gutter, marks, top, x0,
             plotW, plotH, emphasis: rowH < 3 ? 1 : 0, cssW: x0 + plotW + marks + 4,
             cssH: top + plotH + 24 };
  }

  function heatCell(ev) {
    if (!state.matrix || !state.layout) return null;
    const r = $("heatmap").getBoundingClientRect(), lay = state.layout;
    const x = Math.floor(ev.clientX - r.left) - lay.x0, y = Math.floor(ev.clientY - r.top) - lay.top;
    if (x < 0 || y < 0 || x >= lay.plotW || y >= lay.plotH) return null;
    const row = Math.floor(y / lay.rowH), col = Math.floor(x / lay.colW);
    const rank = lay.rankBase + row * lay.ranksPerRow, c = col * lay.stepsPerCol;
    const end = lay.rankBase + lay.nRows * lay.ranksPerRow;  // past the drawn ranks
    if (rank >= Math.min(end, state.matrix.world_size) || c >= state.matrix.steps.length) return null;
    return { rank, row,
             lastRank: Math.min(state.matrix.world_size, end, rank + lay.ranksPerRow) - 1,
             col: c, lastCol: Math.min(state.matrix.steps.length, c + lay.stepsPerCol) - 1 };
  }

  // Ranks flagged anywhere in the heatmap's window: kind -> Map(rank -> steps flagged). Outliers
  // are the collector's own (step_stats.outlier_ranks: above the threshold on consecutive steps),
  // not single steps whose score crossed it.
  function flaggedRanks() {
    const kinds = { missing: new Map(), nonfinite: new Map(), divergent: new Map(),
                    outlier: new Map(), drifting: new Map(), slow: new Map() };
    const bump = (m, r) => m.set(r, (m.get(r) || 0) + 1);
    const inWindow = new Set(state.matrix.steps.map((s) => s.step));
    for (const s of state.matrix.steps) {
      for (const r of s.missing) bump(kinds.missing, r);
      for (const r of s.nonfinite) bump(kinds.nonfinite, r);
      for (const r of s.divergent) bump(kinds.divergent, r);
    }
    for (const s of state.steps || []) {
      if (!inWindow.has(s.step)) continue;
      for (const r of s.outlier_ranks) bump(kinds.outlier, r);
      for (const r of s.drifting_ranks) bump(kinds.drifting, r);
      for (const r of s.slow_ranks) bump(kinds.slow, r);
    }
    return kinds;
  }

  // The cells' colours (r, g, b per cell, row-major nRows x nCols): each cell's worst.
  function heatCells(m, lay, metricName, scale) {
    const W = m.world_size, S = m.steps.length, nR = lay.nRows, nC = lay.nCols;
    const worst = METRICS[metricName].worst;
    const val = new Float64Array(nR * nC).fill(NaN);
    const mark = new Uint8Array(nR * nC);
    const present = new Uint8Array(nR * nC);  // some rank of the cell has a row
    for (let c = 0; c < S; c++) {
      const s = m.steps[c], vals = s[metricName], col = Math.floor(c / lay.stepsPerCol);
      for (let r = 0; r < W; r++) {
        const i = Math.floor(r / lay.ranksPerRow) * nC + col;
        const v = vals[r];
        present[i] = 1;
        if (v === null || v === undefined) continue;
        val[i] = isNaN(val[i]) ? v : worst(val[i], v);
      }
      for (const [kind, list] of [["missing", s.missing], ["divergent", s.divergent],
                                  ["nonfinite", s.nonfinite]]) {
        const code = MARK_CODE[kind];
        for (const r of list) {
          if (r >= W) continue;
          const i = Math.floor(r / lay.ranksPerRow) * nC + col;
          if (mark[i] < code) mark[i] = code;
        }
      }
    }
    const rgb = new Uint8ClampedArray(nR * nC * 3);
    for (let i = 0; i < nR * nC; i++) {
      let c;
      if (mark[i]) c = MARK_OF_CODE[mark[i]];
      else if (!isNaN(val[i])) {
        c = healthColor(scale.t(val[i]));
      } else c = present[i] ? MARK.novalue : MARK.missing;
      rgb[i * 3] = c[0]; rgb[i * 3 + 1] = c[1]; rgb[i * 3 + 2] = c[2];
    }
    return rgb;
  }

  // Steps whose rank rows retention downsampled are drawn from their rank_windows: one column
  // per window (each rank's lowest cosine, highest score), in place of the flagged rows kept.
  function withWindows(m) {
    if (!m.windows || !m.windows.length) return m;
    const before = m.downsampled_before;
    const cols = m.windows.map((w) => ({ step: w.first, last: Math.min(w.last, before - 1),
      cosine: w.cosine, outlier: w.outlier, missing: w.missing, nonfinite: w.nonfinite,
      divergent: w.divergent, downsampled: true }));
    return { ...m, steps: cols.concat(m.steps.filter((s) => s.step >= before)) };
  }

  // The matrix of ranks lo..hi only (a brushed band), ranks renumbered from 0.
  function bandMatrix(full, lo, hi) {
    const inBand = (r) => r >= lo && r <= hi;
    const local = (list) => list.filter(inBand).map((r) => r - lo);
    return { ...full, world_size: hi - lo + 1, steps: full.steps.map((s) => ({
      step: s.step, last: s.last, downsampled: s.downsampled,
      cosine: s.cosine.slice(lo, hi + 1), outlier: s.outlier.slice(lo, hi + 1),
      missing: local(s.missing), nonfinite: local(s.nonfinite), divergent: local(s.divergent) })) };
  }

  function drawHeatmap() {
    // A brushed band of ranks (state.band) is drawn alone, at one pixel row or more per rank;
    // the colour scale stays anchored to every rank's healthy median.
    const full = state.matrix;
    const band = state.band && state.band[0] < full.world_size
      ? [state.band[0], Math.min(state.band[1], full.world_size - 1)] : null;
    const base = band ? band[0] : 0;
    const m = band ? bandMatrix(full, band[0], band[1]) : full, W = m.world_size, S = m.steps.length;
    const lay = (state.layout = heatLayout(W, S));
    lay.rankBase = base;
    const scale = (state.scale = scaleFor(state.metric, full.steps));
    drawLegend($("legend"), { label: METRICS[state.metric].label, stops: HEALTH,
                              lo: scale.lo, hi: scale.hi });
    $("scale-info").textContent = scale.text;
    const canvas = $("heatmap");
    // Drawn at 1 CSS px = 1 canvas px into an ImageData: one write per pixel, no path per cell,
    // no smoothing.
    canvas.width = lay.cssW; canvas.height = lay.cssH;
    canvas.style.width = lay.cssW + "px"; canvas.style.height = lay.cssH + "px";
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.fillStyle = `rgb(${BACKGROUND.join(",")})`; ctx.fillRect(0, 0, canvas.width, canvas.height);
    const pw = lay.plotW, ph = lay.plotH, top = lay.top, x0 = lay.x0;
    if (!S) return;
    const rgb = heatCells(m, lay, state.metric, scale);
    const img = ctx.createImageData(pw, ph), px = img.data;
    for (let y = 0; y < ph; y++) {
      const row = Math.floor(y / lay.rowH);
      let p = y * pw * 4;
      for (let x = 0; x < pw; x++, p += 4) {
        const o = (row * lay.nCols + Math.floor(x / lay.colW)) * 3;
        px[p] = rgb[o]; px[p + 1] = rgb[o + 1]; px[p + 2] = rgb[o + 2]; px[p + 3] = 255;
      }
    }
    ctx.putImageData(img, x0, top);
    const kinds = flaggedRanks();
    const order = ["outlier", "divergent", "nonfinite", "missing", "drifting", "slow"];
    const flagged = new Map();
    for (const kind of order) {
      for (const [r, n] of kinds[kind]) {
        if (!flagged.has(r)) flagged.set(r, []);
        flagged.get(r).push([kind, n]);
      }
    }
    // Flagged rows thinner than 3 px are drawn again 3 px tall (over one pixel row on each
    // side), so a single deviating or silent rank of 512 or 4,096 reads at a glance; the
    // tooltip still gives each rank's own value.
    // Flagged ranks shown (in the band), by their row index in the drawing.
    const shown = [...flagged.keys()].filter((r) => r >= base && r < base + W);
    if (lay.rowH < 3 && shown.length <= 64) {
      const strip = ctx.createImageData(pw, 3), bp = strip.data;
      for (const r of shown) {
        const row = Math.floor((r - base) / lay.ranksPerRow), y = top + row * lay.rowH - lay.emphasis;
        for (let x = 0; x < pw; x++) {
          const o = (row * lay.nCols + Math.floor(x / lay.colW)) * 3;
          for (let k = 0; k < 3; k++) {
            const p = (k * pw + x) * 4;
            bp[p] = rgb[o]; bp[p + 1] = rgb[o + 1]; bp[p + 2] = rgb[o + 2]; bp[p + 3] = 255;
          }
        }
        // Clipped to the plot: the first and last rows keep their band inside it.
        const y0 = Math.max(top, Math.min(top + ph - 3, y));
        if (ph >= 3) ctx.putImageData(strip, x0, y0);
      }
    }
    // The centre of rank r's row (r absolute).
    const yOf = (r) => top + Math.floor((r - base) / lay.ranksPerRow) * lay.rowH + lay.rowH / 2;
    // Rank axis: a label every `step` ranks, and every flagged rank labelled in its mark's colour
    // (regular labels that would overlap one are left out).
    ctx.font = "11px system-ui, sans-serif"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
    const pxPerRank = lay.rowH / lay.ranksPerRow;
    const every = Math.max(1, Math.ceil(14 / pxPerRank));
    const step = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
      .find((k) => k >= every) || every;
    // More than 64 flagged ranks (a job mostly timing out) are ticked and listed, not labelled.
    const labelled = shown.length <= 64 ? shown : [];
    const flaggedY = labelled.map(yOf);
    ctx.fillStyle = "#1d232b";
    for (let r = base; r < base + W; r += step) {
      if (flaggedY.some((y) => Math.abs(y - yOf(r)) < 12)) continue;
      ctx.fillText("rank " + r, lay.gutter - 4, yOf(r));
    }
    ctx.font = "bold 11px system-ui, sans-serif";
    for (const r of labelled) {
      ctx.fillStyle = MARK_CSS[flagged.get(r)[0][0]];
      ctx.fillText(String(r), lay.gutter - 4, yOf(r));
    }
    ctx.font = "11px system-ui, sans-serif";
    // Step axis: labels at the centres of their columns.
    ctx.fillStyle = "#1d232b"; ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (let i = 0; i <= 5; i++) {
      const c = Math.min(S - 1, Math.round(((S - 1) * i) / 5));
      const col = Math.floor(c / lay.stepsPerCol);
      ctx.fillText(String(m.steps[c].step), x0 + col * lay.colW + lay.colW / 2, top + ph + 6);
    }
    // Flagged rows emphasised: a tick at least 4 px tall in the gutters on both sides of the
    // heatmap (so one rank of 4,096 shows), in its mark's colour, and a frame around the row.
    for (const r of shown) {
      ctx.fillStyle = MARK_CSS[flagged.get(r)[0][0]];
      const h = Math.max(4, lay.rowH), y = Math.round(yOf(r) - h / 2);
      ctx.fillRect(lay.gutter + 1, y, lay.marks - 3, h);
      ctx.fillRect(x0 + pw + 2, y, lay.marks - 3, h);
    }
    if (state.selectedRank !== null && state.selectedRank >= base &&
        state.selectedRank < base + W) {
      ctx.strokeStyle = "#0b5cad"; ctx.lineWidth = 1;
      const y = top + Math.floor((state.selectedRank - base) / lay.ranksPerRow) * lay.rowH;
      ctx.strokeRect(x0 - 1.5, y - 1.5, pw + 3, lay.rowH + 3);
    }
    state.flagged = {};
    for (const kind of order) state.flagged[kind] = [...kinds[kind].keys()].sort((a, b) => a - b);
    const ranks = [...flagged.keys()].sort((a, b) => a - b);
    $("flagged").replaceChildren(...(ranks.length ? ranks.slice(0, 500).map((r) => el("li", {
        "data-rank": String(r), "data-kinds": flagged.get(r).map((k) => k[0]).join(","),
        class: r === state.selectedRank ? "selected" : "", onclick: () => selectRank(r) },
      el("b", { text: "rank " + r + " " }),
      ...flagged.get(r).map(([kind, n]) => el("span", { class: "alert " + kind,
        text: (kind === "nonfinite" ? "non-finite" : kind) + " ×" + n })))) :
      [el("li", { class: "ok", text: "no rank flagged in this window" })]));
    const agg = [];
    if (lay.ranksPerRow > 1) agg.push(lay.ranksPerRow + " ranks per pixel row");
    if (lay.stepsPerCol > 1) agg.push(lay.stepsPerCol + " steps per pixel column");
    const req = m.requested, held = S ? [m.steps[0].step, m.steps[S - 1].step] : null;
    let where = state.view && !state.view.live ? "history (not following new steps)" : "live";
    if (held) where = "steps " + held[0] + "–" + held[1] + " · " + where;
    // Steps of the window without rank rows: pruned by retention (their downsampled
    // rank_windows are in `rankscope export --table=windows`), or not yet stepped.
    if (req && (!held || held[0] > req[0] + 1) && req[0] < (state.lastStep || 0)) {
      where += " · no per-rank rows before step " + (held ? held[0] : req[1] + 1) +
        " in this window (pruned by retention, or before the job's first step)";
    }
    const windows = m.steps.filter((s) => s.downsampled).length;
    if (windows) {
      where += " · steps before " + m.downsampled_before + ": " + windows + " downsampled rank " +
        "window" + (windows > 1 ? "s" : "") + " (retention pruned the per-step rows; one column " +
        "a window, each rank's worst)";
    }
    $("heat-window").textContent = where;
    $("heat-info").textContent = (band ? "ranks " + band[0] + "–" + band[1] + " of " +
                                  full.world_size : W + " ranks") + " × " + S + " steps" +
      (agg.length ? " (" + agg.join(", ") + ", each cell its worst)" : "") +
      (m.truncated ? " (truncated)" : "");
  }

  // Opens rank `rank`'s panel at `step` (undefined: the newest step whose buckets deviate, else
  // the newest step).
  async function selectRank(rank, step) {
    state.selectedRank = rank;
    state.selectedStep = step === undefined ? null : step;
    if (state.matrix) drawHeatmap();
    await loadRank(rank);
    $("rank-panel").scrollIntoView({ block: "nearest" });
  }

  async function loadRank(rank) {
    // The heatmap's window: the series reads that many steps of every rank's rows.
    const ms = state.matrix ? state.matrix.steps : [];
    const first = ms.length ? ms[0].step : 0;
    const last = ms.length ? ms[ms.length - 1].step : (state.lastStep || 0);
    const data = await api("/jobs/" + enc(state.key) + "/ranks?rank=" + rank + "&first=" + first +
                           "&last=" + last);
    state.rankSeries = data;
    const panel = $("rank-panel");
    if (!panel.dataset.rank || panel.dataset.rank !== String(rank)) {
      panel.dataset.rank = String(rank);
      panel.replaceChildren(el("h2", { text: "Rank " + rank, id: "rank-title" }),
        el("div", { id: "rank-buckets" }),
        el("div", { class: "charts" },
           chartBox("rank-loss", "loss of rank " + rank + " (blue) and the ranks' mean (grey)"),
           chartBox("rank-gn", "gradient norm of rank " + rank + " and the ranks' mean (grey)"),
           chartBox("rank-cos", "consensus cosine of rank " + rank),
           chartBox("rank-out", "outlier score of rank " + rank + " (threshold " + OUTLIER_THRESHOLD + ")")));
    }
    const st = data.steps, xs = st.map((s) => s.step);
    drawBuckets(data, rank);
    const mean = state.steps.filter((s) => s.step >= first);
    lineChart($("rank-loss"), [
      { xs: mean.map((s) => s.step), ys: mean.map((s) => s.loss_mean), color: "#9aa4ad" },
      { xs, ys: st.map((s) => s.loss), color: "#0b5cad" }]);
    lineChart($("rank-gn"), [
      { xs: mean.map((s) => s.step), ys: mean.map((s) => s.grad_norm_mean), color: "#9aa4ad" },
      { xs, ys: st.map((s) => s.grad_norm), color: "#e08a00" }]);
    lineChart($("rank-cos"), [{ xs, ys: st.map((s) => s.cosine), color: "#2e7d32" }]);
    lineChart($("rank-out"), [{ xs, ys: st.map((s) => s.outlier), color: "#c62828" }],
      { ymin: 0, ymax: OUTLIER_THRESHOLD });
  }

  // Where in the model, for the selected rank and step: each bucket's robust z against the other
  // ranks (kept for flagged rows and every 100th step) as a bar, the deviating ones (|z| >=
  // bucket_z_threshold) red, named and listed worst first. Steps with deviating buckets can be
  // stepped through (◀ ▶); a heatmap click picks the cell's step.
  function drawBuckets(data, rank) {
    const st = data.steps, box = $("rank-buckets");
    const flaggedSteps = st.filter((s) => (s.buckets && s.buckets.length) || s.deviating_buckets)
      .map((s) => s.step);
    let step = state.selectedStep;
    if (step === null || !st.some((s) => s.step === step)) {
      step = flaggedSteps.length ? flaggedSteps[flaggedSteps.length - 1]
        : (st.filter((s) => s.bucket_z).pop() || st[st.length - 1] || { step: null }).step;
    }
    state.bucketStep = step;
    const row = st.find((s) => s.step === step);
    const names = data.bucket_names || [], thr = data.bucket_z_threshold;
    const nameOf = (b) => (b < names.length ? names[b] : "bucket " + b);
    const prev = flaggedSteps.filter((s) => s < step).pop();
    const next = flaggedSteps.find((s) => s > step);
    const nav = (to, text) => el("button", to === undefined ? { disabled: "", text }
      : { text, onclick: () => { state.selectedStep = to; drawBuckets(data, rank); } });
    const head = el("div", { class: "title" },
      "Where in the model: rank " + rank + (step === null ? "" : " at step " + step) + "  ",
      nav(prev, "◀ earlier deviation"), nav(next, "later deviation ▶"));
    const out = [head];
    const deviating = row && row.buckets ? row.buckets : [];
    let summary;
    if (!row) {
      summary = "no row of this rank at this step";
    } else if (deviating.length) {
      summary = deviating.map((d) => d.name + " z=" + fmt(d.z, 1)).join(", ");
    } else if (row.deviating_buckets) {
      summary = row.deviating_buckets;  // stored text (its z were not kept)
    } else if (row.bucket_z) {
      summary = "no bucket deviates (every |z| < " + thr + ")";
    } else {
      summary = "per-bucket norms not kept at this step (kept for flagged rows and every 100th " +
        "step); " + (flaggedSteps.length ? "◀ ▶ go to the steps where buckets deviate"
                                          : "no step of this window names a deviating bucket");
    }
    out.push(el("p", { id: "rank-where", "data-step": String(step) },
      el("b", { text: deviating.length || (row && row.deviating_buckets) ? "deviating: " : "" }),
      summary));
    if (row && row.bucket_z) {
      // Worst first: the deviating ones (named by the API, NaN first), then the rest by |z|.
      const order = row.bucket_z.map((z, b) => b).sort((a, b) => {
        const za = row.bucket_z[a], zb = row.bucket_z[b];
        if (za === null || zb === null) return (za === null ? 0 : 1) - (zb === null ? 0 : 1);
        return Math.abs(zb) - Math.abs(za);
      });
      const top = Math.max(8, Math.abs(row.bucket_z[order[0]] ?? 0));
      const shown = order.slice(0, 16);
      out.push(el("ul", { id: "bucket-bars", class: "bucket-bars" }, ...shown.map((b) => {
        const z = row.bucket_z[b], bad = z === null || Math.abs(z) >= thr;
        const bar = el("i");
        // CSSOM, not a style attribute (the page's CSP allows no inline style).
        bar.style.width = (z === null ? 100 : Math.max(1, Math.round((100 * Math.abs(z)) / top))) + "%";
        return el("li", { class: bad ? "deviating" : "", "data-bucket": nameOf(b),
                          "data-z": z === null ? "nan" : String(z) },
          el("span", { class: "bucket-name", text: nameOf(b) }),
          el("span", { class: "bucket-bar" }, bar),
          el("span", { class: "bucket-z", text: "z=" + (z === null ? "nan" : fmt(z, 1)) }));
      })));
      if (order.length > shown.length) {
        out.push(el("p", { class: "muted", text: "+" + (order.length - shown.length) +
          " more buckets, each |z| at most " + fmt(Math.abs(row.bucket_z[order[16]]), 1) }));
      }
      out.push(el("p", { class: "muted", text: "robust z of each bucket's local gradient norm " +
        "against the other ranks' (|z| >= " + thr + " deviates)" +
        (names.length ? "" : "; bucket names come with the job's next hello") }));
    }
    box.replaceChildren(...out);
  }

  // ---- routing ---------------------------------------------------------------------------
  const path = location.pathname;
  if (path.startsWith("/job/")) {
    // /job/JOB?group=G, or the group key itself (/job/JOB%2FG).
    let job = decodeURIComponent(path.slice("/job/".length));
    let group = new URLSearchParams(location.search).get("group");
    if (job.includes("/")) [job, group] = [job.slice(0, job.indexOf("/")), job.slice(job.indexOf("/") + 1)];
    jobPage(job, group);
  } else {
    jobsPage();
  }
})();
