// relpos explore: fetch numbers from relpos's JSON endpoints and draw them. No position-encoding
// math here: buckets, biases and attention weights all come from the server.
"use strict";

const SVG = "http://www.w3.org/2000/svg";

async function getJSON(path, params) {
  const response = await fetch(path + "?" + new URLSearchParams(params));
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// Typing fires many requests; answers can arrive out of order. Each view keeps only the answer
// (or the error) of its latest request, so the page never shows a state older than its controls.
const latest = {};
async function getLatest(view, path, params) {
  const id = (latest[view] = (latest[view] || 0) + 1);
  try {
    const data = await getJSON(path, params);
    return id === latest[view] ? data : null;
  } catch (err) {
    if (id === latest[view]) throw err;
    return null;
  }
}

function formParams(form) {
  const params = {};
  for (const el of form.elements) {
    if (!el.name) continue;
    params[el.name] = el.type === "checkbox" ? (el.checked ? "1" : "0") : el.value;
  }
  return params;
}

// An error replaces the view's result: no stale numbers under the message.
function showError(view, message) {
  document.getElementById(`${view}-error`).textContent = message || "";
  document.getElementById(`${view}-result`).hidden = Boolean(message);
}

function el(tag, attrs = {}, text = null) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

// --- colour scales ------------------------------------------------------------------------------

// diverging: blue (negative) - white (0) - red (positive), symmetric around 0 (RdBu's ends)
const RED = [178, 24, 43], BLUE = [33, 102, 172];
function diverging(value, limit) {
  const t = limit === 0 ? 0 : Math.max(-1, Math.min(1, value / limit));
  const end = t > 0 ? RED : BLUE, a = Math.abs(t);
  return end.map((c) => Math.round(255 + a * (c - 255)));
}

// sequential (viridis, a few anchors interpolated) for weights in [0, 1]
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function sequential(t) {
  t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
  const k = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - k;
  return VIRIDIS[k].map((c, i) => Math.round(c + f * (VIRIDIS[k + 1][i] - c)));
}

const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;
const textOn = (c) => (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] > 140 ? "#111" : "#fff");
const MASKED = [217, 217, 217];

function niceStep(span, target) {
  const raw = span / target, p = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || raw;
}

// --- view 1: buckets --------------------------------------------------------------------------

function drawBucketChart(data) {
  const svg = document.getElementById("buckets-chart");
  svg.replaceChildren();
  const W = 660, H = 400, m = { l: 52, r: 16, t: 22, b: 44 };
  const symlog = document.getElementById("buckets-axis").value === "symlog";
  const reach = Math.max(8, Math.min(400, Math.round(data.max_distance * 1.25)));
  const lo = -reach, hi = data.bidirectional ? reach : Math.max(4, Math.round(reach / 8));
  const nb = data.num_buckets;
  const f = (d) => (symlog ? Math.sign(d) * Math.log2(1 + Math.abs(d)) : d);  // the x axis' scale
  const x = (d) => m.l + ((f(d) - f(lo)) / (f(hi) - f(lo))) * (W - m.l - m.r);
  const y = (b) => H - m.b - ((b + 0.5) / nb) * (H - m.t - m.b);
  // axes and ticks
  svg.append(el("svg:line", { x1: m.l, y1: H - m.b, x2: W - m.r, y2: H - m.b, class: "axis" }));
  svg.append(el("svg:line", { x1: m.l, y1: m.t, x2: m.l, y2: H - m.b, class: "axis" }));
  let ticks = [];
  if (symlog) {
    for (let p = 1; p <= reach; p *= 2) ticks.push(p, -p);
    ticks.push(0);
  } else {
    const xs = niceStep(hi - lo, 8);
    for (let d = Math.ceil(lo / xs) * xs; d <= hi; d += xs) ticks.push(d);
  }
  for (const d of ticks.filter((d) => d >= lo && d <= hi)) {
    svg.append(el("svg:line", { x1: x(d), y1: H - m.b, x2: x(d), y2: H - m.b + 4, class: "axis" }));
    svg.append(el("svg:text", { x: x(d), y: H - m.b + 16, class: "tick", "text-anchor": "middle" }, String(d)));
  }
  const ys = Math.max(1, niceStep(nb, 8));
  for (let b = 0; b < nb; b += ys) {
    svg.append(el("svg:text", { x: m.l - 6, y: y(b) + 4, class: "tick", "text-anchor": "end" }, String(b)));
    svg.append(el("svg:line", { x1: m.l, y1: y(b), x2: W - m.r, y2: y(b), class: "grid" }));
  }
  svg.append(el("svg:text", { x: (m.l + W - m.r) / 2, y: H - 6, class: "label", "text-anchor": "middle" },
    `relative position j \u2212 i (key \u2212 query)${symlog ? ", symmetric log scale" : ""}`));
  svg.append(el("svg:text", { x: 14, y: (m.t + H - m.b) / 2, class: "label", "text-anchor": "middle",
    transform: `rotate(-90 14 ${(m.t + H - m.b) / 2})` }, "bucket"));
  // the exact region (shaded) and max_distance (dashed), in each direction
  if (data.max_exact) {
    const a = Math.max(lo, -data.max_exact + 0.5), z = Math.min(hi, data.max_exact - 0.5);
    const left = data.bidirectional ? a : Math.max(lo, -data.max_exact + 0.5), right = data.bidirectional ? z : 0.5;
    svg.append(el("svg:rect", { x: x(left), y: m.t, width: x(right) - x(left), height: H - m.t - m.b, class: "exact-band" }));
    svg.append(el("svg:text", { x: (x(left) + x(right)) / 2, y: m.t - 6, class: "mark-label", "text-anchor": "middle" },
      `exact: |j \u2212 i| < ${data.max_exact}`));
  }
  for (const s of data.bidirectional ? [-1, 1] : [-1]) {
    const xv = s * (data.max_distance - 0.5);
    if (xv < lo || xv > hi) continue;
    svg.append(el("svg:line", { x1: x(xv), y1: m.t, x2: x(xv), y2: H - m.b, class: "mark far" }));
    svg.append(el("svg:text", { x: x(xv) + (s < 0 ? 4 : -4), y: m.t + 10, class: "mark-label",
      "text-anchor": s < 0 ? "start" : "end" }, `${s < 0 ? "\u2212" : ""}max_distance: one last bucket past here`));
  }
  // one horizontal step per bucket range (clipped to the drawn span); a one-distance bucket is a dot
  for (const b of data.buckets) {
    const a = Math.max(lo, b.low === null ? lo : b.low - 0.5), z = Math.min(hi, b.high === null ? hi : b.high + 0.5);
    if (z < a) continue;
    const title = el("svg:title", {}, `bucket ${b.bucket}: ${b.low ?? "-inf"} .. ${b.high ?? "+inf"} (${b.exact ? "exact" : "range"})`);
    const seg = b.low !== null && b.low === b.high
      ? el("svg:circle", { cx: x(b.low), cy: y(b.bucket), r: 3.2, class: `step ${b.exact ? "exact" : "range"}`, "data-bucket": b.bucket })
      : el("svg:line", { x1: x(a), y1: y(b.bucket), x2: x(z), y2: y(b.bucket), class: `step ${b.exact ? "exact" : "range"}`, "data-bucket": b.bucket });
    seg.append(title);
    svg.append(seg);
  }
}

function highlightBucket(bucket) {
  for (const seg of document.querySelectorAll("#buckets-chart .step"))
    seg.classList.toggle("hot", seg.dataset.bucket === String(bucket));
}

async function updateBuckets() {
  try {
    const data = await getLatest("buckets", "/api/buckets", formParams(document.getElementById("buckets-form")));
    if (data === null) return;
    showError("buckets", "");
    document.getElementById("max-exact").textContent = data.max_exact;
    document.getElementById("unused").textContent = data.unused_buckets.length ? data.unused_buckets.join(", ") : "none";
    drawBucketChart(data);
    const body = document.querySelector("#buckets-table tbody");
    body.replaceChildren(...data.buckets.map((b) => {
      const row = el("tr", { "data-bucket": b.bucket });
      const low = b.low === null ? "-inf" : b.low, high = b.high === null ? "+inf" : b.high;
      for (const text of [b.bucket, low === high ? String(low) : `${low} .. ${high}`, b.exact ? "exact" : "range"])
        row.append(el("td", {}, String(text)));
      row.addEventListener("mouseenter", () => highlightBucket(b.bucket));
      row.addEventListener("mouseleave", () => highlightBucket(null));
      return row;
    }));
  } catch (err) { showError("buckets", err.message); }
}

// --- view 2: bias heatmap ---------------------------------------------------------------------

const HEAT = { l: 46, t: 16, size: 440, bar: 16 };
let bias = null;

function biasLimit(data) {
  const finite = data.matrix.flat().filter(Number.isFinite);
  return Math.max(...finite.map(Math.abs), 1e-12);
}

function isMasked(data, i, j) { return data.causal && j > i; }

function drawBias(data) {
  const canvas = document.getElementById("bias-canvas"), ctx = canvas.getContext("2d");
  const n = data.matrix.length, cell = HEAT.size / n, limit = biasLimit(data);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
    const v = data.matrix[i][j];
    ctx.fillStyle = rgb(isMasked(data, i, j) || !Number.isFinite(v) ? MASKED : diverging(v, limit));
    ctx.fillRect(HEAT.l + j * cell, HEAT.t + i * cell, Math.ceil(cell), Math.ceil(cell));
  }
  ctx.strokeStyle = "#555"; ctx.strokeRect(HEAT.l, HEAT.t, HEAT.size, HEAT.size);
  // ticks: key j along the top axis' bottom, query i down the left
  ctx.fillStyle = "#222"; ctx.font = "11px system-ui, sans-serif";
  const step = Math.max(1, niceStep(n, 8));
  ctx.textAlign = "center";
  for (let j = 0; j < n; j += step) ctx.fillText(String(j), HEAT.l + (j + 0.5) * cell, HEAT.t + HEAT.size + 14);
  ctx.textAlign = "right";
  for (let i = 0; i < n; i += step) ctx.fillText(String(i), HEAT.l - 5, HEAT.t + (i + 0.5) * cell + 4);
  ctx.textAlign = "center"; ctx.font = "12px system-ui, sans-serif";
  ctx.fillText(data.kind === "window2d" ? "key position r (raster order)" : "key position j", HEAT.l + HEAT.size / 2, HEAT.t + HEAT.size + 32);
  ctx.save(); ctx.translate(13, HEAT.t + HEAT.size / 2); ctx.rotate(-Math.PI / 2);
  ctx.fillText(data.kind === "window2d" ? "query position p" : "query position i", 0, 0); ctx.restore();
  // colour bar, centred at 0
  const bx = HEAT.l + HEAT.size + 28;
  for (let k = 0; k < HEAT.size; k++) {
    ctx.fillStyle = rgb(diverging(limit * (1 - (2 * k) / HEAT.size), limit));
    ctx.fillRect(bx, HEAT.t + k, HEAT.bar, 1);
  }
  ctx.strokeStyle = "#555"; ctx.strokeRect(bx, HEAT.t, HEAT.bar, HEAT.size);
  ctx.fillStyle = "#222"; ctx.textAlign = "left"; ctx.font = "11px system-ui, sans-serif";
  for (const [v, yy] of [[limit, 0], [0, HEAT.size / 2], [-limit, HEAT.size]])
    ctx.fillText((v > 0 ? "+" : "") + v.toFixed(3), bx + HEAT.bar + 4, HEAT.t + yy + 4);
  ctx.save(); ctx.translate(bx + HEAT.bar + 62, HEAT.t + HEAT.size / 2); ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center"; ctx.fillText("bias added to the logit", 0, 0); ctx.restore();
  canvas.dataset.n = n;
  biasImage = ctx.getImageData(0, 0, canvas.width, canvas.height);  // redrawn under the hover outline
}
let biasImage = null;

function outlineCell(i, j) {
  const canvas = document.getElementById("bias-canvas"), ctx = canvas.getContext("2d");
  const cell = HEAT.size / bias.matrix.length;
  ctx.putImageData(biasImage, 0, 0);
  ctx.strokeStyle = "#111"; ctx.lineWidth = 2;
  ctx.strokeRect(HEAT.l + j * cell, HEAT.t + i * cell, cell, cell);
  ctx.lineWidth = 1;
}

function explainCell(data, i, j) {
  const v = data.matrix[i][j], d = j - i, dd = data.details, f = (x) => x.toFixed(4);
  if (isMasked(data, i, j)) return `query ${i}, key ${j}: a future key (j \u2212 i = ${d} > 0), masked in causal attention`;
  if (data.kind === "t5") return `query ${i}, key ${j}: j \u2212 i = ${d} \u2192 bucket ${dd.buckets[i][j]} \u2192 table[${dd.buckets[i][j]}] = ${f(v)}`;
  if (data.kind === "clipped") {
    const c = Math.max(-dd.max_distance, Math.min(dd.max_distance, d));
    return `query ${i}, key ${j}: j \u2212 i = ${d} \u2192 clipped to [\u2212${dd.max_distance}, ${dd.max_distance}]: ${c} \u2192 table[${c}] = ${f(v)}`;
  }
  if (data.kind === "alibi") return `query ${i}, key ${j}: j \u2212 i = ${d} \u2192 \u2212m\u00b7|j \u2212 i| = \u2212${dd.slope}\u00b7${Math.abs(d)} = ${f(v)}`;
  if (data.kind === "log_decay") return `query ${i}, key ${j}: j \u2212 i = ${d} \u2192 \u2212s\u00b7log(1 + |j \u2212 i|) = \u2212${dd.scale}\u00b7log(${1 + Math.abs(d)}) = ${f(v)}`;
  if (data.kind !== "window2d") {  // the other encodings of relpos.registry: their formula and parameters
    const params = Object.entries(dd).map(([k, x]) => `${k} = ${typeof x === "number" ? +x.toFixed(4) : x}`).join(", ");
    return `query ${i}, key ${j}: j \u2212 i = ${d} \u2192 ${data.formula}${params ? ` (${params})` : ""} = ${f(v)}`;
  }
  return `query p = ${i}, key r = ${j}: index[${i}][${j}] = ${dd.index[i][j]} \u2192 table[${dd.index[i][j]}] = ${f(v)}`;
}

// the options an encoding takes; the others are hidden (and not sent)
function biasParams() {
  const form = document.getElementById("bias-form"), kind = form.elements.kind.value;
  for (const label of form.querySelectorAll("label.for-t5, label.for-clipped"))
    label.hidden = !label.classList.contains(`for-${kind}`);
  const maxDistance = form.elements.max_distance;
  if (kind !== maxDistance.dataset.kind) {  // each encoding's own default: T5 128, clipped 8
    maxDistance.value = kind === "clipped" ? 8 : 128;
    maxDistance.dataset.kind = kind;
  }
  const params = formParams(form);
  if (kind !== "t5") delete params.num_buckets;
  if (kind !== "t5" && kind !== "clipped") delete params.max_distance;
  return params;
}

async function updateBias() {
  try {
    const data = await getLatest("bias", "/api/bias", biasParams());
    if (data === null) return;
    showError("bias", "");
    bias = data;
    drawBias(data);
    document.getElementById("bias-legend").textContent = data.legend + (data.causal ? " Grey cells: future keys, masked." : "");
    document.getElementById("bias-hover").textContent = "Hover a cell: query i, key j, how its bias is computed.";
  } catch (err) { bias = null; showError("bias", err.message); }
}

document.getElementById("bias-canvas").addEventListener("mousemove", (event) => {
  if (!bias) return;
  const canvas = event.target, rect = canvas.getBoundingClientRect();
  const px = ((event.clientX - rect.left) / rect.width) * canvas.width, py = ((event.clientY - rect.top) / rect.height) * canvas.height;
  const n = bias.matrix.length, j = Math.floor(((px - HEAT.l) / HEAT.size) * n), i = Math.floor(((py - HEAT.t) / HEAT.size) * n);
  if (i >= 0 && j >= 0 && i < n && j < n) {
    document.getElementById("bias-hover").textContent = explainCell(bias, i, j);
    outlineCell(i, j);
  }
});

// --- view 3: standard vs biased attention -------------------------------------------------------

function heatTable(id, tokens, matrix, colour, selected, digits = 4) {
  const table = document.getElementById(id);
  const head = el("tr");
  head.append(el("th", {}, "query \\ key"));
  for (const t of tokens) head.append(el("th", {}, t));
  const rows = matrix.map((values, i) => {
    const row = el("tr", i === selected ? { class: "selected" } : {});
    row.append(el("th", {}, tokens[i]));
    for (const v of values) {
      const c = colour(v);
      row.append(el("td", { style: `background:${rgb(c)};color:${textOn(c)}` }, v.toFixed(digits)));
    }
    return row;
  });
  table.replaceChildren(head, ...rows);
}

function drawRow(data, q) {
  const svg = document.getElementById("attention-row");
  svg.replaceChildren();
  const W = 660, H = 230, m = { l: 44, r: 10, t: 12, b: 36 }, n = data.tokens.length;
  const top = Math.max(...data.standard[q], ...data.biased[q]);
  const ymax = Math.ceil(top * 10) / 10;
  const y = (v) => H - m.b - (v / ymax) * (H - m.t - m.b), group = (W - m.l - m.r) / n, bw = group * 0.34;
  svg.append(el("svg:line", { x1: m.l, y1: H - m.b, x2: W - m.r, y2: H - m.b, class: "axis" }));
  for (let v = 0; v <= ymax + 1e-9; v += 0.1) {
    svg.append(el("svg:line", { x1: m.l, y1: y(v), x2: W - m.r, y2: y(v), class: "grid" }));
    svg.append(el("svg:text", { x: m.l - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, v.toFixed(1)));
  }
  data.tokens.forEach((t, j) => {
    const x0 = m.l + j * group + group * 0.14;
    for (const [k, key] of [[0, "standard"], [1, "biased"]]) {
      const v = data[key][q][j];
      const bar = el("svg:rect", { x: x0 + k * bw, y: y(v), width: bw - 2, height: H - m.b - y(v), class: `bar ${key}` });
      bar.append(el("svg:title", {}, `${key}: ${v.toFixed(4)}`));
      svg.append(bar);
    }
    svg.append(el("svg:text", { x: x0 + bw, y: H - m.b + 15, class: "tick", "text-anchor": "middle" },
      `${t} (j\u2212i = ${j - q})`));
  });
  svg.append(el("svg:rect", { x: W - m.r - 160, y: m.t, width: 10, height: 10, class: "bar standard" }));
  svg.append(el("svg:text", { x: W - m.r - 146, y: m.t + 9, class: "tick" }, "standard"));
  svg.append(el("svg:rect", { x: W - m.r - 80, y: m.t, width: 10, height: 10, class: "bar biased" }));
  svg.append(el("svg:text", { x: W - m.r - 66, y: m.t + 9, class: "tick" }, "biased"));
}

const wmaxOf = (data) => Math.max(...data.standard.flat(), ...data.biased.flat());
let attention = null;
function renderAttention() {
  const data = attention, select = document.getElementById("attention-query");
  if (select.options.length !== data.tokens.length)
    select.replaceChildren(...data.tokens.map((t, i) => el("option", { value: i }, `${i}: ${t}`)));
  const q = Number(select.value || 0);
  const wmax = wmaxOf(data);  // one colour scale for both maps
  heatTable("standard-table", data.tokens, data.standard, (v) => sequential(v / wmax), q);
  heatTable("biased-table", data.tokens, data.biased, (v) => sequential(v / wmax), q);
  const limit = Math.max(...data.difference.flat().map(Math.abs), 1e-12);
  heatTable("difference-table", data.tokens, data.difference, (v) => diverging(v, limit), q);
  drawRow(data, q);
  const shape = data.decay === "log" ? `\u2212${data.scale}\u00b7log(1 + |j \u2212 i|)` : `\u2212${data.scale}\u00b7|j \u2212 i|`;
  const far = data.bias[q].map((b, j) => [b, j]).sort((a, b) => a[0] - b[0])[0];
  document.getElementById("attention-caption").textContent =
    `Query "${data.tokens[q]}": the bias ${shape} lowers far keys most (here "${data.tokens[far[1]]}", ${far[0].toFixed(3)}); ` +
    "the softmax moves their weight to near keys. Each row of the maps sums to 1; colours run from 0 (dark) to " +
    `the largest weight, ${wmaxOf(data).toFixed(3)} (yellow).`;
}

async function updateAttention() {
  try {
    const data = await getLatest("attention", "/api/attention", formParams(document.getElementById("attention-form")));
    if (data === null) return;
    showError("attention", "");
    attention = data;
    renderAttention();
  } catch (err) { attention = null; showError("attention", err.message); }
}
document.getElementById("attention-query").addEventListener("change", () => attention && renderAttention());

// --- tabs and wiring ----------------------------------------------------------------------------

function openView(viewId) {
  for (const tab of document.querySelectorAll(".tabs [role=tab]")) {
    const on = tab.dataset.view === viewId;
    tab.setAttribute("aria-selected", String(on));
    document.getElementById(tab.dataset.view).hidden = !on;
  }
  history.replaceState(null, "", "#" + viewId.replace("-view", ""));
}
for (const tab of document.querySelectorAll(".tabs [role=tab]")) tab.addEventListener("click", () => openView(tab.dataset.view));

for (const [id, update] of [["buckets-form", updateBuckets], ["bias-form", updateBias], ["attention-form", updateAttention]]) {
  const form = document.getElementById(id);
  form.addEventListener("input", (event) => { if (event.target.id !== "attention-query") update(); });
  form.addEventListener("submit", (event) => { event.preventDefault(); update(); });
}
function openFromHash() {
  const name = location.hash.slice(1);
  if (["buckets", "bias", "attention"].includes(name)) openView(name + "-view");
}
window.addEventListener("hashchange", openFromHash);
openFromHash();
updateBuckets(); updateBias(); updateAttention();
