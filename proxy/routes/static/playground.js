// The playground: one chat request with stream=true, its answer shown as it is generated.
//
// Model output is untrusted: it is only ever appended as text (Text nodes), never parsed as HTML.
// Stop aborts the fetch; the proxy sees the connection close, cancels the upstream request and
// llama-server frees the slot at its next token.

import { ApiError, errorOf, getJson, request } from "./api.js";
import { setText, showMessage } from "./format.js";

const $ = (id) => document.getElementById(id);

let controller = null;

function setState(text, cls = "") {
  const el = setText("pg-state", text);
  el.className = `state ${cls}`;
}

function busy(on) {
  $("pg-send").disabled = on;
  $("pg-stop").disabled = !on;
}

// With several models, an option says the model's state (and that it serves embeddings): choosing an
// unloaded one is fine, sending to it loads it (the person's request, never the page's own doing).
function optionText(m, several) {
  const g = m.llamagate;
  if (!several || !g) return m.id;
  return `${m.id} (${g.embeddings ? "embeddings, " : ""}${g.state})`;
}

export async function loadModels() {
  const select = $("pg-model");
  try {
    const list = await getJson("/v1/models");
    const models = list.data || [];
    const ids = models.map((m) => m.id);
    const current = select.value;
    select.replaceChildren(
      ...models.map((m) => {
        const option = document.createElement("option");
        option.value = m.id;
        option.textContent = optionText(m, models.length > 1);
        return option;
      }),
    );
    // Keep the person's choice; else the first loaded chat model, the first loaded one, the first.
    const loaded = models.filter((m) => m.llamagate?.state === "loaded");
    const pick = loaded.find((m) => !m.llamagate.embeddings) || loaded[0];
    if (ids.includes(current)) select.value = current;
    else if (pick) select.value = pick.id;
    showMessage("pg-message", "");
    return true;
  } catch (err) {
    select.replaceChildren();
    let text = `Could not list the models: ${err instanceof ApiError ? err.describe() : err}`;
    if (err instanceof ApiError && err.status === 403) text = "This key has no inference scope: it cannot use the playground.";
    if (err instanceof ApiError && err.status === 401) text = `This key was refused (${err.describe()}).`;
    showMessage("pg-message", text, true);
    return false;
  }
}

function requestBody() {
  const messages = [];
  const system = $("pg-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push({ role: "user", content: $("pg-prompt").value });
  const body = { model: $("pg-model").value || undefined, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = $("pg-temperature").value;
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("pg-max-tokens").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  return body;
}

// Server-sent events from a byte stream: yields each event's data field (lines joined).
// Aborting the fetch errors this stream, which ends the loop below with an AbortError.
async function* sseData(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

function showFigures(run) {
  if (run.firstAt !== null) setText("pg-ttft", `${Math.round(run.firstAt - run.sentAt)} ms`);
  const generated = run.completionTokens ?? run.chunks;
  if (run.firstAt !== null && run.lastAt > run.firstAt && generated > 1) {
    setText("pg-rate", `${((generated - 1) / ((run.lastAt - run.firstAt) / 1000)).toFixed(1)}`);
  }
  setText("pg-prompt-tokens", run.promptTokens);
  setText("pg-completion-tokens", run.completionTokens ?? (run.chunks ? `${run.chunks} so far` : null));
}

async function send() {
  const output = $("pg-output");
  output.replaceChildren();
  showMessage("pg-message", "");
  for (const id of ["pg-ttft", "pg-rate", "pg-prompt-tokens", "pg-completion-tokens"]) setText(id, null);
  controller = new AbortController();
  const signal = controller.signal;
  busy(true);
  setState("waiting for the first token…", "warn");
  const run = { sentAt: performance.now(), firstAt: null, lastAt: 0, chunks: 0, promptTokens: null, completionTokens: null };
  try {
    const response = await request("/v1/chat/completions", { method: "POST", body: requestBody(), signal, timeout: false });
    if (!response.ok) {
      const err = await errorOf(response);
      showMessage("pg-message", err.describe(), true);
      setState(`refused (${err.status})`, "bad");
      return;
    }
    let finished = false;
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") {
        finished = true;
        break;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) {
        showMessage("pg-message", `The stream broke: ${chunk.error.message}`, true);
        setState("error", "bad");
        return;
      }
      const text = chunk.choices?.[0]?.delta?.content;
      if (text) {
        const now = performance.now();
        if (run.firstAt === null) {
          run.firstAt = now;
          setState("generating…", "warn");
        }
        run.lastAt = now;
        run.chunks += 1;
        output.append(document.createTextNode(text));
      }
      if (chunk.usage) {
        run.promptTokens = chunk.usage.prompt_tokens;
        run.completionTokens = chunk.usage.completion_tokens;
      }
      showFigures(run);
    }
    if (signal.aborted) setState("stopped", "warn");
    else setState(finished ? "done" : "ended without [DONE]", finished ? "ok" : "bad");
  } catch (err) {
    if (signal.aborted) {
      setState("stopped", "warn");
    } else {
      showMessage("pg-message", `Request failed: ${err}`, true);
      setState("error", "bad");
    }
  } finally {
    showFigures(run);
    controller = null;
    busy(false);
  }
}

export function setupPlayground() {
  $("pg-send").addEventListener("click", () => {
    if (!controller) send();
  });
  $("pg-stop").addEventListener("click", () => {
    if (controller) controller.abort();
  });
}
