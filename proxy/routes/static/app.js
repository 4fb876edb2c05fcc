// Wiring: the key form, the tabs, the status poller and the playground.

import { forgetKey, getKey, keyId, setKey } from "./api.js";
import { loadModels, setupPlayground } from "./playground.js";
import { Poller } from "./poller.js";
import { keyState, pollStatus } from "./status.js";

const $ = (id) => document.getElementById(id);

const poller = new Poller(pollStatus);

function describeKey(state) {
  const el = $("key-status");
  const key = getKey();
  el.classList.remove("ok", "bad");
  if (!key) {
    el.textContent = "No key entered: only the public readiness is shown.";
    return;
  }
  const id = keyId(key);
  const who = id ? `Key ${id}` : "This key";
  if (state.scope === "refused") {
    el.textContent = state.message;
    el.classList.add("bad");
  } else if (state.scope === "admin") {
    el.textContent = `${who} is in use (admin scope: the whole status view is shown).`;
    el.classList.add("ok");
  } else if (state.scope === "no-admin") {
    el.textContent = `${who} is in use (no admin scope: status shows the public figures only).`;
    el.classList.add("ok");
  } else {
    el.textContent = `${who}: checking…`;
  }
}

function select(tab) {
  for (const name of ["status", "playground"]) {
    const on = name === tab;
    $(`tab-${name}`).setAttribute("aria-selected", String(on));
    $(`view-${name}`).hidden = !on;
  }
  // With several models, their states change (loads, idle unloads): refresh the list's labels.
  if (tab === "playground" && (!$("pg-model").value || $("pg-model").length > 1) && getKey()) loadModels();
}

function keyChanged() {
  describeKey({ scope: "checking" });
  poller.now();
  if (getKey()) loadModels();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault(); // never submitted: form-action is 'none' and no input has a name
    const value = $("key").value.trim();
    $("key").value = "";
    if (value) setKey(value);
    keyChanged();
  });
  $("key-forget").addEventListener("click", () => {
    forgetKey();
    $("pg-model").replaceChildren();
    keyChanged();
  });
  $("tab-status").addEventListener("click", () => select("status"));
  $("tab-playground").addEventListener("click", () => select("playground"));
  document.addEventListener("llamagate:key", (event) => describeKey(event.detail));
  // A button's action (load, unload, cancel) is done: show its effect now, not at the next round.
  document.addEventListener("llamagate:refresh", () => poller.now());
  setupPlayground();
  describeKey(keyState);
  if (getKey()) loadModels();
  poller.start();
});
