// Talking to llamagate from the page: the key (sessionStorage only), requests, error answers.
//
// The key is sent in the Authorization header and nowhere else: never in a URL, a cookie or the
// console. sessionStorage lives as long as the tab and is not shared with other tabs.

const STORE = "llamagate.key";
const TIMEOUT_MS = 10000;

export function getKey() {
  return sessionStorage.getItem(STORE) || "";
}

export function setKey(key) {
  sessionStorage.setItem(STORE, key);
}

export function forgetKey() {
  sessionStorage.removeItem(STORE);
}

// The public part of a key (lg_<id>_...), which llamagate's logs show too; never the secret part.
export function keyId(key) {
  const m = /^lg_([0-9a-f]{12})_/.exec(key);
  return m ? m[1] : null;
}

// An answer that is not 2xx, in words a person can act on.
export class ApiError extends Error {
  constructor(status, message, retryAfter, code) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter; // seconds, or null
    this.code = code;
  }

  describe() {
    const retry = this.retryAfter !== null ? `; retry after ${this.retryAfter} s` : "";
    return `${this.status}: ${this.message}${retry}`;
  }
}

// One signal that aborts when any of ``signals`` does (AbortSignal.any where the browser has it).
function anyOf(signals) {
  if (signals.length <= 1) return signals[0];
  if (AbortSignal.any) return AbortSignal.any(signals);
  const controller = new AbortController();
  for (const s of signals) s.addEventListener("abort", () => controller.abort(s.reason), { once: true });
  return controller.signal;
}

// fetch() on this origin. ``signal``: an AbortSignal (the playground's stop button); every request
// also gives up after TIMEOUT_MS unless ``timeout: false`` (a stream may run for minutes).
export function request(path, { method = "GET", body, signal, auth = true, timeout = true } = {}) {
  const headers = { Accept: "application/json" };
  const key = getKey();
  if (auth && key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const signals = [signal, timeout ? AbortSignal.timeout(TIMEOUT_MS) : null].filter(Boolean);
  return fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: anyOf(signals),
    cache: "no-store",
    credentials: "omit",
    redirect: "error",
    referrerPolicy: "no-referrer",
  });
}

export async function errorOf(response) {
  let message = response.statusText || "request failed";
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code ?? null;
    }
  } catch {
    // Not JSON (a proxy in between?): keep the status text.
  }
  const header = response.headers.get("Retry-After");
  const retryAfter = header !== null && /^\d+$/.test(header) ? Number(header) : null;
  return new ApiError(response.status, message, retryAfter, code);
}

// GET a JSON answer; throws ApiError for a non-2xx answer.
export async function getJson(path, options = {}) {
  const response = await request(path, options);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}
