// relpos explore: fetch numbers from relpos's JSON endpoints and draw them. No math here.
"use strict";

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

function show(errorId, message) { document.getElementById(errorId).textContent = message || ""; }

async function updateBuckets() {
  const form = document.getElementById("buckets-form");
  try {
    const data = await getLatest("buckets", "/api/buckets", formParams(form));
    if (data === null) return;
    show("buckets-error", "");
    document.getElementById("max-exact").textContent = data.max_exact;
    document.getElementById("unused").textContent = data.unused_buckets.length ? data.unused_buckets.join(", ") : "none";
    const body = document.querySelector("#buckets-table tbody");
    body.replaceChildren(...data.buckets.map((b) => {
      const row = document.createElement("tr");
      const low = b.low === null ? "-inf" : b.low, high = b.high === null ? "+inf" : b.high;
      for (const text of [b.bucket, low === high ? String(low) : `${low} .. ${high}`, b.exact ? "exact" : "range"]) {
        const cell = document.createElement("td"); cell.textContent = text; row.appendChild(cell);
      }
      return row;
    }));
  } catch (err) { show("buckets-error", err.message); }
}

function color(value, limit) {
  const t = limit === 0 ? 0 : Math.max(-1, Math.min(1, value / limit));
  const r = t > 0 ? 255 : Math.round(255 * (1 + t)), b = t < 0 ? 255 : Math.round(255 * (1 - t));
  const g = Math.round(255 * (1 - Math.abs(t)));
  return `rgb(${r},${g},${b})`;
}

let biasMatrix = [];
async function updateBias() {
  const form = document.getElementById("bias-form");
  try {
    const data = await getLatest("bias", "/api/bias", formParams(form));
    if (data === null) return;
    show("bias-error", "");
    biasMatrix = data.matrix;
    const canvas = document.getElementById("bias-canvas"), ctx = canvas.getContext("2d");
    const n = biasMatrix.length, cell = canvas.width / n;
    const finite = biasMatrix.flat().filter(Number.isFinite);
    const limit = Math.max(...finite.map(Math.abs), 1e-12);
    for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
      ctx.fillStyle = color(biasMatrix[i][j], limit);
      ctx.fillRect(j * cell, i * cell, Math.ceil(cell), Math.ceil(cell));
    }
    canvas.dataset.n = n;
  } catch (err) { show("bias-error", err.message); }
}

function fillTable(id, tokens, matrix) {
  const table = document.getElementById(id);
  const head = document.createElement("tr");
  for (const text of ["", ...tokens]) { const th = document.createElement("th"); th.textContent = text; head.appendChild(th); }
  const rows = matrix.map((values, i) => {
    const row = document.createElement("tr");
    const th = document.createElement("th"); th.textContent = tokens[i]; row.appendChild(th);
    for (const v of values) { const td = document.createElement("td"); td.textContent = v.toFixed(4); row.appendChild(td); }
    return row;
  });
  table.replaceChildren(head, ...rows);
}

async function updateAttention() {
  try {
    const data = await getLatest("attention", "/api/attention", formParams(document.getElementById("attention-form")));
    if (data === null) return;
    show("attention-error", "");
    fillTable("standard-table", data.tokens, data.standard);
    fillTable("biased-table", data.tokens, data.biased);
  } catch (err) { show("attention-error", err.message); }
}

document.getElementById("bias-canvas").addEventListener("mousemove", (event) => {
  const canvas = event.target, n = Number(canvas.dataset.n || 0);
  if (!n) return;
  const rect = canvas.getBoundingClientRect();
  const j = Math.floor((event.clientX - rect.left) / rect.width * n), i = Math.floor((event.clientY - rect.top) / rect.height * n);
  if (biasMatrix[i] && biasMatrix[i][j] !== undefined)
    document.getElementById("bias-hover").textContent = `query ${i}, key ${j} (j - i = ${j - i}): ${biasMatrix[i][j].toFixed(4)}`;
});
for (const [id, update] of [["buckets-form", updateBuckets], ["bias-form", updateBias], ["attention-form", updateAttention]]) {
  document.getElementById(id).addEventListener("input", update);
  document.getElementById(id).addEventListener("submit", (event) => { event.preventDefault(); update(); });
}
updateBuckets(); updateBias(); updateAttention();
