// swarm-node dashboard: polls the JSON API under this page and draws tables and SVG curves.
// No framework, no build step, nothing from the internet. Rendered elements carry stable ids
// and data attributes (data-peer-row, data-chart, data-series, data-points) for tests.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2f6fde", "#e0622a", "#1b9e77", "#a23fc4", "#c9a100", "#d6336c", "#0f8fa8", "#6b7385", "#7a5c2e", "#3a3fbf"];
const PEER_COLUMNS = [
  // [header, cell text, css class]
  ["node", (r) => r.node_id.slice(0, 12), "text id"],
  ["name", (r) => r.display_name, "text"],
  ["reach", (r) => r.reachability || "-", "text"],
  ["device", (r) => r.device || "-", "text"],
  ["round", (r) => r.round],
  ["policy", (r) => r.policy_version],
  ["reward", (r) => fixed(r.reward_mean, 3)],
  ["accuracy", (r) => percent(r.accuracy)],
  ["published", (r) => r.rollouts_published],
  ["received", (r) => r.rollouts_received],
  ["accepted", (r) => r.rollouts_accepted],
  ["rejected", (r) => r.rollouts_rejected],
  ["averaged", (r) => `${r.outer_steps}/${r.outer_steps + r.outer_steps_skipped}`],
  ["tokens/s", (r) => fixed(r.tokens_per_s, 0)],
  ["up", (r) => `${fixed(r.uptime_s / 60, 1)}m`],
  ["rejoins", (r) => r.rejoins ?? 0],
  ["restarts", (r) => r.restarts ?? 0],
  ["seen", (r, now) => `${fixed(Math.max(0, now - r.last_seen), 0)}s ago`],
];
// Shown before "seen" only when some peer reports them (protocol 1.10, "idle" 1.11; a node whose generation overlaps
// its training, off by default), as `swarm-node peers` does: [header, cell text, css class, the field that says a row
// has it].
const OVERLAP_COLUMNS = [
  ["stale", (r) => (r.staleness_mean == null ? "-" : `${fixed(r.staleness_mean, 1)}/${r.staleness_max}`), "", "staleness_mean"],
  ["carried", (r) => (r.carried_in == null ? "-" : `${r.carried_in}/${r.carried_out}`), "", "carried_in"],
  ["waited", (r) => (r.ahead_wait_s == null ? "-" : `${fixed(r.ahead_wait_s, 1)}s`), "", "ahead_wait_s"],
  ["idle", (r) => (r.sampler_idle_s == null ? "-" : `${fixed(r.sampler_idle_s, 1)}s`), "", "sampler_idle_s"],
];
function peerColumns(peers) {
  const overlap = OVERLAP_COLUMNS.filter((c) => peers.some((r) => r[c[3]] != null));
  return [...PEER_COLUMNS.slice(0, -1), ...overlap, ...PEER_COLUMNS.slice(-1)];
}

// helpers -----------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fixed(x, digits) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }
function percent(x) { return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`; }
function clock(t) { return new Date(t * 1000).toLocaleTimeString([], { hour12: false }); }
function isCounts(value) { return value !== null && typeof value === "object" && !Array.isArray(value) && Object.values(value).every((v) => typeof v === "number"); }
function byDatasetKeys(rows) {
  const keys = new Set();
  for (const row of rows) for (const [key, value] of Object.entries(row)) if (key.endsWith("_by_dataset") && isCounts(value)) keys.add(key);
  return [...keys].sort();
}

const colours = new Map(); // node id or series name -> colour, stable while the page is open
function colour(key) {
  if (!colours.has(key)) colours.set(key, PALETTE[colours.size % PALETTE.length]);
  return colours.get(key);
}

function kvTable(entries, id) {
  if (!entries.length) return el("p", { class: "empty-note", id }, "none");
  const table = el("table", { id });
  for (const [key, value] of entries) table.append(el("tr", {}, el("th", { class: "text" }, key), el("td", {}, value)));
  return table;
}

function countsText(counts) {
  return Object.entries(counts).sort((a, b) => b[1] - a[1]).map(([reason, count]) => `${reason}=${count}`).join(", ");
}

// curves ------------------------------------------------------------------------------------

// series: [{name, colour, points: [[x, y], ...]}]; options: {xFormat, yFormat, yMin, yMax}
function lineChart(target, series, options = {}) {
  const W = 600, H = 240, left = 52, right = 12, top = 12, bottom = 44;
  target.replaceChildren();
  const all = series.flatMap((s) => s.points).filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y));
  target.dataset.points = String(all.length);
  target.dataset.series = String(series.filter((s) => s.points.length).length);
  if (!all.length) {
    target.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet"));
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let y0 = options.yMin ?? Math.min(...all.map((p) => p[1]));
  let y1 = options.yMax ?? Math.max(...all.map((p) => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (W - left - right);
  const sy = (y) => H - bottom - ((y - y0) / (y1 - y0)) * (H - top - bottom);
  const xFormat = options.xFormat ?? ((x) => String(Math.round(x)));
  const digits = Math.min(4, Math.max(0, 1 - Math.floor(Math.log10((y1 - y0) / 4))));
  const yFormat = options.yFormat ?? ((y) => y.toFixed(digits));
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (i / 4) * (y1 - y0);
    target.append(svg("line", { x1: left, x2: W - right, y1: sy(y), y2: sy(y), class: "grid" }));
    target.append(svg("text", { x: left - 6, y: sy(y) + 4, "text-anchor": "end" }, yFormat(y)));
    const x = x0 + (i / 4) * (x1 - x0);
    target.append(svg("text", { x: sx(x), y: H - bottom + 16, "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" }, xFormat(x)));
  }
  target.append(svg("line", { x1: left, x2: left, y1: top, y2: H - bottom, class: "axis" }));
  target.append(svg("line", { x1: left, x2: W - right, y1: H - bottom, y2: H - bottom, class: "axis" }));
  let legendX = left;
  for (const s of series) {
    const points = s.points.filter(([x, y]) => Number.isFinite(x) && Number.isFinite(y));
    if (!points.length) continue;
    const d = points.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
    target.append(svg("path", { d, class: "series", stroke: s.colour, "data-series": s.name, "data-points": points.length }));
    if (points.length === 1) target.append(svg("circle", { cx: sx(points[0][0]), cy: sy(points[0][1]), r: 3, fill: s.colour }));
    target.append(svg("rect", { x: legendX, y: H - 16, width: 10, height: 10, fill: s.colour }));
    const label = svg("text", { x: legendX + 14, y: H - 7 }, s.name);
    target.append(label);
    legendX += 24 + 7 * s.name.length;
  }
}

// sections ----------------------------------------------------------------------------------

function renderNodeInfo(swarm) {
  const node = swarm.node || {};
  const where = node.isolated ? "isolated" : `swarm ${node.swarm_id}`;
  const id = node.node_id ? ` ${node.node_id.slice(0, 12)}` : "";
  document.getElementById("node-info").textContent = node.viewer
    ? `viewer of swarm ${node.swarm_id}${node.state_dir ? ` · metrics of ${node.state_dir}` : " (no node of its own)"}`
    : `${node.name}${id} · ${where} · model ${node.model}`;
  document.getElementById("node-round").textContent = node.round !== undefined ? `round ${node.round}, policy version ${node.policy_version}` : "";
}

// The table shows at most this many rows (the server keeps the history of as many peers, sources.MAX_PEERS_KEPT):
// a browser table of thousands of rows is unreadable anyway; `swarm-node peers --json` lists them all.
const MAX_PEER_ROWS = 256;

function renderPeers(peers, now) {
  const datasetKeys = byDatasetKeys(peers);
  const columns = peerColumns(peers);
  const head = el("tr", {});
  for (const [name, , cls] of columns) head.append(el("th", { class: cls || "" }, name));
  for (const key of datasetKeys) head.append(el("th", { class: "text" }, key.replace(/_by_dataset$/, "")));
  document.getElementById("peer-head").replaceChildren(head);
  const body = document.getElementById("peer-rows");
  body.replaceChildren();
  for (const row of peers.slice(0, MAX_PEER_ROWS)) {
    const tr = el("tr", { "data-peer-row": "", "data-node-id": row.node_id });
    for (const [, cell, cls] of columns) tr.append(el("td", { class: cls || "" }, cell(row, now)));
    for (const key of datasetKeys) tr.append(el("td", { class: "text" }, Object.entries(row[key] || {}).map(([d, v]) => `${d} ${percent(v)}`).join(" · ")));
    tr.firstChild.style.borderLeft = `4px solid ${colour(row.node_id)}`;
    body.append(tr);
  }
  if (!peers.length) body.append(el("tr", {}, el("td", { class: "text empty-note", colspan: columns.length }, "no live peer seen yet")));
  document.getElementById("peer-count").textContent = peers.length > MAX_PEER_ROWS
    ? `${peers.length} live, the first ${MAX_PEER_ROWS} shown (curves: the ${MAX_PEER_ROWS} seen last); swarm-node peers --json lists all`
    : `${peers.length} live`;
  document.getElementById("peers-section").dataset.peerCount = String(peers.length);
}

// The mean of the last `window` points at each point: the trend a noisy per-round value hides.
function movingAverage(points, window) {
  return points.map(([x], i) => {
    const recent = points.slice(Math.max(0, i - window + 1), i + 1);
    return [x, recent.reduce((sum, p) => sum + p[1], 0) / recent.length];
  });
}

function renderNodeCurves(rows) {
  const reward = rows.map((r) => [r.round, r.reward_mean]);
  const accuracy = rows.map((r) => [r.round, r.accuracy]);
  lineChart(document.getElementById("chart-node-reward"), [
    { name: "reward_mean", colour: "#a9c1f0", points: reward },
    { name: "last 20 rounds", colour: PALETTE[0], points: movingAverage(reward, 20) },
  ]);
  lineChart(document.getElementById("chart-node-accuracy"), [
    { name: "accuracy", colour: "#a9c1f0", points: accuracy },
    { name: "last 20 rounds", colour: PALETTE[0], points: movingAverage(accuracy, 20) },
    { name: "heldout_accuracy", colour: PALETTE[1], points: rows.filter((r) => r.heldout_accuracy !== undefined).map((r) => [r.round, r.heldout_accuracy]) },
  ], { yMin: 0, yMax: 1, yFormat: (y) => `${Math.round(100 * y)}%` });
}

function renderPeerCurves(history, peers) {
  const names = new Map(peers.map((p) => [p.node_id, p.display_name]));
  const label = (id) => `${names.get(id) || "gone"} ${id.slice(0, 6)}`;
  const ids = Object.keys(history).sort();
  lineChart(document.getElementById("chart-peer-reward"),
    ids.map((id) => ({ name: label(id), colour: colour(id), points: history[id].map((p) => [p.time, p.reward_mean]) })), { xFormat: clock });
  lineChart(document.getElementById("chart-peer-accuracy"),
    ids.map((id) => ({ name: label(id), colour: colour(id), points: history[id].map((p) => [p.time, p.accuracy]) })), { xFormat: clock, yMin: 0, yMax: 1, yFormat: (y) => `${Math.round(100 * y)}%` });
}

// The overlap of generation with training (rollout.max_staleness, rollout.over_sample): its keys are in the rows only
// where it is on, and the section shows only then.
function renderOverlap(rows) {
  const has = (key) => rows.filter((r) => r[key] !== undefined && r[key] !== null);
  const section = document.getElementById("overlap-section");
  section.hidden = !["staleness_mean", "carried_in", "ahead_wait_s", "sampler_idle_s"].some((key) => has(key).length);
  if (section.hidden) return;
  const series = (key, colour) => ({ name: key, colour, points: has(key).map((r) => [r.round, r[key]]) });
  lineChart(document.getElementById("chart-node-staleness"), [series("staleness_mean", PALETTE[0]), series("staleness_max", PALETTE[1])]);
  lineChart(document.getElementById("chart-node-carried"), [series("carried_in", PALETTE[2]), series("carried_out", PALETTE[3])]);
  // both sides of the overlap's idle time, in the same seconds: the round waiting for the sampler, and the other way
  lineChart(document.getElementById("chart-node-ahead-wait"), [series("ahead_wait_s", PALETTE[4]), series("sampler_idle_s", PALETTE[5])], { yMin: 0 });
}

// Any `<metric>_by_dataset: {dataset: value}` field of the metrics rows: a chart per field, a curve per dataset.
function renderByDataset(rows) {
  const keys = byDatasetKeys(rows);
  const section = document.getElementById("by-dataset-section");
  section.hidden = keys.length === 0;
  const holder = document.getElementById("by-dataset-charts");
  holder.replaceChildren();
  for (const key of keys) {
    const datasets = [...new Set(rows.flatMap((r) => (isCounts(r[key]) ? Object.keys(r[key]) : [])))].sort();
    const chart = svg("svg", { viewBox: "0 0 600 240", id: `chart-${key}`, "data-chart": key });
    holder.append(el("figure", {}, el("figcaption", {}, key.replace(/_by_dataset$/, "") + " by dataset"), chart));
    const unit = rows.every((r) => !isCounts(r[key]) || Object.values(r[key]).every((v) => v >= 0 && v <= 1));
    lineChart(chart, datasets.map((d) => ({ name: d, colour: colour(`dataset:${d}`), points: rows.filter((r) => isCounts(r[key]) && d in r[key]).map((r) => [r.round, r[key][d]]) })),
      unit ? { yMin: 0, yMax: 1, yFormat: (y) => `${Math.round(100 * y)}%` } : {});
  }
}

// Refusal counters are rendered generically: every {reason: count} map in the totals, and every
// {peer: {reason: count}} map of the snapshot, so new kinds of refusals show up without a page change.
function renderRefusals(stats) {
  const totals = (stats && stats.totals) || {};
  const byReason = [];
  for (const [kind, counts] of Object.entries(totals)) if (isCounts(counts) && Object.keys(counts).length) byReason.push([kind, countsText(counts)]);
  document.getElementById("refusals-by-reason").replaceChildren(kvTable(byReason, "refusals-reason-table"));

  const rows = [];
  for (const [peer, counters] of Object.entries((stats && stats.peers) || {})) {
    if (counters.rejected && Object.keys(counters.rejected).length) rows.push([peer, "rollouts", counters.rejected]);
  }
  for (const [kind, perPeer] of Object.entries(stats || {})) {
    if (kind === "totals" || kind === "peers" || !perPeer || typeof perPeer !== "object") continue;
    for (const [peer, counts] of Object.entries(perPeer)) if (isCounts(counts) && Object.keys(counts).length) rows.push([peer, kind.replace(/_/g, " "), counts]);
  }
  const holder = document.getElementById("refusals-by-peer");
  if (!rows.length) {
    holder.replaceChildren(el("p", { class: "empty-note" }, "none"));
  } else {
    const table = el("table", { id: "refusals-peer-table" }, el("tr", {}, el("th", { class: "text" }, "peer"), el("th", { class: "text" }, "what"), el("th", { class: "text" }, "reasons")));
    for (const [peer, kind, counts] of rows.sort()) table.append(el("tr", { "data-refusal-row": "" }, el("td", { class: "text id" }, peer.slice(0, 12)), el("td", { class: "text" }, kind), el("td", { class: "text bad" }, countsText(counts))));
    holder.replaceChildren(table);
  }
  const scalars = Object.entries(totals).filter(([, v]) => typeof v === "number");
  document.getElementById("swarm-counters").replaceChildren(kvTable(scalars, "swarm-counters-table"));
}

function renderAveraging(averaging, rows) {
  const counters = averaging ? Object.entries(averaging).filter(([, v]) => typeof v !== "object" || v === null).map(([k, v]) => [k, typeof v === "number" && !Number.isInteger(v) ? v.toFixed(4) : v ?? "–"]) : [];
  if (averaging && isCounts(averaging.refusals) && Object.keys(averaging.refusals).length) counters.push(["refusals", countsText(averaging.refusals)]);
  document.getElementById("averaging-counters").replaceChildren(averaging ? kvTable(counters, "averaging-table") : el("p", { class: "empty-note" }, "averaging is off on this node (averaging.method: none)"));
  const steps = rows.filter((r) => r.outer_step).map((r) => [r.round, r.outer_step]);
  const holder = document.getElementById("averaging-outcomes");
  if (!steps.length) {
    holder.replaceChildren(el("p", { class: "empty-note" }, "no outer step yet"));
    return;
  }
  const outcomes = {};
  for (const [, step] of steps) outcomes[step.outcome] = (outcomes[step.outcome] || 0) + 1;
  const table = el("table", { id: "averaging-steps" }, el("tr", {}, ...["round", "outcome", "partners", "distance", "seconds"].map((h) => el("th", {}, h))));
  for (const [round, step] of steps.slice(-10).reverse()) {
    table.append(el("tr", {}, el("td", {}, round), el("td", { class: step.outcome === "averaged" ? "ok" : "bad" }, step.outcome),
      el("td", { class: "id" }, (step.partners || []).map((p) => p.slice(0, 8)).join(" ")), el("td", {}, fixed(step.distance, 4)), el("td", {}, fixed(step.seconds, 1))));
  }
  holder.replaceChildren(el("p", {}, countsText(outcomes)), table);
}

// The stage map hook: /api/stages lists one entry per pipeline (model), each with its stages'
// rows as `swarm-node peers --json --stages` prints them. Empty when no stage server runs.
function renderStages(pipelines) {
  const holder = document.getElementById("stages");
  document.getElementById("stages-section").dataset.pipelineCount = String(pipelines.length);
  if (!pipelines.length) {
    holder.replaceChildren(el("p", { class: "empty-note" }, "no pipeline stages in this swarm (stage servers of swarm-node serve appear here)"));
    return;
  }
  holder.replaceChildren();
  for (const pipeline of pipelines) {
    const table = el("table", { "data-pipeline": pipeline.model_fingerprint },
      el("tr", {}, ...["stage", "layers", "servers", "loading", "samples/s", "step", "grad norm", "recoveries"].map((h) => el("th", { class: h === "servers" || h === "loading" ? "text" : "" }, h))));
    for (const row of pipeline.stages) {
      table.append(el("tr", { "data-stage-row": "" }, el("td", {}, row.stage), el("td", {}, row.layers),
        el("td", { class: row.servers.length ? "text id" : "text bad" }, row.servers.map((s) => s.slice(0, 8)).join(" ") || "none"),
        el("td", { class: "text id" }, row.loading.map((s) => s.slice(0, 8)).join(" ")), el("td", {}, fixed(row.samples_per_s, 1)),
        el("td", {}, row.step), el("td", {}, fixed(row.grad_norm, 3)), el("td", {}, row.recoveries)));
    }
    holder.append(el("h3", {}, `model ${pipeline.model_fingerprint}: ${pipeline.num_stages} stages, ${pipeline.spares.length} spare(s)`), table);
  }
}

// polling -----------------------------------------------------------------------------------

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [peers, history, metrics, swarm, stages] = await Promise.all(["/api/peers", "/api/history", "/api/metrics", "/api/swarm", "/api/stages"].map(getJSON));
    const now = swarm.dashboard ? swarm.dashboard.now : Date.now() / 1000;
    renderNodeInfo(swarm);
    renderPeers(peers, now);
    renderNodeCurves(metrics);
    renderOverlap(metrics);
    renderPeerCurves(history, peers);
    renderByDataset(metrics);
    renderRefusals(swarm.stats);
    renderAveraging(swarm.averaging, metrics);
    renderStages(stages);
    const polled = swarm.dashboard && swarm.dashboard.last_poll ? `, swarm read ${fixed(now - swarm.dashboard.last_poll, 0)}s ago` : "";
    status.textContent = `updated ${clock(now)}${polled}`;
    status.dataset.state = "ok";
    document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
  } catch (error) {
    status.textContent = `cannot reach the node (${error.message}); retrying`;
    status.dataset.state = "error";
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

refresh();
