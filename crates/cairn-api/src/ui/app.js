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

const ITEM = 44; // px per run or session in the lists
// The graph, in px: a layer of stages per ROW; in each, the connector bar
// (BUS_Y), where a branch group's edges fan out (FAN_Y), then the nodes.
const ROW = 132;
const BUS_Y = 6;
const FAN_Y = 18;
const NODE_TOP = 34;
const NODE_H = 84;
const NODE_W = 190;
const GAP = 16;

const $ = (id) => document.getElementById(id);

/// An element with attributes and children (strings become text nodes).
function el(tag, attrs = {}, ...children) {
  const svg = ["svg", "line", "path"].includes(tag);
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
      const e = body && body.error;
      if (typeof e === "string") message = e;
      else if (e && typeof e.message === "string") message = e.message;
      else if (e) message = JSON.stringify(e);
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

/// The graph of a run: one unit per stage (a branch group's holds its
/// branches side by side), in layers by the longest path from a root
/// (stages of one layer side by side), each placed under the stage whose
/// output it forks. The edges are the pipeline's (`graph`); a run whose
/// stored file no longer parses has none, and its stages follow each other
/// in the order they ran. Linear in the stages, but for sorting each layer.
function layout(d) {
  const rows = new Map(); // stage -> {group, branches}
  const ran = [];
  for (const s of d.stages) {
    let r = rows.get(s.stage);
    if (!r) {
      r = { group: null, branches: [] };
      rows.set(s.stage, r);
      ran.push(s.stage);
    }
    if (s.branch === "") r.group = s;
    else r.branches.push(s);
  }
  const events = new Map(); // "stage/branch" -> events
  for (const e of d.events) {
    if (!e.stage) continue;
    const key = `${e.stage}/${e.branch || ""}`;
    if (!events.has(key)) events.set(key, []);
    events.get(key).push(e);
  }
  const edges = d.graph || ran.map((stage, i) => ({ stage, after: i ? [ran[i - 1]] : [] }));
  const units = [];
  const byName = new Map();
  const add = (name, after) => {
    if (byName.has(name)) return;
    const u = { name, after, parents: [], children: [], kids: [] };
    byName.set(name, u);
    units.push(u);
  };
  for (const e of edges) add(e.stage, e.after);
  for (const name of ran) add(name, []); // rows the graph does not name
  for (const u of units) {
    const r = rows.get(u.name) || { group: null, branches: [] };
    u.group = r.group;
    u.branches = r.branches;
    const mine = events.get(`${u.name}/`) || [];
    const won = [...mine, ...u.branches.flatMap((b) => events.get(`${u.name}/${b.branch}`) || [])].filter((e) => e.kind === "won").pop();
    u.winner = won ? (won.data && won.data.branch) || won.branch : null;
    u.wonDetail = won ? won.detail : null;
    // A stage not started yet is drawn as what is to come.
    u.nodes = u.branches.length ? u.branches : [u.group || { stage: u.name, branch: "", status: "pending", attempts: 0, planned: true }];
    u.parents = u.after.map((a) => byName.get(a)).filter(Boolean);
    for (const p of u.parents) p.children.push(u);
  }
  // Parents first (Kahn's order); a stage left over (a cycle, which no
  // pipeline that parses has) is taken as a root.
  const waiting = new Map(units.map((u) => [u, u.parents.length]));
  const order = units.filter((u) => !u.parents.length);
  for (let i = 0; i < order.length; i++) {
    for (const c of order[i].children) {
      waiting.set(c, waiting.get(c) - 1);
      if (waiting.get(c) === 0) order.push(c);
    }
  }
  if (order.length < units.length) {
    const placed = new Set(order);
    for (const u of units) {
      if (!placed.has(u)) {
        u.parents = [];
        order.push(u);
      }
    }
  }
  let depth = 0;
  for (const u of order) {
    u.layer = 0;
    for (const p of u.parents) u.layer = Math.max(u.layer, p.layer + 1);
    depth = Math.max(depth, u.layer);
    if (u.parents.length) u.parents[0].kids.push(u); // placed under its first parent
  }
  // Widths up the tree, then places down it: each unit's span holds its
  // own nodes and, centred under them, its children's spans.
  const SLOT = NODE_W + GAP;
  for (let i = order.length - 1; i >= 0; i--) {
    const u = order[i];
    u.own = u.nodes.length * SLOT;
    u.kidsWidth = u.kids.reduce((w, k) => w + k.width, 0);
    u.width = Math.max(u.own, u.kidsWidth);
  }
  let width = 0;
  for (const u of order) {
    if (!u.parents.length) {
      u.x0 = width;
      width += u.width;
    }
  }
  const layers = Array.from({ length: units.length ? depth + 1 : 0 }, () => []);
  for (const u of order) {
    let x = u.x0 + (u.width - u.kidsWidth) / 2;
    for (const k of u.kids) {
      k.x0 = x;
      x += k.width;
    }
    u.center = u.x0 + u.width / 2;
    const left = u.center - u.own / 2 + GAP / 2;
    u.boxes = u.nodes.map((s, j) => ({ x: left + j * SLOT, s, unit: u }));
    for (const b of u.boxes) layers[u.layer].push(b);
    const winner = u.boxes.find((b) => u.branches.length && b.s.branch === u.winner);
    // Out from the winner, whose output the next stages fork.
    u.outX = (winner ? winner.x : u.boxes.length === 1 ? u.boxes[0].x : u.center - NODE_W / 2) + NODE_W / 2;
    u.inX = u.boxes.length === 1 ? u.boxes[0].x + NODE_W / 2 : u.center;
  }
  for (const l of layers) l.sort((a, b) => a.x - b.x);
  for (const u of order) {
    u.childMin = u.childMax = u.outX;
    for (const c of u.children) {
      u.childMin = Math.min(u.childMin, c.inX);
      u.childMax = Math.max(u.childMax, c.inX);
    }
  }
  return { units, layers, events, width, height: layers.length * ROW };
}

function nodeClass(s, u) {
  const c = ["node", s.status];
  if (u.branches.length && u.winner) c.push(s.branch === u.winner ? "winner" : "loser");
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

function drawNode(b, ox) {
  const { s, unit: u } = b;
  const evs = model.events.get(`${s.stage}/${s.branch}`) || [];
  const lost = evs.filter((e) => e.kind === "lost").pop();
  const reason = s.planned ? "not started" : s.branch && s.branch === u.winner ? u.wonDetail : lost ? lost.detail : s.error || "";
  const tag = u.branches.length && u.winner ? (s.branch === u.winner ? "★ won" : "lost") : "";
  const flag = audit && audit.recommendations.some((r) => r.stage === s.stage) ? "⚑ " : "";
  return el(
    "div",
    {
      class: nodeClass(s, u),
      "data-stage": s.stage,
      "data-branch": s.branch,
      "data-layer": u.layer,
      title: reason,
      style: { left: `${b.x + ox}px`, top: `${u.layer * ROW + NODE_TOP}px` },
      onclick: () => openStage(s.stage, s.branch),
    },
    el("div", { class: "name", text: `${flag}${s.branch ? `${s.stage} [${s.branch}]` : s.stage}` }),
    el("div", { class: "meta", text: s.planned ? `not started · after ${u.after.join(", ") || "the pipeline's input"}` : `${tag ? tag + " · " : ""}${s.status} · ${s.attempts} attempt(s)${s.metric !== null && s.metric !== undefined ? " · " + s.metric : ""}` }),
    el("div", { class: "meta", text: s.planned ? "" : reason }),
    s.planned ? null : timeline(s, evs),
  );
}

/// The graph, drawing only the nodes in view (and the edges into them)
/// however many stages and layers the run has.
class DagView {
  constructor(container) {
    this.container = container;
    this.spacer = container.querySelector(".spacer");
    this.layer = container.appendChild(el("div"));
    this.model = null;
    this.queued = false;
    container.addEventListener("scroll", () => this.schedule());
    window.addEventListener("resize", () => this.schedule());
  }
  set(m) {
    this.model = m;
    this.spacer.style.width = `${m.width}px`;
    this.spacer.style.height = `${m.height}px`;
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
  /// Back to the top, the first stage in the middle of the view.
  home() {
    const root = this.model && this.model.units.find((u) => !u.parents.length);
    const c = this.container;
    c.scrollTop = 0;
    c.scrollLeft = root ? Math.max(0, root.center - c.clientWidth / 2) : 0;
    this.draw();
  }
  draw() {
    const m = this.model;
    if (!m) return;
    const c = this.container;
    // Narrower than the view: centred in it.
    const ox = Math.max(0, (c.clientWidth - m.width) / 2);
    const left = c.scrollLeft - ox - NODE_W;
    const right = c.scrollLeft - ox + c.clientWidth + NODE_W;
    const first = Math.max(0, Math.floor(c.scrollTop / ROW) - 1);
    const last = Math.min(m.layers.length - 1, Math.floor((c.scrollTop + c.clientHeight) / ROW) + 1);
    const nodes = [];
    const shown = new Set();
    for (let l = first; l <= last; l++) {
      const boxes = m.layers[l];
      let lo = 0;
      let hi = boxes.length;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (boxes[mid].x + NODE_W < left) lo = mid + 1;
        else hi = mid;
      }
      for (let i = lo; i < boxes.length && boxes[i].x <= right; i++) {
        nodes.push(drawNode(boxes[i], ox));
        shown.add(boxes[i].unit);
      }
    }
    // The edges, in the graph's own coordinates, within a box around the view.
    const vx = left - NODE_W;
    const vw = right - left + 2 * NODE_W;
    const vy = first * ROW;
    const vh = (last - first + 1) * ROW;
    const clip = (x) => Math.min(Math.max(x, vx), vx + vw);
    const svg = el("svg", { width: Math.max(vw, 1), height: Math.max(vh, 1), viewBox: `${vx} ${vy} ${Math.max(vw, 1)} ${Math.max(vh, 1)}`, class: "edges", style: { left: `${vx + ox}px`, top: `${vy}px` } });
    for (const u of shown) {
      const top = u.layer * ROW;
      const fanned = u.boxes.length > 1;
      for (const p of u.parents) {
        const from = `${p.outX},${p.layer * ROW + NODE_TOP + NODE_H}`;
        const to = fanned ? top + FAN_Y : top + NODE_TOP;
        svg.append(el("path", { class: "edge", "data-from": p.name, "data-to": u.name, d: `M${from} V${top + BUS_Y} H${u.inX} V${to}` }));
      }
      if (fanned) {
        for (const b of u.boxes) {
          svg.append(el("line", { class: "fan", x1: u.center, y1: top + FAN_Y, x2: b.x + NODE_W / 2, y2: top + NODE_TOP }));
        }
      }
      // Down to the bar its children hang from, which may reach out of view.
      if (u.children.length) {
        const bar = (u.layer + 1) * ROW + BUS_Y;
        svg.append(el("path", { class: "bus", "data-from": u.name, d: `M${u.outX},${top + NODE_TOP + NODE_H} V${bar} M${clip(u.childMin)},${bar} H${clip(u.childMax)}` }));
      }
    }
    this.layer.replaceChildren(svg, ...nodes);
  }
}

async function openRun(id) {
  current = id;
  selected = null;
  location.hash = `#/run/${id}`;
  runList.draw();
  await refreshRun();
  if (graph) graph.home();
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
  if (!graph) graph = new DagView($("dag"));
  graph.set(model);
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
  if (!s) {
    fill($("detail"), el("h3", { text: stage }), el("p", { class: "muted", text: "This stage has not started yet." }));
    return;
  }
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

/// Entries a read of a session's log asks for.
const LOG_PAGE = 200;

/// A session: its context log (the newest entries, and older ones a page
/// at a time) beside the snapshots its log records, each with the command
/// that restores it.
async function openSession(id) {
  let s, page;
  const path = `/v1/sessions/${encodeURIComponent(id)}`;
  try {
    s = await json(path);
    page = await json(`${path}/log?tail=${LOG_PAGE}`);
  } catch (e) {
    showError(e.message);
    return;
  }
  const shown = { entries: page.entries || [], prev: page.prev };
  const clip = (t) => (t && t.length > 400 ? `${t.slice(0, 400)}…` : t || "");
  const log = el("table", { id: "session-log" });
  const timeline = el("table", { id: "session-snapshots" });
  const logHead = el("h4");
  const snapHead = el("h4");
  const none = el("p", { class: "muted", text: "none in these entries" });
  const older = el("button", { id: "session-older", text: "older entries", onclick: () => loadOlder() });
  const render = () => {
    const entries = shown.entries;
    fill(log, entries.map((e) =>
      el(
        "tr",
        { class: `entry ${e.kind}`, "data-seq": e.seq },
        el("td", { text: String(e.seq) }),
        el("td", { text: e.role || e.tool || e.kind }),
        el("td", { text: clip(e.content || e.result || (e.arguments ? JSON.stringify(e.arguments) : "")) }),
      ),
    ));
    const snaps = entries.filter((e) => e.snapshot_id);
    fill(timeline, snaps.map((e) =>
      el(
        "tr",
        {},
        el("td", { text: `#${e.seq} ${ago(e.created_at)}` }),
        el("td", {}, el("code", { class: "restore", text: `cairn restore ${e.snapshot_id}` })),
      ),
    ));
    logHead.textContent = shown.prev ? `Context log (last ${entries.length})` : `Context log (all ${entries.length})`;
    snapHead.textContent = `Snapshots (${snaps.length})`;
    none.hidden = snaps.length > 0;
    older.hidden = !shown.prev;
  };
  // The page before the oldest entry shown, put above it.
  const loadOlder = async () => {
    if (!shown.prev || older.disabled) return;
    older.disabled = true;
    try {
      const before = await json(`${path}/log?before=${shown.prev}&limit=${LOG_PAGE}`);
      shown.entries = [...(before.entries || []), ...shown.entries];
      shown.prev = before.prev;
      render();
    } catch (e) {
      showError(e.message);
    } finally {
      older.disabled = false;
    }
  };
  render();
  fill($("detail"),
    el("h3", { text: `session ${s.name || s.id}` }),
    el("div", {}, el("span", { class: `badge ${s.state}`, text: s.state }), ` · head at entry ${s.head_seq} · image ${s.image} · ${s.driver}`),
    s.error ? el("div", { class: "error", text: s.error }) : null,
    el(
      "div",
      { class: "beside" },
      el("div", {}, logHead, older, log),
      el("div", {}, snapHead, timeline, none),
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
// A run named in the address (#/run/ID, as openRun writes it): the whole
// id up to the next separator, not only its hex digits.
const m = location.hash.match(/^#\/run\/([^/?#&]+)/);
if (m) await openRun(decodeURIComponent(m[1]));
live();
// Runs that the CLI or `cairn worker`s execute send this server no events:
// a run shown as running is read again every few seconds, the lists less often.
setInterval(() => {
  if (detail && detail.run.status === "running") refreshRunSoon();
}, 4000);
setInterval(refreshListsSoon, 15000);
