// The models table of a several-model daemon: one row per model, its load progress, and (admin keys)
// its Load and Unload buttons.
//
// Rows are kept and updated in place (never rebuilt each round), so a button a person is about to
// click stays the same element. A model's figures come from /readyz's "models" (any key) and, for an
// admin key, /admin/models (state, progress, estimate) and /admin/load's "models" (slots). While a model
// loads, LoadWatch reads /admin/models every LOAD_POLL_MS so that the bar moves as the load does (a load
// of the demo model takes about a second); it stops once nothing loads.
//
// Nothing here loads or unloads a model by itself: the only POSTs are the buttons' own, on a click.

import { ApiError, errorOf, getJson, getKey, request } from "./api.js";
import { duration, showMessage, stateClass } from "./format.js";

const LOAD_POLL_MS = 250;
// After a load the page saw, the bar stays at 100 % this long, so the end of the load is seen.
const LOADED_SHOWN_MS = 5000;
const COLUMNS = 10;

const latest = { ready: null, admin: null, adminSeq: 0, gates: null, isAdmin: false };
const rows = new Map(); // name -> { tr, cells, bar, barText, load, unload, note }
const pending = new Map(); // name -> "load" | "unload": a button's request in flight
const loadedAt = new Map(); // name -> Date.now() when a load the page watched ended READY
const loading = new Set(); // names the page last saw loading
let requestSeq = 0;

// The word /v1/models uses for a supervisor state.
export function loadedWord(state) {
  if (state === "READY") return "loaded";
  if (state === "FAILED") return "failed";
  if (state === "UNLOADED" || state === "STOPPED") return "unloaded";
  return "loading";
}

const isLoading = (m) => m.state === "STARTING" || (m.progress !== null && m.progress !== undefined && m.progress < 1);

// "42 % · about 3 s left" from a row's progress and load_eta_s (null: not loading).
export function progressText(m) {
  if (m.progress === null || m.progress === undefined) return null;
  const pct = Math.floor(m.progress * 100);
  if (m.progress >= 1) return "100 % · loaded";
  const step = m.load_step && m.load_step !== "health" ? ` (${m.load_step} check)` : "";
  const eta =
    m.load_eta_s === null || m.load_eta_s === undefined
      ? "no estimate yet (first load of this file)"
      : `about ${duration(m.load_eta_s)} left`;
  return `${pct} %${step} · ${eta}`;
}

function refresh() {
  document.dispatchEvent(new CustomEvent("llamagate:refresh"));
}

async function act(name, action) {
  pending.set(name, action);
  render();
  if (action === "load") watch.start();
  const verb = action === "load" ? "Load" : "Unload";
  try {
    // Both answer once done: a load when the model is READY, an unload after draining its requests.
    const response = await request(`/admin/models/${encodeURIComponent(name)}/${action}`, {
      method: "POST",
      timeout: false,
    });
    if (!response.ok) throw await errorOf(response);
    const row = await response.json();
    showMessage("models-message", `${verb} of '${name}': done, ${loadedWord(row.state)} (${row.state}).`, false, true);
  } catch (err) {
    const why = err instanceof ApiError ? err.describe() : String(err);
    showMessage("models-message", `${verb} of '${name}' refused (${why}).`, true);
  } finally {
    pending.delete(name);
    render();
    refresh();
  }
}

function button(text, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.addEventListener("click", onClick);
  return b;
}

function makeRow(name) {
  const tr = document.createElement("tr");
  tr.dataset.model = name;
  const cells = [];
  for (let i = 0; i < COLUMNS; i += 1) {
    const td = document.createElement("td");
    cells.push(td);
    tr.append(td);
  }
  const bar = document.createElement("progress");
  bar.max = 100;
  bar.value = 0;
  const barText = document.createElement("span");
  barText.className = "progress-text";
  cells[8].append(bar, barText);
  const load = button("Load", () => act(name, "load"));
  const unload = button("Unload", () => act(name, "unload"));
  load.dataset.action = "load";
  unload.dataset.action = "unload";
  const note = document.createElement("span");
  note.className = "note";
  cells[9].className = "actions";
  cells[9].append(load, unload, note);
  return { tr, cells, bar, barText, load, unload, note };
}

function text(td, value, cls = "") {
  td.textContent = value === null || value === undefined || value === "" ? "–" : String(value);
  td.className = cls;
}

function renderProgress(r, name, m) {
  let shown = progressText(m);
  let value = m.progress;
  if (isLoading(m)) {
    loading.add(name);
    loadedAt.delete(name);
  } else if (loading.has(name)) {
    loading.delete(name);
    if (m.state === "READY") loadedAt.set(name, Date.now());
  }
  const since = loadedAt.get(name);
  if (!isLoading(m) && since !== undefined && Date.now() - since < LOADED_SHOWN_MS && m.state === "READY") {
    shown = "100 % · loaded";
    value = 1;
  } else if (!isLoading(m)) {
    shown = null;
  }
  r.bar.hidden = shown === null;
  if (shown !== null) r.bar.value = Math.floor(value * 100);
  r.barText.textContent = shown === null ? "–" : shown;
}

function renderActions(r, name, m) {
  const admin = latest.isAdmin;
  r.load.hidden = !admin || m.residency === "always";
  r.unload.hidden = !admin;
  const action = pending.get(name);
  r.load.textContent = action === "load" ? "Loading…" : "Load";
  r.unload.textContent = action === "unload" ? "Unloading…" : "Unload";
  r.load.disabled = Boolean(action) || m.state === "READY" || isLoading(m);
  const unloaded = m.state === "UNLOADED" || m.state === "STOPPED";
  if (m.residency === "always") {
    r.unload.disabled = true;
    r.unload.title = "residency 'always': the daemon keeps this model loaded; only on_demand models can be unloaded";
    r.note.textContent = admin ? "always loaded" : "";
  } else {
    r.unload.disabled = Boolean(action) || unloaded;
    r.unload.title = unloaded ? "not loaded" : "drain this model's requests, then stop its child";
    r.load.title = "load this model now (as its first request would)";
    r.note.textContent = "";
  }
  if (!admin) r.note.textContent = "–";
}

// One pass over every model with the latest figures.
function render() {
  const models = latest.ready;
  if (!models) return;
  const body = document.getElementById("models-body");
  const names = Object.keys(models);
  if (names.join("\n") !== [...rows.keys()].join("\n")) {
    for (const name of [...rows.keys()]) if (!names.includes(name)) rows.delete(name);
    for (const name of names) if (!rows.has(name)) rows.set(name, makeRow(name));
    body.replaceChildren(...names.map((n) => rows.get(n).tr));
  }
  for (const name of names) {
    const r = rows.get(name);
    // /admin/models is the freshest (LoadWatch reads it between rounds); /readyz has the rest.
    const m = { ...models[name], ...((latest.admin && latest.admin[name]) || {}) };
    const gate = (latest.gates && latest.gates[name]) || models[name];
    const others = (m.aliases || []).filter((a) => a !== name);
    // An on_demand model at rest is not a problem: no warning colour for it.
    const cls = m.state === "UNLOADED" ? "state" : `state ${stateClass(m.state, m.ready)}`;
    text(r.cells[0], name + (others.length ? ` (also ${others.join(", ")})` : ""));
    text(r.cells[1], `${loadedWord(m.state)} (${m.state})`, cls);
    text(r.cells[2], m.residency);
    text(r.cells[3], `${m.in_flight ?? gate.in_flight} / ${gate.slots}`);
    text(r.cells[4], m.queued ?? gate.queued);
    text(r.cells[5], models[name].restarts);
    text(r.cells[6], duration(models[name].uptime_s));
    text(r.cells[7], m.ready ? "" : m.reason);
    renderProgress(r, name, m);
    renderActions(r, name, m);
  }
}

// /admin/models as a map by name; ``seq``: when its request started (a later one wins).
function acceptAdmin(list, seq) {
  if (seq < latest.adminSeq) return;
  latest.adminSeq = seq;
  latest.admin = Object.fromEntries(list.models.map((m) => [m.name, m]));
}

export function nextSeq() {
  requestSeq += 1;
  return requestSeq;
}

// The round's figures. ``admin``: {models: /admin/models answer, seq} for an admin key, else null.
export function renderModels(models, gates, admin) {
  latest.ready = models;
  latest.gates = gates;
  latest.isAdmin = Boolean(admin);
  if (admin && admin.models) acceptAdmin(admin.models, admin.seq);
  if (!admin) latest.admin = null;
  render();
  if (admin && Object.values(latest.admin || {}).some(isLoading)) watch.start();
}

// Reads /admin/models every LOAD_POLL_MS while a model loads or a Load button waits; one at a time.
class LoadWatch {
  constructor() {
    this.running = false;
  }

  active() {
    if (!getKey() || !latest.isAdmin || document.hidden) return false;
    return [...pending.values()].includes("load") || Object.values(latest.admin || {}).some(isLoading);
  }

  async start() {
    if (this.running) return;
    this.running = true;
    document.body.dataset.loadWatch = "on";
    try {
      while (this.active()) {
        const seq = nextSeq();
        try {
          acceptAdmin(await getJson("/admin/models"), seq);
          render();
        } catch {
          // The next round says what is wrong (key, daemon); this only speeds up the bars.
          break;
        }
        await new Promise((resolve) => setTimeout(resolve, LOAD_POLL_MS));
      }
    } finally {
      this.running = false;
      document.body.dataset.loadWatch = "off";
    }
  }
}

const watch = new LoadWatch();
