// Small formatting helpers shared by the views. Everything they return is plain text.

export function setText(id, value) {
  const el = document.getElementById(id);
  el.textContent = value === null || value === undefined || value === "" ? "–" : String(value);
  return el;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.floor(seconds);
  if (s < 60) return `${seconds.toFixed(1)} s`;
  const d = Math.floor(s / 86400);
  const h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (d > 0) return `${d} d ${h} h ${m} min`;
  if (h > 0) return `${h} h ${m} min`;
  return `${m} min ${s % 60} s`;
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

export function clock(date = new Date()) {
  return date.toLocaleTimeString([], { hour12: false });
}

// A state name's colour class: ok, warn or bad.
export function stateClass(state, ready) {
  if (ready) return "ok";
  if (state === "FAILED" || state === "STOPPED") return "bad";
  return "warn";
}

// ``bad``: in red; ``ok``: in green (a done action); else the warning look.
export function showMessage(id, text, bad = false, ok = false) {
  const el = document.getElementById(id);
  el.hidden = !text;
  el.textContent = text || "";
  el.classList.toggle("bad", Boolean(bad));
  el.classList.toggle("ok", Boolean(ok) && !bad);
}
