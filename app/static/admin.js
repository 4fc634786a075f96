// The operator view: GET /v1/admin/memory every REFRESH_MS (pool bars, sessions table with
// what the retention policy makes of each), /metrics for TTFT; PUT /v1/admin/sessions/{id}
// (budget, retention and policy), POST .../evict.
"use strict";

const REFRESH_MS = 2000;
const POLICIES = ["drop", "drop_oldest", "summarize", "none"]; // memory.history.POLICIES
const FIELDS = ["max_kv_tokens", "max_context_tokens", "history_policy", "max_summary_tokens",
  "high_watermark", "low_watermark", "max_tool_result_tokens", "retention_ttl_s",
  "retention_priority"];
const INTEGER_FIELDS = new Set(["max_kv_tokens", "max_context_tokens", "max_summary_tokens",
  "max_tool_result_tokens", "retention_priority"]);

const ui = {};
const admin = {
  sort: { key: "tokens", descending: true },
  sessions: [],
  editing: null, // conversation id in the editor
  previous: null, // the last sample of the counters the charts difference
  charts: {},
  started: performance.now(),
};

document.addEventListener("DOMContentLoaded", start);

async function start() {
  for (const id of ["key-screen", "app", "forget-key", "updated", "pool-numbers", "gpu-bar",
    "host-bar", "sessions", "no-sessions", "editor-section", "editor-title", "editor",
    "editor-close", "editor-message", "now-ttft", "now-kv", "now-hits"]) {
    ui[id.replace(/-(\w)/g, (_, c) => c.toUpperCase())] = document.getElementById(id);
  }
  ui.forgetKey.addEventListener("click", () => { kv.key = null; location.reload(); });
  for (const th of ui.sessions.querySelectorAll("th[data-key]")) {
    th.addEventListener("click", () => {
      const key = th.dataset.key;
      admin.sort = { key, descending: admin.sort.key === key ? !admin.sort.descending : true };
      renderSessions();
    });
  }
  const policy = document.getElementById("ed-history_policy");
  policy.append(el("option", { value: "" }, "(default)"),
    ...POLICIES.map((p) => el("option", { value: p }, p)));
  ui.editor.addEventListener("submit", (event) => { event.preventDefault(); saveEditor(); });
  ui.editorClose.addEventListener("click", closeEditor);
  admin.charts.ttft = new LineChart(document.getElementById("chart-ttft"), { unit: "ms" });
  admin.charts.kv = new LineChart(document.getElementById("chart-kv"),
    { unit: "%", max: 100, color: "#7b5cd6" });
  admin.charts.hits = new LineChart(document.getElementById("chart-hits"),
    { unit: "%", max: 100, color: "#1e8e3e" });

  await keyScreen(ui.keyScreen, ui.app, () => api("GET", "/v1/admin/memory"));
  await refresh();
  setInterval(refresh, REFRESH_MS);
}

async function refresh() {
  let memory, metrics;
  try {
    [memory, metrics] = await Promise.all([
      api("GET", "/v1/admin/memory"),
      fetch("/metrics").then((r) => (r.ok ? r.text() : "")),
    ]);
  } catch (e) {
    ui.updated.textContent = `refresh failed: ${e.message}`;
    return;
  }
  admin.sessions = memory.sessions;
  renderPool(memory);
  renderSessions();
  sampleCharts(memory, parsePrometheus(metrics));
  ui.updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
}

// -- pool ----------------------------------------------------------------------------------

function renderPool(memory) {
  const pool = memory.pool;
  const total = Math.max(1, pool.num_blocks);
  const pinned = pool.pinned_blocks;
  const inUse = Math.max(0, pool.used_blocks - pinned);
  const cached = Math.min(pool.cached_blocks || 0, pool.free_blocks);
  bar(ui.gpuBar, total, [["pinned", pinned], ["used", inUse], ["cached", cached]]);
  const host = memory.host_pool;
  bar(ui.hostBar, Math.max(1, host.num_blocks), [["host", host.used_blocks]]);
  const mib = (bytes) => `${formatNumber(bytes / 2 ** 20, 1)} MiB`;
  ui.poolNumbers.replaceChildren(
    el("span", {}, `GPU: ${formatNumber(pool.used_blocks)} / ${formatNumber(pool.num_blocks)} blocks used ` +
      `(${mib(pool.used_bytes)} of ${mib(pool.bytes)}), ${formatNumber(pinned)} pinned, ` +
      `${formatNumber(pool.free_blocks)} free`),
    el("span", {}, `host: ${formatNumber(host.used_blocks)} / ${formatNumber(host.num_blocks)} blocks`),
    el("span", {}, `block size ${pool.block_size} tokens · ${memory.kv_cache_dtype} · ` +
      `${formatNumber(memory.bytes_per_token)} B/token`),
    el("span", {}, `requests: ${memory.requests.running} running, ${memory.requests.waiting} waiting`),
    el("span", {}, `evictions: ${memory.evictions.offloads} offloads, ${memory.evictions.drops} drops`),
  );
}

function bar(node, total, segments) {
  node.replaceChildren(...segments.map(([kind, blocks]) => {
    const seg = el("div", { class: `seg ${kind}`, title: `${kind}: ${blocks} blocks`,
      dataset: { kind, blocks } });
    seg.style.width = `${(100 * blocks) / total}%`;
    return seg;
  }));
}

// -- sessions ------------------------------------------------------------------------------

function sortValue(session, key) {
  if (key === "max_kv_tokens" || key === "max_context_tokens") return session.budget[key] ?? -1;
  if (key === "next_turn_s") return session.next_turn_s ?? Infinity; // null: likely never
  return session[key];
}

function formatWait(seconds) {
  if (seconds === null || seconds === undefined) return "never?";
  if (seconds < 60) return `${formatNumber(seconds, seconds < 10 ? 1 : 0)} s`;
  if (seconds < 3600) return `${formatNumber(seconds / 60, 1)} min`;
  return `${formatNumber(seconds / 3600, 1)} h`;
}

function renderSessions() {
  const { key, descending } = admin.sort;
  const rows = [...admin.sessions].sort((a, b) => {
    const x = sortValue(a, key);
    const y = sortValue(b, key);
    const order = x < y ? -1 : x > y ? 1 : 0;
    return descending ? -order : order;
  });
  for (const th of ui.sessions.querySelectorAll("th[data-key]")) {
    th.classList.toggle("sorted-desc", th.dataset.key === key && descending);
    th.classList.toggle("sorted-asc", th.dataset.key === key && !descending);
  }
  ui.sessions.tBodies[0].replaceChildren(...rows.map(sessionRow));
  ui.noSessions.hidden = rows.length > 0;
}

function sessionRow(s) {
  const id = s.session_id;  // a conversation's id, or a stateless session's sess_...
  const evict = (offload) => async () => {
    await api("POST", `/v1/admin/sessions/${id}/evict?offload=${offload}`);
    await refresh();
  };
  return el("tr", { dataset: { id, state: s.state, tier: s.tier, class: s.class,
    held: String(s.held) } },
    el("td", { class: "id", title: id }, id),
    el("td", {}, el("span", { class: `state ${s.state}` }, s.state)),
    el("td", { class: "tier" }, s.tier),
    el("td", { class: "class" }, s.class),
    el("td", { class: "num next-turn", title: `value ${s.value.toExponential(2)} s/byte` },
      formatWait(s.next_turn_s)),
    el("td", { class: "held" }, s.held ? "held" : ""),
    el("td", { class: "num tokens" }, formatNumber(s.tokens)),
    el("td", { class: "num" }, formatNumber(s.device_blocks)),
    el("td", { class: "num" }, formatNumber(s.host_blocks)),
    el("td", { class: "num" }, formatNumber(s.turns)),
    el("td", { class: "num" }, s.idle_seconds == null ? "—" : `${formatNumber(s.idle_seconds, 0)} s`),
    el("td", { class: "num max-kv" }, formatNumber(s.budget.max_kv_tokens)),
    el("td", { class: "num" }, formatNumber(s.budget.max_context_tokens)),
    el("td", {},
      el("button", { class: "link edit", type: "button", onclick: () => openEditor(id) }, "Edit"),
      el("button", { class: "link offload", type: "button", disabled: s.state !== "resident",
        title: "Move its KV to the host pool", onclick: evict(true) }, "Offload"),
      el("button", { class: "link drop danger", type: "button",
        disabled: s.state === "empty" || s.state === "active",
        title: "Drop its KV (recomputed at its next turn)", onclick: evict(false) }, "Drop")));
}

// -- the editor ----------------------------------------------------------------------------

async function openEditor(id) {
  const session = await api("GET", `/v1/admin/sessions/${id}`);
  admin.editing = id;
  ui.editorTitle.textContent = id;
  for (const field of FIELDS) {
    const input = document.getElementById(`ed-${field}`);
    const value = session.settings[field];
    input.value = value === null || value === undefined ? "" : value;
    if (input.tagName === "INPUT") input.placeholder = String(session.effective[field] ?? "");
  }
  ui.editorMessage.textContent = "";
  ui.editorSection.hidden = false;
}

function closeEditor() {
  admin.editing = null;
  ui.editorSection.hidden = true;
}

async function saveEditor() {
  const body = {};
  for (const field of FIELDS) {
    const raw = document.getElementById(`ed-${field}`).value.trim();
    if (raw === "") body[field] = null;
    else if (field === "history_policy") body[field] = raw;
    else body[field] = INTEGER_FIELDS.has(field) ? parseInt(raw, 10) : parseFloat(raw);
  }
  try {
    const session = await api("PUT", `/v1/admin/sessions/${admin.editing}`, body);
    const e = session.effective;
    ui.editorMessage.className = "muted saved";
    ui.editorMessage.textContent = `Saved. Effective: max KV tokens ${formatNumber(e.max_kv_tokens)}, ` +
      `max context ${formatNumber(e.max_context_tokens)}, policy ${e.history_policy} ` +
      "(from the session's next turn).";
  } catch (err) {
    ui.editorMessage.className = "error";
    ui.editorMessage.textContent = err.param ? `${err.param}: ${err.message}` : err.message;
  }
  await refresh();
}

// -- charts --------------------------------------------------------------------------------

function sampleCharts(memory, metrics) {
  const t = (performance.now() - admin.started) / 1000;
  const sources = memory.prefill_sources;
  const sample = {
    ttftSum: metrics["kvchat:time_to_first_token_seconds_sum"] || 0,
    ttftCount: metrics["kvchat:time_to_first_token_seconds_count"] || 0,
    queries: memory.prefix_cache.queries,
    reused: sources.session + sources.prefix_cache + sources.host,
  };
  const before = admin.previous;
  admin.previous = sample;
  const usage = 100 * memory.pool.usage;
  admin.charts.kv.push(t, usage);
  ui.nowKv.textContent = `now ${formatNumber(usage, 1)}%`;
  if (!before) return;
  const count = sample.ttftCount - before.ttftCount;
  const ttft = count > 0 ? (1000 * (sample.ttftSum - before.ttftSum)) / count : null;
  admin.charts.ttft.push(t, ttft);
  if (ttft !== null) ui.nowTtft.textContent = `last ${formatNumber(ttft, 1)} ms (${count} replies)`;
  const queries = sample.queries - before.queries;
  const hits = queries > 0 ? (100 * (sample.reused - before.reused)) / queries : null;
  admin.charts.hits.push(t, hits);
  if (hits !== null) ui.nowHits.textContent = `last ${formatNumber(hits, 1)}% of ${queries} prompt tokens`;
}
