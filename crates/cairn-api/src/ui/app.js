// The lineage page `cairn serve` ships at /ui/: runs and sessions, a run's
// stages as a graph, and each stage's log, artifacts and snapshots. Plain
// JavaScript, no build step, nothing fetched from anywhere but this server.
// Every string from the server goes into the page as text, never as markup.

// A token given as /ui/#token=SECRET is kept for this tab and taken out of
// the address bar; requests then carry it as a bearer token (TCP listeners).
const TOKEN_KEY = "cairn-token";
{
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
}
const token = sessionStorage.getItem(TOKEN_KEY);
const headers = token ? { Authorization: `Bearer ${token}` } : {};

const ROW = 120; // px per stage row in the graph
const ITEM = 44; // px per run or session in the lists
const NODE_W = 190;
const GAP = 16;

const $ = (id) => document.getElementById(id);

/// An element with attributes and children (strings become text nodes).
function el(tag, attrs = {}, ...children) {
  const svg = ["svg", "line"].includes(tag);
  const e = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.setAttribute("class", v);
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "style") Object.assign(e.style, v);
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

/// Replaces a node's children, leaving out the absent ones.
function fill(node, ...children) {
  node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
}

function showError(message) {
  $("error").textContent = message || "";
}

async function api(path) {
  const resp = await fetch(path, { headers });
  if (!resp.ok) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body && body.error) message = body.error;
    } catch (_) {}
    throw new Error(`${path}: ${message}`);
  }
  return resp;
}

const json = async (path) => (await api(path)).json();

function ago(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ago`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
  return `${Math.floor(s / 86400)}d ago`;
}

function span(ms) {
  if (ms === null || ms === undefined || ms < 0) return "-";
  if (ms < 1000) return `${ms}ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(1)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s / 60) % 60)).padStart(2, "0")}m`;
}

const short = (id) => (id ? id.slice(0, 12) : "-");

/// A list that keeps only the rows in view in the page (any length).
class VirtualList {
  constructor(container, height, render) {
    this.container = container;
    this.height = height;
    this.render = render;
    this.items = [];
    this.spacer = container.querySelector(".spacer") || container.appendChild(el("div", { class: "spacer" }));
    this.layer = container.appendChild(el("div"));
    this.queued = false;
    container.addEventListener("scroll", () => this.schedule());
    window.addEventListener("resize", () => this.schedule());
  }
  set(items) {
    this.items = items;
    this.spacer.style.height = `${items.length * this.height}px`;
    this.draw();
  }
  schedule() {
    if (this.queued) return;
    this.queued = true;
    requestAnimationFrame(() => {
      this.queued = false;
      this.draw();
    });
  }
  draw() {
    const top = this.container.scrollTop;
    const first = Math.max(0, Math.floor(top / this.height) - 3);
    const last = Math.min(this.items.length, Math.ceil((top + this.container.clientHeight) / this.height) + 3);
    const rows = [];
    for (let i = first; i < last; i++) {
      const row = this.render(this.items[i], i);
      row.style.top = `${i * this.height}px`;
      rows.push(row);
    }
    this.layer.replaceChildren(...rows);
  }
}

// ---------------------------------------------------------------- lists

let current = null; // the run shown
let selected = null; // {stage, branch}
let detail = null; // the run's GET /v1/runs/{id}
let audit = null; // its GET /v1/runs/{id}/audit

const runList = new VirtualList($("runs"), ITEM, (r) => {
  const counts = Object.entries(r.stage_counts || {})
    .map(([k, n]) => `${n} ${k}`)
    .join(", ");
  const took = (r.ended_at || Date.now()) - r.created_at;
  return el(
    "div",
    {
      class: `item${r.id === current ? " current" : ""}`,
      "data-run": r.id,
      onclick: () => openRun(r.id),
    },
    el("div", {}, el("span", { class: `badge ${r.status}`, text: r.status }), " ", el("strong", { text: r.pipeline }), " ", el("span", { class: "muted", text: r.id })),
    el("div", { class: "sub", text: `${ago(r.created_at)} · took ${span(took)} · ${counts || "no stages yet"}` }),
  );
});

const sessionList = new VirtualList($("sessions"), ITEM, (s) =>
  el(
    "div",
    { class: "item", title: s.error || "", "data-session": s.id, onclick: () => openSession(s.id) },
    el("div", {}, el("span", { class: `badge ${s.state}`, text: s.state }), " ", el("strong", { text: s.name || s.id })),
    el("div", { class: "sub", text: `${ago(s.created_at)} · ${s.snapshot_id ? "snapshot " + short(s.snapshot_id) : "no snapshot yet"}` }),
  ),
);

async function loadLists() {
  try {
    const runs = [];
    let after = null;
    // Every page (the list is virtual, so any number fits).
    for (let n = 0; n < 1000; n++) {
      const page = await json(`/v1/runs?limit=1000${after ? `&after=${encodeURIComponent(after)}` : ""}`);
      runs.push(...page.items);
      if (!page.next) break;
      after = page.next;
    }
    runs.reverse(); // newest first
    $("run-count").textContent = `(${runs.length})`;
    runList.set(runs);
    const sessions = await json("/v1/sessions?limit=1000");
    const items = sessions.items || sessions;
    $("session-count").textContent = `(${items.length})`;
    sessionList.set(items);
    showError("");
  } catch (e) {
    showError(e.message);
  }
}

// ---------------------------------------------------------------- a run

/// The rows of the graph: one per stage in the order they ran; a branch
/// group's row holds its branches.
function layout(d) {
  const order = [];
  const byName = new Map();
  for (const s of d.stages) {
    if (!byName.has(s.stage)) {
      byName.set(s.stage, { name: s.stage, group: null, branches: [] });
      order.push(byName.get(s.stage));
    }
    const row = byName.get(s.stage);
    if (s.branch === "") row.group = s;
    else row.branches.push(s);
  }
  const events = new Map(); // "stage/branch" -> events
  for (const e of d.events) {
    if (!e.stage) continue;
    const key = `${e.stage}/${e.branch || ""}`;
    if (!events.has(key)) events.set(key, []);
    events.get(key).push(e);
  }
  for (const row of order) {
    const mine = events.get(`${row.name}/`) || [];
    const won = [...mine, ...row.branches.flatMap((b) => events.get(`${row.name}/${b.branch}`) || [])].filter((e) => e.kind === "won").pop();
    row.winner = won ? (won.data && won.data.branch) || won.branch : null;
    row.wonDetail = won ? won.detail : null;
    row.nodes = row.branches.length ? row.branches : [row.group];
  }
  return { rows: order, events };
}

function nodeClass(s, row) {
  const c = ["node", s.status];
  if (row.branches.length && row.winner) c.push(s.branch === row.winner ? "winner" : "loser");
  if (selected && selected.stage === s.stage && selected.branch === s.branch) c.push("selected");
  return c.join(" ");
}

function timeline(s, evs) {
  const start = s.started_at || (evs[0] && evs[0].created_at) || 0;
  const end = Math.max(s.ended_at || Date.now(), start + 1);
  const marks = evs
    .filter((e) => ["forked", "retry", "checkpoint", "failed", "dead", "completed", "won"].includes(e.kind))
    .map((e) => {
      const at = Math.min(1, Math.max(0, (e.created_at - start) / (end - start)));
      return el("div", { class: `mark ${e.kind}`, title: `${e.kind}: ${e.detail}`, style: { left: `calc(${(at * 100).toFixed(2)}% - 2px)` } });
    });
  return el("div", { class: "timeline" }, marks);
}

let graph = null;
let model = null;

function drawRow(row, i) {
  const n = row.nodes.length;
  const width = Math.max(n * (NODE_W + GAP) + GAP, $("dag").clientWidth);
  const center = width / 2;
  const left = center - (n * (NODE_W + GAP) - GAP) / 2;
  const svg = el("svg", { width, height: ROW });
  const nodes = row.nodes.map((s, j) => {
    const x = left + j * (NODE_W + GAP);
    // In from the row above, fanned out to each branch; out to the row below.
    svg.append(el("line", { x1: center, y1: 0, x2: x + NODE_W / 2, y2: 22 }));
    if (!row.branches.length || s.branch === row.winner) {
      svg.append(el("line", { x1: x + NODE_W / 2, y1: 106, x2: center, y2: ROW }));
    }
    const evs = model.events.get(`${s.stage}/${s.branch}`) || [];
    const lost = evs.filter((e) => e.kind === "lost").pop();
    const reason = s.branch === row.winner ? row.wonDetail : lost ? lost.detail : s.error || "";
    const tag = row.branches.length && row.winner ? (s.branch === row.winner ? "★ won" : "lost") : "";
    return el(
      "div",
      {
        class: nodeClass(s, row),
        "data-stage": s.stage,
        "data-branch": s.branch,
        title: reason,
        style: { left: `${x}px` },
        onclick: () => openStage(s.stage, s.branch),
      },
      el("div", { class: "name", text: `${audit && audit.recommendations.some((r) => r.stage === s.stage) ? "⚑ " : ""}${s.branch ? `${s.stage} [${s.branch}]` : s.stage}` }),
      el("div", { class: "meta", text: `${tag ? tag + " · " : ""}${s.status} · ${s.attempts} attempt(s)${s.metric !== null && s.metric !== undefined ? " · " + s.metric : ""}` }),
      el("div", { class: "meta", text: reason }),
      timeline(s, evs),
    );
  });
  return el("div", { class: "row", style: { width: `${width}px` }, "data-row": row.name }, svg, nodes);
}

async function openRun(id) {
  current = id;
  selected = null;
  location.hash = `#/run/${id}`;
  runList.draw();
  await refreshRun();
  fill($("detail"), el("p", { class: "muted", text: "Click a stage to see its log, artifacts and snapshots." }));
}

async function refreshRun() {
  if (!current) return;
  try {
    detail = await json(`/v1/runs/${encodeURIComponent(current)}`);
    audit = await json(`/v1/runs/${encodeURIComponent(current)}/audit`);
  } catch (e) {
    showError(e.message);
    return;
  }
  const r = detail.run;
  const counts = Object.entries(r.stage_counts || {})
    .map(([k, n]) => `${n} ${k}`)
    .join(", ");
  fill($("run-head"),
    el("span", { class: `badge ${r.status}`, text: r.status }),
    " ",
    el("strong", { text: `${r.pipeline}` }),
    ` · run ${r.id} · started ${ago(r.created_at)} · took ${span((r.ended_at || Date.now()) - r.created_at)} · ${counts}`,
    r.error ? el("div", { class: "error", text: r.error }) : null,
    audit.recommendations.length ? el("div", { class: "advice", text: `${audit.recommendations.length} piece(s) of advice: see the stages marked ⚑` }) : null,
  );
  model = layout(detail);
  if (!graph) graph = new VirtualList($("dag"), ROW, drawRow);
  graph.set(model.rows);
  if (selected) openStage(selected.stage, selected.branch, false);
}

function restoreLine(label, id) {
  if (!id) return null;
  return el("tr", {}, el("td", { text: label }), el("td", {}, el("code", { text: short(id) }), " ", el("code", { class: "restore", text: `cairn restore ${id}` })));
}

async function download(a) {
  try {
    const blob = await (await api(`/v1/artifacts/${encodeURIComponent(a.id)}`)).blob();
    const url = URL.createObjectURL(blob);
    const link = el("a", { href: url, download: a.path.split("/").pop() || "artifact" });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (e) {
    showError(e.message);
  }
}

async function openStage(stage, branch, scroll = true) {
  selected = { stage, branch };
  if (graph) graph.draw();
  const s = detail.stages.find((x) => x.stage === stage && x.branch === branch);
  if (!s) return;
  const evs = (model.events.get(`${stage}/${branch}`) || []).slice();
  const failure = evs
    .filter((e) => e.data && (e.data.type === "stage-failed" || e.data.type === "dead"))
    .map((e) => e.data.failure_snapshot)
    .filter(Boolean)
    .pop();
  const arts = detail.artifacts.filter((a) => a.stage === stage && a.branch === branch);
  const cost = audit && audit.stages.find((x) => x.stage === stage && x.branch === branch);
  const advice = audit ? audit.recommendations.filter((r) => r.stage === stage) : [];
  const row = (k, v) => el("tr", {}, el("td", { text: k }), el("td", { text: v }));
  const bytes = (b) => (b === null || b === undefined ? "-" : b >= 1 << 20 ? `${(b / (1 << 20)).toFixed(1)} MiB` : `${b} B`);
  const log = el("pre", { id: "log", text: "loading…" });
  fill($("detail"),
    el("h3", { text: branch ? `${stage} [${branch}]` : stage }),
    el("div", {}, el("span", { class: `badge ${s.status}`, text: s.status }), ` · ${s.attempts} attempt(s) · key ${s.stage_key}`),
    s.error ? el("div", { class: "error", text: s.error }) : null,
    cost
      ? el(
          "table",
          { id: "cost" },
          row("setup / compute", `${span(cost.setup_ms)} / ${span(cost.compute_ms)}`),
          row("restore / snapshot", `${span(cost.restore_ms)} / ${span(cost.snapshot_ms)}`),
          row("checkpoints", `${cost.checkpoints} · ${span(cost.checkpoint_ms)} · ${bytes(cost.checkpoint_bytes)}`),
          row("state / artifacts", `${bytes(cost.state_bytes)} / ${bytes(cost.artifact_bytes)}`),
          row("retries", `${cost.retries} · lost ${span(cost.lost_ms)} · saved ${span(cost.saved_ms)}`),
        )
      : null,
    advice.map((a) => el("p", { class: "advice", text: `⚑ ${a.advice}` })),
    el("h4", { text: "Snapshots" }),
    el("table", {}, restoreLine("input", s.input_snapshot), restoreLine("output", s.output_snapshot), restoreLine("failure", failure)),
    el("h4", { text: `Artifacts (${arts.length})` }),
    el("table", {}, arts.map((a) => el("tr", {}, el("td", { text: a.path }), el("td", { text: `${a.size_bytes} bytes` }), el("td", {}, el("button", { onclick: () => download(a), text: "download" }))))),
    el("h4", { text: "Log (tail)" }),
    log,
    el("h4", { text: "Events" }),
    el("table", {}, evs.map((e) => el("tr", { class: `event ${e.kind}` }, el("td", { text: e.kind }), el("td", { text: e.detail })))),
  );
  try {
    const q = branch ? `&branch=${encodeURIComponent(branch)}` : "";
    const text = await (await api(`/v1/runs/${encodeURIComponent(current)}/logs/${encodeURIComponent(stage)}?tail_bytes=65536${q}`)).text();
    log.textContent = text || "(empty)";
    if (scroll) log.scrollTop = log.scrollHeight;
  } catch (e) {
    log.textContent = e.message;
  }
}

// ---------------------------------------------------------------- a session

/// A session: its context log (the newest entries) beside the snapshots
/// its log records, each with the command that restores it.
async function openSession(id) {
  let s, page;
  try {
    s = await json(`/v1/sessions/${encodeURIComponent(id)}`);
    page = await json(`/v1/sessions/${encodeURIComponent(id)}/log?tail=200`);
  } catch (e) {
    showError(e.message);
    return;
  }
  const entries = page.entries || [];
  const clip = (t) => (t && t.length > 400 ? `${t.slice(0, 400)}…` : t || "");
  const log = el(
    "table",
    { id: "session-log" },
    entries.map((e) =>
      el(
        "tr",
        { class: `entry ${e.kind}` },
        el("td", { text: String(e.seq) }),
        el("td", { text: e.role || e.tool || e.kind }),
        el("td", { text: clip(e.content || e.result || (e.arguments ? JSON.stringify(e.arguments) : "")) }),
      ),
    ),
  );
  const snaps = entries.filter((e) => e.snapshot_id);
  const timeline = el(
    "table",
    { id: "session-snapshots" },
    snaps.map((e) =>
      el(
        "tr",
        {},
        el("td", { text: `#${e.seq} ${ago(e.created_at)}` }),
        el("td", {}, el("code", { class: "restore", text: `cairn restore ${e.snapshot_id}` })),
      ),
    ),
  );
  fill($("detail"),
    el("h3", { text: `session ${s.name || s.id}` }),
    el("div", {}, el("span", { class: `badge ${s.state}`, text: s.state }), ` · ${s.head_seq} entries · image ${s.image} · ${s.driver}`),
    s.error ? el("div", { class: "error", text: s.error }) : null,
    el(
      "div",
      { class: "beside" },
      el("div", {}, el("h4", { text: `Context log (last ${entries.length})` }), log),
      el("div", {}, el("h4", { text: `Snapshots (${snaps.length})` }), snaps.length ? timeline : el("p", { class: "muted", text: "none in these entries" })),
    ),
  );
}

// ---------------------------------------------------------------- live

function debounce(f, ms) {
  let t = null;
  return () => {
    clearTimeout(t);
    t = setTimeout(f, ms);
  };
}
const refreshListsSoon = debounce(loadLists, 400);
const refreshRunSoon = debounce(refreshRun, 300);

/// Server-sent events from /v1/events, read with fetch so the token can go
/// in a header; reconnects after a drop.
async function live() {
  for (;;) {
    try {
      const resp = await api("/v1/events");
      $("live").textContent = "live";
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const data = block
            .split("\n")
            .filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).trim())
            .join("\n");
          if (!data) continue;
          let ev;
          try {
            ev = JSON.parse(data);
          } catch (_) {
            continue;
          }
          if (String(ev.kind || "").startsWith("run.")) {
            refreshListsSoon();
            if (ev.id === current) refreshRunSoon();
          } else if (String(ev.kind || "").startsWith("session.")) {
            refreshListsSoon();
          }
        }
      }
    } catch (e) {
      showError(e.message);
    }
    $("live").textContent = "reconnecting…";
    await new Promise((r) => setTimeout(r, 2000));
  }
}

await loadLists();
const m = location.hash.match(/^#\/run\/([0-9a-f]+)/);
if (m) await openRun(m[1]);
live();
// Runs that the CLI or `cairn worker`s execute send this server no events:
// a run shown as running is read again every few seconds, the lists less often.
setInterval(() => {
  if (detail && detail.run.status === "running") refreshRunSoon();
}, 4000);
setInterval(refreshListsSoon, 15000);
