// The Miles run dashboard: polls the server's JSON endpoints every second and redraws SVG line
// charts from the rows of the run's metrics.jsonl. No library, no network beyond this server.
// Each chart's <svg> carries data-points (steps drawn; tokens drawn for a trace's charts) and
// each series' <path> data-key and data-points, so a test can read from the rendered page what
// was drawn; <body> carries data-trace-step (the traced step shown), data-trace-steps,
// data-trace-samples and data-trace-sample (the sample shown).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"];
const W = 420, H = 170, M = { l: 46, r: 8, t: 8, b: 20 };
const KEY = new URLSearchParams(location.hash.slice(1)).get("key");
const rows = [];
let next = 0, polls = 0;

// name: the figure's id; series: [key, label]; prefix: series found from the rows' keys
const CHARTS = {
  "panel-reward": [
    { name: "reward", title: "reward (mean, band: ±std)", series: [["reward/mean", "mean"]],
      band: ["reward/mean", "reward/std"] },
    { name: "reward_failure", title: "reward failure rate",
      series: [["reward/failure_rate", "failure rate"]] },
  ],
  "panel-eval": [
    { name: "accuracy", title: "held-out accuracy (bars: ±1 standard error)",
      series: [["eval/accuracy", "accuracy"]], errbars: true },
  ],
  "panel-time": [
    { name: "step_time", title: "seconds per step",
      series: [["time/rollout_s", "rollout"], ["time/train_s", "train"],
               ["time/sync_s", "sync"], ["trainer/wait_s", "trainer wait"],
               ["time/step_s", "step"]] },
  ],
  "panel-async": [
    { name: "queue", title: "buffer: queue size (groups)",
      series: [["buffer/size", "queued"], ["buffer/capacity", "capacity"]] },
    { name: "staleness", title: "staleness (weight versions)",
      series: [["staleness/consumed_mean", "consumed mean"],
               ["staleness/consumed_max", "consumed max"],
               ["staleness/queued_mean", "queued mean"], ["staleness/queued_max", "queued max"]] },
    { name: "drops", title: "groups dropped: all, and by reason (ledger)",
      series: [["ledger/dropped", "all"]], prefix: "ledger/dropped." },
    { name: "throughput", title: "tokens/s",
      series: [["rollout/tokens_per_s", "rollout"], ["trainer/tokens_per_s", "trainer"]] },
    { name: "fractions", title: "fractions of the step",
      series: [["rollout/idle_fraction", "rollout idle"],
               ["rollout/paused_fraction", "rollout paused"],
               ["trainer/idle_fraction", "trainer idle"]] },
  ],
  "panel-engines": [
    { name: "engines", title: "engines",
      series: [["engine/serving", "serving"], ["engine/restarts", "restarts"],
               ["engine/joined", "joined"], ["engine/left", "left"]] },
    { name: "weight_version", title: "weight version", series: [["weight_version", "version"]] },
  ],
};
const LATEST = {
  "async-latest": ["buffer/size", "buffer/capacity", "staleness/consumed_mean",
                   "staleness/consumed_max", "staleness/queued_mean", "staleness/queued_max",
                   "rollout/tokens_per_s", "trainer/tokens_per_s", "rollout/idle_fraction",
                   "rollout/paused_fraction", "trainer/idle_fraction"],
  "engines-latest": ["engine/serving", "engine/down", "engine/restarts", "engine/joined",
                     "engine/left", "rollout/groups_in_flight", "weight_version"],
};

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function fmt(v) {
  if (v === undefined || v === null) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return Number.isInteger(v) ? String(v) : v.toFixed(a >= 100 ? 1 : 3);
}

// The standard error of a held-out accuracy: the run's eval/stderr when it wrote one (several
// adapters' are combined there), else the binomial one from the accuracy and eval/n.
function stderrOf(row) {
  if (row["eval/stderr"] !== undefined) return row["eval/stderr"];
  const p = row["eval/accuracy"], n = row["eval/n"];
  return n > 0 ? Math.sqrt(Math.max(p * (1 - p), 0) / n) : 0;
}

function seriesOf(spec) {
  const fixed = spec.series || [];
  if (!spec.prefix) return fixed;
  const keys = new Set();
  for (const r of rows) for (const k in r) if (k.startsWith(spec.prefix)) keys.add(k);
  return [...fixed, ...[...keys].sort().map((k) => [k, k.slice(spec.prefix.length)])];
}

function extent(values, spec) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (lo === Infinity) return [0, 1];
  if (spec.name === "accuracy") { lo = Math.min(lo, 0); hi = Math.max(hi, 1); }
  if (lo > 0 && lo < hi * 0.5) lo = 0;
  if (hi === lo) { hi += 1; lo -= lo > 0 ? Math.min(1, lo) : 0; }
  return [lo, hi];
}

function draw(fig, spec) {
  const series = seriesOf(spec).map(([key, label]) => ({
    key, label, pts: rows.filter((r) => r[key] !== undefined).map((r) => [r.step, r[key], r]),
  }));
  const drawn = new Set();
  const values = [];
  for (const s of series) for (const [x, y, r] of s.pts) {
    drawn.add(x); values.push(y);
    if (spec.band && s.key === spec.band[0] && r[spec.band[1]] !== undefined) {
      values.push(y - r[spec.band[1]], y + r[spec.band[1]]);
    }
    if (spec.errbars) { const e = stderrOf(r); values.push(y - e, y + e); }
  }
  const svg = fig.querySelector("svg");
  svg.replaceChildren();
  svg.setAttribute("data-points", String(drawn.size));
  if (!drawn.size) {
    el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg)
      .textContent = "no data yet";
    fig.querySelector(".legend").replaceChildren();
    return;
  }
  const steps = [...drawn];
  const x0 = Math.min(...steps), x1 = Math.max(x0 + 1, ...steps);
  const [y0, y1] = extent(values, spec);
  const sx = (x) => M.l + ((x - x0) / (x1 - x0)) * (W - M.l - M.r);
  const sy = (y) => H - M.b - ((y - y0) / (y1 - y0)) * (H - M.t - M.b);
  el("line", { x1: M.l, y1: H - M.b, x2: W - M.r, y2: H - M.b, stroke: "#cbd2dc" }, svg);
  el("line", { x1: M.l, y1: M.t, x2: M.l, y2: H - M.b, stroke: "#cbd2dc" }, svg);
  el("text", { x: M.l - 4, y: M.t + 8, "text-anchor": "end" }, svg).textContent = fmt(y1);
  el("text", { x: M.l - 4, y: H - M.b, "text-anchor": "end" }, svg).textContent = fmt(y0);
  el("text", { x: M.l, y: H - 6 }, svg).textContent = `step ${x0}`;
  el("text", { x: W - M.r, y: H - 6, "text-anchor": "end" }, svg).textContent = `${x1}`;
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    if (spec.band && s.key === spec.band[0]) {
      const pts = s.pts.filter(([, , r]) => r[spec.band[1]] !== undefined);
      const up = pts.map(([x, y, r]) => `${sx(x)},${sy(y + r[spec.band[1]])}`);
      const down = pts.map(([x, y, r]) => `${sx(x)},${sy(y - r[spec.band[1]])}`).reverse();
      if (pts.length) {
        el("polygon", { points: [...up, ...down].join(" "), fill: color, opacity: 0.15,
                        "data-band": s.key, "data-points": pts.length }, svg);
      }
    }
    if (spec.errbars) {
      for (const [x, y, r] of s.pts) {
        const e = stderrOf(r);
        el("line", { x1: sx(x), x2: sx(x), y1: sy(y - e), y2: sy(y + e), stroke: color,
                     class: "errbar", "data-stderr": e.toFixed(5) }, svg);
      }
    }
    const d = s.pts.map(([x, y], j) => `${j ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`);
    el("path", { d: d.join(""), fill: "none", stroke: color, "stroke-width": 1.6,
                 "data-key": s.key, "data-points": s.pts.length }, svg);
    for (const [x, y] of s.pts.length <= 60 ? s.pts : []) {
      el("circle", { cx: sx(x), cy: sy(y), r: 2, fill: color }, svg);
    }
  });
  const legend = fig.querySelector(".legend");
  legend.replaceChildren(...series.map((s, i) => {
    const span = document.createElement("span");
    span.innerHTML = `<i style="background:${COLORS[i % COLORS.length]}"></i>`;
    const last = s.pts.length ? s.pts[s.pts.length - 1][1] : undefined;
    span.append(`${s.label} ${fmt(last)}`);
    return span;
  }));
}

function build() {
  for (const [panel, specs] of Object.entries(CHARTS)) {
    const root = document.getElementById(panel);
    for (const spec of specs) {
      const fig = document.createElement("figure");
      fig.id = `chart-${spec.name}`;
      fig.innerHTML = '<figcaption></figcaption><div class="legend"></div>';
      fig.querySelector("figcaption").textContent = spec.title;
      el("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, "data-chart": spec.name,
                  "data-points": 0 }, fig);
      root.appendChild(fig);
    }
  }
}

function table(id, pairs) {
  const t = document.getElementById(id);
  t.replaceChildren(...pairs.map(([k, v]) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th"), td = document.createElement("td");
    th.textContent = k; td.textContent = fmt(v); td.setAttribute("data-key", k);
    tr.append(th, td);
    return tr;
  }));
}

function latestOf(key) {
  for (let i = rows.length - 1; i >= 0; i--) if (rows[i][key] !== undefined) return rows[i][key];
  return undefined;
}

async function get(path) {
  const headers = KEY ? { Authorization: `Bearer ${KEY}` } : {};
  const res = await fetch(path, { headers, cache: "no-store" });
  if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
  return res.json();
}

async function pollMetrics() {
  let page;
  do {
    page = await get(`api/metrics?since=${next}`);
    if (page.total < next) { rows.length = 0; next = 0; continue; } // the file was replaced
    rows.push(...page.rows);
    next = page.next;
  } while (page.more);
  const body = document.body;
  body.dataset.rows = String(rows.length);
  body.dataset.malformed = String(page.malformed);
  const last = rows.length ? rows[rows.length - 1] : null;
  body.dataset.step = last ? String(last.step) : "";
  document.getElementById("status").textContent = !page.exists
    ? "waiting for metrics.jsonl"
    : `${rows.length} rows, step ${last ? last.step : "–"}` +
      (page.malformed ? `, ${page.malformed} malformed lines skipped` : "") +
      (last ? `, last ${new Date(last.time * 1000).toLocaleTimeString()}` : "");
}

async function pollLedger() {
  const led = await get("api/ledger");
  const pairs = Object.entries(led.latest).map(([k, v]) => [`${k} (step ${led.step})`, v]);
  if (led.file) pairs.push(...Object.entries(led.file).map(([k, v]) => [`${k} (ledger.json)`, v]));
  if (!pairs.length) pairs.push(["no ledger counts yet", null]);
  table("ledger", pairs);
}

async function pollRun() {
  const run = await get("api/run");
  const s = run.summary, r = s.run || {};
  document.getElementById("title").textContent = r.name ? `Miles run ${r.name}` : run.run_dir;
  const parts = [r.mode, r.placement, s.backend, s.engine, s.algorithm, s.transport]
    .filter(Boolean).join(" · ");
  document.getElementById("run-meta").textContent =
    `${parts}${r.steps ? ` · ${r.steps} steps` : ""}`;
  return run.exists;
}

let haveRun = false;
async function tick() {
  try {
    if (!haveRun || polls % 10 === 0) haveRun = await pollRun();
    await pollMetrics();
    await pollLedger();
    for (const [panel, specs] of Object.entries(CHARTS)) {
      for (const spec of specs) draw(document.getElementById(`chart-${spec.name}`), spec);
    }
    for (const [id, keys] of Object.entries(LATEST)) {
      table(id, keys.filter((k) => latestOf(k) !== undefined).map((k) => [k, latestOf(k)]));
    }
    if (Date.now() - trace.polled >= TRACE_POLL_MS) await pollTraces();
    document.getElementById("error").textContent = "";
  } catch (err) {
    document.getElementById("error").textContent = String(err.message || err);
  }
  polls += 1;
  document.body.dataset.polls = String(polls);
  setTimeout(tick, 1000);
}

// --- traces: the run's traces.jsonl, a step at a time -------------------------------------------
// Trace text is model and agent output: it enters the page as text nodes only (textContent,
// createTextNode), never as markup. The steps list is polled every TRACE_POLL_MS; a step's lines
// are fetched only when the step shown changes.
const TRACE_POLL_MS = 5000, TW = 860, TH = 170;
const trace = { polled: -Infinity, steps: [], follow: true, step: null, loaded: null, lines: [],
                row: 0 };

function html(name, text, cls) {
  const node = document.createElement(name);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

// Mean and max |lp_d| over the trained tokens (mask 1, lp_d not null); null when there is none.
function lpGap(line) {
  const d = line.lp_d || [], mask = line.mask || [];
  let sum = 0, max = 0, k = 0;
  d.forEach((v, i) => {
    if (v === null || mask[i] !== 1) return;
    const a = Math.abs(v);
    sum += a; max = Math.max(max, a); k += 1;
  });
  return k ? [sum / k, max] : [null, null];
}

async function pollTraces() {
  trace.polled = Date.now();
  const list = await get("api/traces");
  const select = document.getElementById("trace-step");
  if (list.steps.join(",") !== trace.steps.join(",")) {
    trace.steps = list.steps;
    const options = [html("option", "newest")];
    options[0].value = "";
    for (const s of [...list.steps].reverse()) {
      const o = html("option", `step ${s}`);
      o.value = String(s);
      options.push(o);
    }
    select.replaceChildren(...options);
  }
  if (trace.follow || !trace.steps.includes(trace.step)) {
    trace.step = trace.steps.length ? trace.steps[trace.steps.length - 1] : null;
  }
  select.value = trace.follow ? "" : String(trace.step);
  document.body.dataset.traceSteps = String(trace.steps.length);
  document.getElementById("trace-status").textContent = !list.exists
    ? "no traces.jsonl (the run config's traces section turns traces on)"
    : `${trace.steps.length} traced steps` +
      (list.malformed ? `, ${list.malformed} malformed lines skipped` : "");
  if (trace.step !== trace.loaded) await loadTraceStep();
}

async function loadTraceStep() {
  const step = trace.step;
  const got = step === null ? { lines: [], truncated: false }
    : await get(`api/traces?step=${step}`);
  trace.loaded = step;
  trace.lines = got.lines;
  trace.row = 0;
  document.body.dataset.traceStep = step === null ? "" : String(step);
  document.body.dataset.traceTruncated = String(got.truncated);
  drawTraceTable();
  drawTraceSample();
}

function drawTraceTable() {
  const t = document.getElementById("trace-samples");
  const head = document.createElement("tr");
  for (const h of ["group", "sample", "reward", "finish", "tokens", "mean |lp_d|",
                   "max |lp_d|", "turns"]) head.append(html("th", h));
  const rowsOut = trace.lines.map((line, i) => {
    const tr = document.createElement("tr");
    const kept = (line.ids || []).length;
    const [mean, max] = lpGap(line);
    const cells = [line.group, line.sample, fmt(line.reward), line.finish,
                   kept < line.n ? `${line.n} (${kept} kept)` : line.n, fmt(mean), fmt(max),
                   line.turns ? line.turns.length : "–"];
    tr.append(...cells.map((c) => html("td", c)));
    tr.dataset.sample = String(i);
    if (i === trace.row) tr.className = "selected";
    tr.addEventListener("click", () => { trace.row = i; drawTraceTable(); drawTraceSample(); });
    return tr;
  });
  t.replaceChildren(head, ...rowsOut);
  t.dataset.samples = String(trace.lines.length);
  document.body.dataset.traceSamples = String(trace.lines.length);
}

// One chart per token: series [key, label, values] (nulls skipped: the line breaks there).
function tokenChart(name, title, series, zero) {
  const fig = document.createElement("figure");
  fig.append(html("figcaption", title));
  const all = series.flatMap(([, , vs]) => vs.filter((v) => v !== null && v !== undefined));
  const n = Math.max(0, ...series.map(([, , vs]) => vs.length));
  const svg = el("svg", { width: TW, height: TH, viewBox: `0 0 ${TW} ${TH}`, "data-chart": name,
                          "data-points": 0 }, fig);
  const legend = html("div", null, "legend");
  fig.append(legend);
  if (!all.length) {
    el("text", { x: TW / 2, y: TH / 2, "text-anchor": "middle", class: "empty" }, svg)
      .textContent = "no values";
    return fig;
  }
  let y0 = Math.min(...all), y1 = Math.max(...all);
  if (zero) { y0 = Math.min(y0, 0); y1 = Math.max(y1, 0); }
  if (y1 === y0) { y1 += 1; y0 -= 1; }
  const sx = (i) => M.l + (n > 1 ? i / (n - 1) : 0.5) * (TW - M.l - M.r);
  const sy = (y) => TH - M.b - ((y - y0) / (y1 - y0)) * (TH - M.t - M.b);
  el("line", { x1: M.l, y1: TH - M.b, x2: TW - M.r, y2: TH - M.b, stroke: "#cbd2dc" }, svg);
  el("line", { x1: M.l, y1: M.t, x2: M.l, y2: TH - M.b, stroke: "#cbd2dc" }, svg);
  if (zero) {
    el("line", { x1: M.l, y1: sy(0), x2: TW - M.r, y2: sy(0), stroke: "#8a94a6",
                 "stroke-dasharray": "3,3", "data-zero": "1" }, svg);
  }
  el("text", { x: M.l - 4, y: M.t + 8, "text-anchor": "end" }, svg).textContent = fmt(y1);
  el("text", { x: M.l - 4, y: TH - M.b, "text-anchor": "end" }, svg).textContent = fmt(y0);
  el("text", { x: M.l, y: TH - 6 }, svg).textContent = "token 0";
  el("text", { x: TW - M.r, y: TH - 6, "text-anchor": "end" }, svg).textContent = `${n - 1}`;
  const drawn = new Set();
  series.forEach(([key, label, vs], k) => {
    const color = COLORS[k % COLORS.length];
    let d = "", gap = true, pts = 0;
    vs.forEach((v, i) => {
      if (v === null || v === undefined) { gap = true; return; }
      d += `${gap ? "M" : "L"}${sx(i).toFixed(1)},${sy(v).toFixed(1)}`;
      gap = false; pts += 1; drawn.add(i);
    });
    el("path", { d, fill: "none", stroke: color, "stroke-width": 1.2, "data-key": key,
                 "data-points": pts }, svg);
    const sw = html("i");
    sw.style.background = color;
    const span = html("span");
    span.append(sw, document.createTextNode(label));
    legend.append(span);
  });
  svg.setAttribute("data-points", String(drawn.size));
  return fig;
}

function versionRange(ver) {
  const v = (ver || []).filter((x) => x !== null && x >= 0);
  if (!v.length) return "–";
  const lo = Math.min(...v), hi = Math.max(...v);
  return lo === hi ? String(lo) : `${lo}–${hi}`;
}

function drawTraceSample() {
  const root = document.getElementById("trace-sample");
  const line = trace.lines[trace.row];
  document.body.dataset.traceSample = line ? String(trace.row) : "";
  if (!line) {
    root.replaceChildren(html("p", trace.step === null ? "no traced step yet" : "no samples",
                              "empty"));
    return;
  }
  const facts = [["group", line.group], ["sample", line.sample], ["reward", fmt(line.reward)],
                 ["finish", line.finish], ["weight versions", versionRange(line.ver)],
                 ["tokens", line.n]];
  if (line.adapter) facts.push(["adapter", line.adapter]);
  if (line.cut && (line.cut.tokens || line.cut.chars)) {
    facts.push(["cut", `${line.cut.tokens} tokens, ${line.cut.chars} characters`]);
  }
  if (line.dropped) facts.push(["samples dropped by the byte cap", line.dropped]);
  const info = html("table");
  for (const [k, v] of facts) {
    const tr = html("tr");
    tr.append(html("th", k), html("td", v));
    info.append(tr);
  }
  const parts = [info, html("h3", "prompt"), html("pre", line.prompt, "trace-text"),
                 html("h3", "response"), html("pre", line.response, "trace-text")];
  const charts = html("div", null, "charts");
  charts.append(
    tokenChart("trace_lp", "log-prob per token: engine (lp_e) and trainer (lp_t)",
               [["lp_e", "engine", line.lp_e || []], ["lp_t", "trainer", line.lp_t || []]]),
    tokenChart("trace_lp_d", "lp_d = lp_t - lp_e per trained token", [["lp_d", "lp_d",
               line.lp_d || []]], true));
  parts.push(charts);
  if (line.turn_rewards) {
    parts.push(html("h3", "turn rewards"), html("p", line.turn_rewards.map(fmt).join(", ")));
  }
  if (line.messages) {
    parts.push(html("h3", `messages (${line.turns ? line.turns.length : 0} turns)`));
    for (const m of line.messages) {
      const div = html("div", null, "message");
      div.append(html("b", `${m.role}: `), document.createTextNode(m.content || ""));
      if (m.tool_calls) div.append(html("pre", `tool calls: ${m.tool_calls}`, "trace-text"));
      parts.push(div);
    }
  }
  root.replaceChildren(...parts);
}

function buildTraces() {
  document.getElementById("trace-step").addEventListener("change", async (ev) => {
    const value = ev.target.value;
    trace.follow = value === "";
    trace.step = trace.follow ? (trace.steps.length ? trace.steps[trace.steps.length - 1] : null)
      : Number(value);
    try {
      if (trace.step !== trace.loaded) await loadTraceStep();
    } catch (err) {
      document.getElementById("error").textContent = String(err.message || err);
    }
  });
}

build();
buildTraces();
tick();
