// The playground: a conversation with the model, each turn one chat request with stream=true.
//
// The history lives in the page only (cleared by the person, or by a reload): each turn's request carries
// the system prompt, every earlier turn and the new message, as any chat client sends them. Model output
// is untrusted: it is rendered by render.js from DOM nodes and Text nodes, never parsed as HTML. Stop
// aborts the fetch; the proxy sees the connection close, cancels the upstream request and llama-server
// frees the slot at its next token; the part of the answer received stays in the history.

import { ApiError, errorOf, getJson, request } from "./api.js";
import { setText, showMessage } from "./format.js";
import { renderAnswer } from "./render.js";

const $ = (id) => document.getElementById(id);

let controller = null;
// The conversation so far: {role, content} of each finished turn (user, then assistant).
let history = [];

function setState(text, cls = "") {
  const el = setText("pg-state", text);
  el.className = `state ${cls}`;
}

function busy(on) {
  $("pg-send").disabled = on;
  $("pg-stop").disabled = !on;
  $("pg-clear").disabled = on;
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

function requestBody(prompt) {
  const messages = [];
  const system = $("pg-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history, { role: "user", content: prompt });
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

// One turn's figures: in the page's summary (the latest turn) and under the turn itself.
function showFigures(run, footer) {
  const ttft = run.firstAt !== null ? `${Math.round(run.firstAt - run.sentAt)} ms` : null;
  setText("pg-ttft", ttft);
  const generated = run.completionTokens ?? run.chunks;
  let rate = null;
  if (run.firstAt !== null && run.lastAt > run.firstAt && generated > 1) {
    rate = `${((generated - 1) / ((run.lastAt - run.firstAt) / 1000)).toFixed(1)}`;
    setText("pg-rate", rate);
  }
  setText("pg-prompt-tokens", run.promptTokens);
  setText("pg-cached-tokens", run.cachedTokens);
  setText("pg-completion-tokens", run.completionTokens ?? (run.chunks ? `${run.chunks} so far` : null));
  const parts = [];
  if (run.promptTokens !== null) {
    const cached = run.cachedTokens !== null ? `, ${run.cachedTokens} cached` : "";
    parts.push(`${run.promptTokens} prompt tokens${cached}`);
  }
  if (run.completionTokens !== null) parts.push(`${run.completionTokens} completion tokens`);
  else if (run.chunks) parts.push(`${run.chunks} chunks so far`);
  if (ttft !== null) parts.push(`first token in ${ttft}`);
  if (rate !== null) parts.push(`${rate} tokens/s`);
  footer.textContent = parts.join(" · ");
}

// A turn in the transcript: the person's message (plain text) and the answer's element, which becomes
// #pg-output (the one being written) until the next turn takes the id.
function addTurn(prompt) {
  const turn = document.createElement("div");
  turn.className = "turn";
  const user = document.createElement("div");
  user.className = "msg user";
  user.textContent = prompt;
  const answer = document.createElement("div");
  answer.className = "msg assistant";
  const footer = document.createElement("div");
  footer.className = "turn-figures";
  turn.append(user, answer, footer);
  $("pg-output")?.removeAttribute("id");
  answer.id = "pg-output";
  $("pg-conversation").append(turn);
  return { turn, answer, footer };
}

function clearConversation() {
  history = [];
  $("pg-output")?.removeAttribute("id");
  $("pg-conversation").replaceChildren();
  for (const id of ["pg-ttft", "pg-rate", "pg-prompt-tokens", "pg-cached-tokens", "pg-completion-tokens"]) setText(id, null);
  setState("idle");
  showMessage("pg-message", "");
}

async function send() {
  const prompt = $("pg-prompt").value;
  if (!prompt.trim()) {
    showMessage("pg-message", "Write a message first.", true);
    return;
  }
  showMessage("pg-message", "");
  for (const id of ["pg-ttft", "pg-rate", "pg-prompt-tokens", "pg-cached-tokens", "pg-completion-tokens"]) setText(id, null);
  const body = requestBody(prompt);
  const { turn, answer, footer } = addTurn(prompt);
  controller = new AbortController();
  const signal = controller.signal;
  busy(true);
  setState("waiting for the first token…", "warn");
  const run = {
    sentAt: performance.now(), firstAt: null, lastAt: 0, chunks: 0,
    promptTokens: null, cachedTokens: null, completionTokens: null,
  };
  let text = "";
  let kept = false; // the turn joins the history once the model answered (or was stopped while it did)
  try {
    const response = await request("/v1/chat/completions", { method: "POST", body, signal, timeout: false });
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
      const piece = chunk.choices?.[0]?.delta?.content;
      if (piece) {
        const now = performance.now();
        if (run.firstAt === null) {
          run.firstAt = now;
          setState("generating…", "warn");
        }
        run.lastAt = now;
        run.chunks += 1;
        text += piece;
        renderAnswer(answer, text);
      }
      if (chunk.usage) {
        run.promptTokens = chunk.usage.prompt_tokens;
        run.completionTokens = chunk.usage.completion_tokens;
        run.cachedTokens = chunk.usage.prompt_tokens_details?.cached_tokens ?? null;
      }
      showFigures(run, footer);
    }
    kept = !signal.aborted || text.length > 0;
    if (signal.aborted) setState("stopped", "warn");
    else setState(finished ? "done" : "ended without [DONE]", finished ? "ok" : "bad");
  } catch (err) {
    if (signal.aborted) {
      kept = text.length > 0; // stopped before the first token: nothing was said
      setState("stopped", "warn");
    } else {
      showMessage("pg-message", `Request failed: ${err}`, true);
      setState("error", "bad");
    }
  } finally {
    showFigures(run, footer);
    if (kept) {
      history.push({ role: "user", content: prompt }, { role: "assistant", content: text });
      $("pg-prompt").value = "";
      if (signal.aborted) turn.classList.add("stopped");
    } else {
      // Refused, failed, or stopped before a word: not part of the conversation; the message stays in
      // the box, and the previous answer is #pg-output again.
      turn.remove();
      const answers = $("pg-conversation").querySelectorAll(".msg.assistant");
      if (answers.length) answers[answers.length - 1].id = "pg-output";
    }
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
  $("pg-clear").addEventListener("click", () => {
    if (!controller) clearConversation();
  });
}
