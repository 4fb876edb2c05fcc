// The requests table (admin keys): every queued and running request from GET /admin/requests, each
// with a Cancel button (DELETE /admin/requests/{id}). Only ids, tenants, key ids, models, routes, states,
// times and token counts are shown: the API never carries a prompt or a completion.
//
// Rows are kept by request id and updated in place, so the button a person clicks is never replaced
// under the pointer by the next round. The only DELETE is the button's own, on a click.

import { ApiError, errorOf, request } from "./api.js";
import { duration, showMessage } from "./format.js";

const COLUMNS = 10;
const rows = new Map(); // id -> { tr, cells, cancel }
const cancelling = new Set();

function refresh() {
  document.dispatchEvent(new CustomEvent("llamagate:refresh"));
}

async function cancel(id) {
  cancelling.add(id);
  const r = rows.get(id);
  if (r) {
    r.cancel.disabled = true;
    r.cancel.textContent = "Cancelling…";
  }
  try {
    const response = await request(`/admin/requests/${encodeURIComponent(id)}`, { method: "DELETE" });
    if (response.status === 404) {
      const err = await errorOf(response);
      showMessage("requests-message", `Request ${id} had already finished (${err.describe()}).`);
    } else if (!response.ok) {
      throw await errorOf(response);
    } else {
      showMessage("requests-message", `Request ${id} cancelled: its client gets an error saying so.`, false, true);
    }
  } catch (err) {
    const why = err instanceof ApiError ? err.describe() : String(err);
    showMessage("requests-message", `Cancelling request ${id} failed (${why}).`, true);
  } finally {
    cancelling.delete(id);
    refresh();
  }
}

function makeRow(id) {
  const tr = document.createElement("tr");
  tr.dataset.request = id;
  const cells = [];
  for (let i = 0; i < COLUMNS; i += 1) {
    const td = document.createElement("td");
    cells.push(td);
    tr.append(td);
  }
  cells[0].className = "mono";
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = "Cancel";
  button.addEventListener("click", () => cancel(id));
  cells[9].append(button);
  return { tr, cells, cancel: button };
}

const seconds = (s) => (s === null || s === undefined ? "–" : duration(s));

// ``result``: a settled GET /admin/requests (null: no admin key).
export function renderRequests(result) {
  const table = document.getElementById("requests");
  const note = document.getElementById("requests-note");
  if (!result || result.status !== "fulfilled") {
    table.hidden = true;
    note.hidden = false;
    const err = result && result.reason;
    if (!result) note.textContent = "Needs an admin key.";
    else if (err instanceof ApiError && err.status === 404) {
      note.textContent = `This daemon does not list requests (GET /admin/requests: ${err.describe()}).`;
    } else note.textContent = `Could not list the requests (${err instanceof ApiError ? err.describe() : err}).`;
    return;
  }
  const list = result.value.requests || [];
  const ids = list.map((q) => q.id);
  for (const id of [...rows.keys()]) if (!ids.includes(id)) rows.delete(id);
  for (const q of list) {
    if (!rows.has(q.id)) rows.set(q.id, makeRow(q.id));
    const r = rows.get(q.id);
    const values = [q.id, q.tenant, q.key_id, q.model, q.route, q.state, seconds(q.waited_s), seconds(q.running_s), q.tokens];
    values.forEach((v, i) => {
      r.cells[i].textContent = v === null || v === undefined || v === "" ? "–" : String(v);
    });
    r.cells[5].className = q.state === "running" ? "state ok" : "state warn";
    if (!cancelling.has(q.id)) {
      r.cancel.disabled = false;
      r.cancel.textContent = "Cancel";
    }
  }
  const body = document.getElementById("requests-body");
  const shown = [...body.rows].map((tr) => tr.dataset.request);
  if (shown.join("\n") !== ids.join("\n")) body.replaceChildren(...ids.map((id) => rows.get(id).tr));
  table.hidden = list.length === 0;
  note.hidden = list.length > 0;
  note.textContent = list.length ? "" : "No request is queued or running.";
}
