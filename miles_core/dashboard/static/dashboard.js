// The Miles run dashboard: polls the server's JSON endpoints every second and redraws SVG line
// charts from the rows of the run's metrics.jsonl. No library, no network beyond this server.
// Each chart's <svg> carries data-points (steps drawn) and each series' <path> data-key and
// data-points, so a test can read from the rendered page what was drawn.
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
    document.getElementById("error").textContent = "";
  } catch (err) {
    document.getElementById("error").textContent = String(err.message || err);
  }
  polls += 1;
  document.body.dataset.polls = String(polls);
  setTimeout(tick, 1000);
}

build();
tick();
