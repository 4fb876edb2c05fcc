// The status view: /readyz (public) every round, and with an admin key /admin/identity, /admin/load,
// /admin/usage (each tenant's tokens today, when the daemon has an accounts store), /admin/requests
// (the requests table), /admin/history (the charts) and /slots. One round at a time (see poller.js);
// each request gives up after api.js's timeout.
//
// Several models (/readyz lists more than one): one row per model (models.js), its slots from
// /admin/load's "models" and its state and load progress from /admin/models (admin) or /readyz's (else).
// No /slots then: /slots?model= of an unloaded model only answers 503, and nothing on this page may
// load a model (a GET never does; the only POSTs are the Load and Unload buttons', on a click).

import { ApiError, getJson, getKey, request } from "./api.js";
import { drawHistory, showCharts } from "./charts.js";
import { bytes, clock, duration, setText, showMessage, stateClass } from "./format.js";
import { nextSeq, progressText, renderModels } from "./models.js";
import { renderRequests } from "./requests.js";

// What the last round learned about the key: "none", "admin", "no-admin" or "refused".
export const keyState = { scope: "none", message: "" };

// Whether the last /readyz listed several models (then the round skips the default model's /slots).
let several = false;

async function readReadyz() {
  // 503 is an answer too: its body says why the child is not ready.
  const response = await request("/readyz", { auth: false });
  const body = await response.json();
  return { body, retryAfter: response.headers.get("Retry-After") };
}

function childMessage(r, retryAfter) {
  if (r.ready) return "";
  const reason = r.reason ? `: ${r.reason}` : "";
  if (r.reason && r.reason.startsWith("draining")) {
    return "The daemon is draining: it is stopping, finishes the requests in flight and takes no new ones.";
  }
  if (r.state === "FAILED") {
    return `llama-server FAILED${reason}. The supervisor gave up restarting it; see the daemon's log.`;
  }
  const retry = retryAfter ? ` Requests get 503; retry after ${retryAfter} s.` : "";
  return `Not ready (${r.state})${reason}.${retry}`;
}

function renderReady({ body: r, retryAfter }) {
  const state = setText("st-state", r.state);
  state.className = `state ${stateClass(r.state, r.ready)}`;
  setText("st-model", r.model);
  setText("st-reason", r.ready ? "ready" : r.reason);
  setText("st-uptime", duration(r.uptime_s));
  setText("st-ready-for", duration(r.ready_for_s));
  setText("st-restarts", r.restarts);
  setText("st-last-failure", r.last_failure || "none");
  // One model: its load progress here while it loads (several: in each model's row).
  const only = r.models && Object.keys(r.models).length === 1 ? Object.values(r.models)[0] : null;
  const loading = only && only.progress !== null && only.progress !== undefined && only.progress < 1;
  const bar = document.getElementById("st-load-bar");
  bar.hidden = !loading;
  if (loading) {
    bar.value = Math.floor(only.progress * 100);
    setText("st-load", `loading: ${progressText(only)}`);
  } else {
    setText("st-load", r.load_seconds === null || r.load_seconds === undefined ? null : `${r.load_seconds} s`);
  }
  setText("st-in-flight", r.in_flight);
  setText("st-queued", r.queued);
  setText("st-ctx", r.ctx_per_slot);
  return childMessage(r, retryAfter);
}

// Today's usage as /admin/usage reports it (UTC days, as `llamagate usage --by day`): since 00:00 UTC.
function usageToday() {
  const day = new Date().toISOString().slice(0, 10);
  return `/admin/usage?by=tenant&since=${day}`;
}

// ``usage``: /admin/usage's answer, or null without a store (then no tokens column).
function renderTenants(load, usage) {
  const body = document.getElementById("tenants-body");
  const tokens = new Map((usage ? usage.rows : []).map((r) => [r.tenant, r.total_tokens]));
  document.getElementById("tenants-tokens").hidden = !usage;
  const tenants = [...load.tenants];
  for (const name of tokens.keys()) {
    // A tenant with usage today but nothing in flight now, that the gate has not met since the start.
    if (!tenants.some((t) => t.name === name)) {
      tenants.push({ name, in_flight: 0, queued: 0, max_concurrency: null, max_queue: null });
    }
  }
  const rows = tenants.map((t) => {
    const tr = document.createElement("tr");
    // Several models: the counts are every model's together, and a tenant's limits apply per model.
    const cells = [
      t.name,
      several || t.max_concurrency === null ? t.in_flight : `${t.in_flight} / ${t.max_concurrency}`,
      several || t.max_queue === null ? t.queued : `${t.queued} / ${t.max_queue}`,
    ];
    if (usage) cells.push(tokens.get(t.name) ?? 0);
    for (const text of cells) {
      const td = document.createElement("td");
      td.textContent = String(text);
      tr.append(td);
    }
    return tr;
  });
  body.replaceChildren(...rows);
}

function renderIdentity(id) {
  const build = id.llama_cpp || {};
  const serving = id.serving || {};
  const model = id.model || {};
  const host = id.host || {};
  // An external binary has no receipt: no commit, only its source note and --version output.
  setText("id-commit", build.commit || build.source);
  setText("id-version", (build.version || "").split("\n").filter(Boolean).join(" · "));
  setText("id-binary-sha", (id.binary || {}).sha256);
  setText("id-model", model.path ? `${model.path} (${bytes(model.size_bytes)})` : null);
  setText("id-model-sha", model.sha256);
  setText("id-threads", `${serving.threads} (batch ${serving.threads_batch})`);
  setText("id-slots", serving.slots);
  setText("id-ctx", serving.ctx_per_slot);
  setText("id-host", `${host.cpu_model || "?"}, ${host.cpu_usable ?? "?"} CPUs, ${bytes(host.memory_total_bytes)}`);
}

function showModels() {
  document.getElementById("models").hidden = !several;
  document.getElementById("child-title").textContent = several ? "Daemon (every model)" : "Child";
  // /admin/identity's top level describes the default model (the first always one).
  document.getElementById("identity-title").textContent = several ? "Identity (default model)" : "Identity";
}

function showAdminParts(admin, note) {
  document.getElementById("tenants").hidden = !admin;
  document.getElementById("identity").hidden = !admin;
  showCharts(admin, note);
  for (const id of ["tenants-note", "identity-note"]) {
    const el = document.getElementById(id);
    el.hidden = admin;
    el.textContent = note;
  }
}

async function readAdmin() {
  try {
    const identity = await getJson("/admin/identity");
    keyState.scope = "admin";
    keyState.message = "";
    const seq = nextSeq();
    const [load, slots, usage, models, requests, history] = await Promise.allSettled([
      getJson("/admin/load"),
      several ? Promise.resolve(null) : getJson("/slots"),
      getJson(usageToday()),
      several ? getJson("/admin/models") : Promise.resolve(null),
      getJson("/admin/requests"),
      getJson("/admin/history"),
    ]);
    return { identity, load, slots, usage, models, requests, history, seq };
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    if (err.status === 401) {
      keyState.scope = "refused";
      keyState.message = `This key was refused (${err.status}: ${err.message}). Check it, or ask for a new one.`;
    } else if (err.status === 403) {
      keyState.scope = "no-admin";
      keyState.message = "This key has no admin scope: per-tenant load, slot detail and identity need an admin key.";
    } else {
      throw err;
    }
    return null;
  }
}

// One round; resolves true when the daemon answered.
export async function pollStatus() {
  const key = getKey();
  const [ready, admin] = await Promise.allSettled([readReadyz(), key ? readAdmin() : Promise.resolve(null)]);
  if (!key) {
    keyState.scope = "none";
    keyState.message = "";
  }
  let problem = "";
  let bad = false;
  if (ready.status === "fulfilled") {
    problem = renderReady(ready.value);
    bad = ready.value.body.state === "FAILED";
  } else {
    problem = `The daemon does not answer (${ready.reason}); trying again, less and less often.`;
    bad = true;
    setText("st-state", "unreachable").className = "state bad";
  }
  const a = admin.status === "fulfilled" ? admin.value : null;
  const load = a && a.load.status === "fulfilled" ? a.load.value : null;
  if (ready.status === "fulfilled") {
    const models = ready.value.body.models;
    several = Boolean(models) && Object.keys(models).length > 1;
    showModels();
    if (several) {
      const adminModels = a && a.models.status === "fulfilled" ? { models: a.models.value, seq: a.seq } : null;
      renderModels(models, load && load.models, a ? adminModels || { models: null, seq: a.seq } : null);
    }
  }
  if (a) {
    renderIdentity(a.identity);
    // Without a store, /admin/usage answers 404: the tokens column stays hidden.
    if (load) renderTenants(load, a.usage.status === "fulfilled" ? a.usage.value : null);
    renderRequests(a.requests);
    drawHistory(a.history);
    if (several) {
      // Every model's permits together (each model's own row is in the models table).
      setText("st-slots", load ? `${load.in_flight} / ${load.slots} (every model)` : null);
    } else if (a.slots.status === "fulfilled" && Array.isArray(a.slots.value)) {
      const busy = a.slots.value.filter((s) => s.is_processing).length;
      setText("st-slots", `${busy} / ${a.slots.value.length}`);
    } else {
      setText("st-slots", "– (llama-server is not running)");
    }
    showAdminParts(true, "");
  } else {
    if (ready.status === "fulfilled") {
      // Without an admin key, the proxy's own count: requests holding a slot permit.
      const r = ready.value.body;
      if (several) {
        const slots = Object.values(r.models).reduce((sum, m) => sum + m.slots, 0);
        setText("st-slots", `${r.in_flight} / ${slots} (every model)`);
      } else {
        setText("st-slots", `${r.in_flight} / ${r.slots}`);
      }
    }
    showAdminParts(false, keyState.scope === "no-admin" ? keyState.message : "Needs an admin key.");
    renderRequests(null);
  }
  if (keyState.scope === "refused") {
    problem = problem ? `${keyState.message} ${problem}` : keyState.message;
    bad = true;
  }
  showMessage("status-message", problem, bad);
  document.dispatchEvent(new CustomEvent("llamagate:key", { detail: { ...keyState } }));
  setText("st-updated", clock());
  return ready.status === "fulfilled" && admin.status === "fulfilled";
}
