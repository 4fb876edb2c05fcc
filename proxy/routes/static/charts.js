// The traffic charts (admin keys): tokens per second, requests per second, time to first token (p50 and
// p95), time per output token, and requests running and queued, one line per model, over the last 15
// minutes, drawn as inline SVG paths (no charting library, nothing fetched; a line is a <path> made
// with createElementNS, no markup is parsed).
//
// The figures are the proxy's own history (GET /admin/history): 10 s buckets it keeps in memory per
// model, so a page opened now draws the traffic that came before it. The newest bucket is still
// filling: its rates are over the seconds it has run so far (drawn once it has run MIN_PARTIAL_S).

const WINDOW_S = 15 * 60;
const MIN_WINDOW_S = 60;
const MIN_PARTIAL_S = 2;
// The SVG's own coordinates (viewBox): stretched to the element's size.
const W = 600;
const H = 120;
// Colours per model (style.css: .m0 ... .m5), in the order the history lists the models.
const COLOURS = 6;

const ms = (s) => (s === null || s === undefined ? null : s * 1000);

// Each chart's lines, per model. ``value(row, seconds)``: the point of one bucket (null: none), where
// ``seconds`` is how much of the bucket has passed.
const CHARTS = [
  { id: "ch-tps", unit: " /s", lines: [{ series: "tokens", rate: true, value: (r, s) => r.tokens / s }] },
  { id: "ch-rps", unit: " /s", lines: [{ series: "requests", rate: true, value: (r, s) => r.requests / s }] },
  {
    id: "ch-ttft",
    unit: " ms",
    lines: [
      { series: "p50", value: (r) => ms(r.ttft_p50_s) },
      { series: "p95", dashed: true, value: (r) => ms(r.ttft_p95_s) },
    ],
  },
  { id: "ch-tpot", unit: " ms", lines: [{ series: "tpot", value: (r) => ms(r.tpot_s) }] },
  {
    id: "ch-load",
    unit: "",
    lines: [
      { series: "running", value: (r) => r.running },
      { series: "queued", dashed: true, value: (r) => r.queued },
    ],
  },
];

function number(v) {
  return v >= 10 || Number.isInteger(v) ? String(Math.round(v)) : v.toFixed(1);
}

function minutes(s) {
  const m = Math.round(s / 60);
  return m <= 1 ? "last minute" : `last ${m} min`;
}

// The chart's <path> for one model's series, made on first use.
function pathFor(svg, model, index, line) {
  for (const p of svg.querySelectorAll("path[data-model]")) {
    if (p.dataset.model === model && p.dataset.series === line.series) return p;
  }
  // The SVG namespace, from the chart itself (index.html holds the <svg> elements).
  const p = document.createElementNS(svg.namespaceURI, "path");
  p.dataset.model = model;
  p.dataset.series = line.series;
  p.setAttribute("class", `line m${index % COLOURS}${line.dashed ? " dashed" : ""}`);
  svg.append(p);
  return p;
}

// The points of one model's series: {t, v}, with null where the bucket has none (a gap in the line).
function points(rows, line, bucketS, now) {
  return rows.map((r) => {
    const seconds = Math.min(bucketS, now - r.t);
    if (line.rate && seconds < MIN_PARTIAL_S) return { t: r.t + seconds, v: null };
    const v = line.value(r, seconds);
    return { t: r.t + seconds, v: v === null || Number.isNaN(v) ? null : v };
  });
}

function chart(spec, models, names, bucketS, now, window) {
  const svg = document.getElementById(spec.id);
  const series = [];
  names.forEach((model, index) => {
    for (const line of spec.lines) {
      const shown = points(models[model], line, bucketS, now).filter((p) => now - p.t <= window);
      series.push({ path: pathFor(svg, model, index, line), shown });
    }
  });
  for (const p of [...svg.querySelectorAll("path[data-model]")]) {
    if (!names.includes(p.dataset.model)) p.remove();
  }
  const values = series.flatMap(({ shown }) => shown.filter((p) => p.v !== null).map((p) => p.v));
  const top = Math.max(1, ...values);
  let drawn = 0;
  for (const { path, shown } of series) {
    const d = [];
    let run = 0; // points in the current piece of line
    const end = () => {
      // A point alone between gaps (one bucket with a TTFT) would draw nothing: a dot (round cap).
      if (run === 1) d.push("h0.01");
      run = 0;
    };
    for (const p of shown) {
      if (p.v === null) {
        end();
        continue;
      }
      const x = W * (1 - (now - p.t) / window);
      const y = H - 2 - (p.v / top) * (H - 8);
      d.push(`${run ? "L" : "M"}${x.toFixed(1)} ${y.toFixed(1)}`);
      run += 1;
    }
    end();
    path.setAttribute("d", d.join(" "));
    drawn = Math.max(drawn, d.filter((c) => c[0] !== "h").length);
  }
  svg.dataset.points = String(drawn);
  const last = series.map(({ shown }) => {
    const known = shown.filter((p) => p.v !== null);
    return known.length ? number(known[known.length - 1].v) : "–";
  });
  document.getElementById(`${spec.id}-now`).textContent = `latest ${last.join(" / ")}${spec.unit}`;
  document.getElementById(`${spec.id}-max`).textContent = `top of the chart: ${number(top)}${spec.unit}`;
  document.getElementById(`${spec.id}-window`).textContent = minutes(window);
}

function legend(names) {
  const el = document.getElementById("charts-legend");
  const items = names.map((model, index) => {
    const span = document.createElement("span");
    span.className = `key m${index % COLOURS}`;
    span.dataset.model = model;
    span.textContent = model;
    return span;
  });
  el.replaceChildren(...items);
}

// One round's GET /admin/history (a settled promise's result).
export function drawHistory(result) {
  const note = document.getElementById("charts-error");
  if (result.status !== "fulfilled") {
    note.hidden = false;
    const reason = result.reason && result.reason.describe ? result.reason.describe() : String(result.reason);
    note.textContent = `This daemon keeps no traffic history (GET /admin/history: ${reason}).`;
    return;
  }
  note.hidden = true;
  const history = result.value;
  const models = history.models || {};
  const names = Object.keys(models);
  const now = history.now;
  const firsts = names.map((m) => (models[m].length ? models[m][0].t : now));
  const window = Math.min(WINDOW_S, Math.max(MIN_WINDOW_S, now - Math.min(now, ...firsts)));
  legend(names);
  for (const spec of CHARTS) chart(spec, models, names, history.bucket_s, now, window);
}

// Without an admin key there is nothing to chart: say so instead.
export function showCharts(admin, note) {
  document.getElementById("charts").hidden = !admin;
  const el = document.getElementById("charts-note");
  el.hidden = admin;
  el.textContent = note;
}
