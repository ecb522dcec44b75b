// relpos explore, image view: a patch grid coloured by the bias from one query patch to every
// patch, the windows (and the shifted ones), and the 2x2 worked example. Numbers come from
// /api/image and /api/image-example; this file only draws. Uses app.js's helpers.
"use strict";

let image = null;
const imagePatch = () => Number(document.getElementById("image-patch").value || 0);

function patchName(data, p) {
  return `patch ${p} (row ${Math.floor(p / data.grid)}, col ${p % data.grid})`;
}

function describePair(data, p, q) {
  // offsets inside a window are taken after the roll by -shift (a wrapped pair is far apart on the map)
  const g = data.grid, rolled = (x) => (((x - data.shift) % g) + g) % g;
  const dr = Math.floor(p / g) - Math.floor(q / g), dc = (p % g) - (q % g);
  const rr = rolled(Math.floor(p / g)) - rolled(Math.floor(q / g)), rc = rolled(p % g) - rolled(q % g);
  const wrapped = data.matrix[p][q] !== null && (rr !== dr || rc !== dc);
  const head = `query ${patchName(data, p)}\nkey   ${patchName(data, q)}\n\u0394 = query \u2212 key = (${wrapped ? rr : dr}, ${wrapped ? rc : dc})` +
    (wrapped ? ` in the rolled window (${dr}, ${dc}) on the map` : "") + "\n";
  const v = data.matrix[p][q];
  if (v === null) return head + "different windows: not attended (no score at all)";
  if (data.masked[p][q]) return head + `bias ${v.toFixed(4)} + shift mask ${data.mask_value}: ` +
    "the roll put them in one window from opposite borders, so the mask cuts them apart";
  return head + `bias ${v.toFixed(4)}` + (p === q ? " (the patch itself)" : "");
}

function windowLines(svg, data, cell, shift, cls) {
  // window borders along each axis, in the map's coordinates: the roll by -shift moves them to shift + k*W
  const g = data.grid, w = data.window;
  for (let k = 0; k <= g / w; k++) {
    const at = ((shift + k * w) % g) * cell + 20;
    if (shift === 0 && (k === 0 || k === g / w)) continue;  // the map's own edges
    svg.append(el("svg:line", { x1: at, y1: 20, x2: at, y2: 20 + g * cell, class: cls }));
    svg.append(el("svg:line", { x1: 20, y1: at, x2: 20 + g * cell, y2: at, class: cls }));
  }
}

function drawImage() {
  const data = image, svg = document.getElementById("image-grid-svg");
  svg.replaceChildren();
  const g = data.grid, cell = 440 / g, p = Math.min(imagePatch(), g * g - 1);
  const row = data.matrix[p];
  const values = row.filter((v, q) => v !== null && !data.masked[p][q]);
  const limit = Math.max(...values.map(Math.abs), 1e-12);
  svg.dataset.grid = String(g);
  svg.dataset.patch = String(p);
  row.forEach((v, q) => {
    const x = 20 + (q % g) * cell, y = 20 + Math.floor(q / g) * cell;
    let fill = MASKED, cls = "patch other";
    if (v !== null && data.masked[p][q]) { fill = [120, 120, 120]; cls = "patch masked"; }
    else if (v !== null) { fill = diverging(v, limit); cls = "patch"; }
    const rect = el("svg:rect", { x, y, width: cell, height: cell, class: cls + (q === p ? " query" : ""),
      fill: rgb(fill), "data-q": q });
    rect.addEventListener("mouseenter", () => { document.getElementById("image-hover").textContent = describePair(data, p, q); });
    rect.addEventListener("click", () => { document.getElementById("image-patch").value = q; drawImage(); });
    svg.append(rect);
    if (g <= 8 && v !== null) {
      const text = data.masked[p][q] ? "mask" : v.toFixed(2);
      svg.append(el("svg:text", { x: x + cell / 2, y: y + cell / 2 + 4, class: "cell-value", "text-anchor": "middle",
        fill: textOn(fill) }, text));
    }
  });
  if (data.shift) windowLines(svg, data, cell, 0, "window-line plain");
  windowLines(svg, data, cell, data.shift, "window-line" + (data.shift ? " shifted" : ""));
  svg.append(el("svg:rect", { x: 20, y: 20, width: g * cell, height: g * cell, class: "map-edge" }));
  const caption = document.getElementById("image-caption");
  caption.textContent = `${data.title}: bias from ${patchName(data, p)} (outlined) to every patch, ` +
    `${data.grid}\u00d7${data.grid} patches in ${data.window}\u00d7${data.window} windows` +
    (data.shift ? `, shifted by ${data.shift} (solid lines; the unshifted windows dashed)` : "") +
    `. Grey: other windows (not attended)` + (data.shift ? "; dark grey: same window after the roll, cut by the shift mask" : "") +
    `. Colours: blue negative, red positive, up to \u00b1${limit.toFixed(2)}. ${data.parameters}.`;
  document.getElementById("image-legend").textContent =
    "\u0394 is query \u2212 key (Swin's sign): a key below the query has \u0394row = \u22121. " +
    "Every window reads the same table, so the pattern around a patch is the same in every window.";
}

async function updateImage() {
  const form = document.getElementById("image-form");
  document.querySelector("#image-form .for-continuous").hidden = document.getElementById("image-kind").value !== "continuous";
  try {
    const data = await getLatest("image", "/api/image", formParams(form));
    if (data === null) return;
    showError("image", "");
    const select = document.getElementById("image-kind");
    if (select.options.length !== Object.keys(data.kinds).length) {
      select.replaceChildren(...Object.entries(data.kinds).map(([k, t]) => el("option", { value: k }, t)));
      select.value = data.kind;
    }
    image = data;
    document.getElementById("image-patch").max = data.grid * data.grid - 1;
    drawImage();
  } catch (err) { image = null; showError("image", err.message); }
}

// --- the worked example -----------------------------------------------------------------------

function exampleTable(title, labels, matrix, colour, digits = 3, columns = null) {
  const box = el("div");
  box.append(el("h3", {}, title));
  const table = el("table", { class: "heat" });
  const head = el("tr");
  head.append(el("th", {}, columns ? "patch" : "i \\ j"));
  for (const t of columns || labels) head.append(el("th", {}, t));
  table.append(head);
  matrix.forEach((values, i) => {
    const row = el("tr");
    row.append(el("th", {}, labels[i]));
    for (const v of values) {
      const c = colour(v);
      row.append(el("td", { style: `background:${rgb(c)};color:${textOn(c)}` }, v.toFixed(digits)));
    }
    table.append(row);
  });
  box.append(table);
  return box;
}

function describeExample(ex) {
  const names = ["0 (itself)", "1 (right)", "2 (below)", "3 (below-right)"];
  const row = ex.relative[0], bias = ex.bias[0];
  const best = row.indexOf(Math.max(...row)), bestBias = bias.indexOf(Math.max(...bias));
  return `Row 0 of the relative logits is [${row.join(", ")}]: patch 0 gives its largest logit to patch ${names[best]}, ` +
    `so "patch 0 prefers looking below itself". The bias alone says something else: its largest entry in row 0 is ` +
    `${bias[bestBias]} for patch ${names[bestBias]} (offset query \u2212 key = (\u22121, \u22121)), while below gets ` +
    `${bias[2]}; patch 2 wins because its content matches (x\u2080\u00b7x\u2082/\u221a2 = ${ex.no_position[0][2]}) and the ` +
    `bias adds ${bias[2]}. The same offset gets the same bias in every row: patch 1 looks at patch 3 (also below) with ` +
    `${ex.bias[1][3]}. The tutorial's matrices differ in places; these numbers are recomputed (docs/visualize.md lists the differences).`;
}

async function updateExample() {
  try {
    const ex = await getJSON("/api/image-example", {});
    showError("example", "");
    const labels = ex.coords.map((c, i) => `${i} (${c[0]},${c[1]})`);
    const all = [...ex.no_position, ...ex.absolute, ...ex.relative].flat().map(Math.abs);
    const lim = Math.max(...all), blim = Math.max(...ex.bias.flat().map(Math.abs));
    document.getElementById("example-maps").replaceChildren(
      exampleTable("content x\u1d62 and absolute p\u1d62", labels,
        ex.content.map((x, i) => [...x, ...ex.positions[i]]), (v) => diverging(v, 2), 1, ["x[0]", "x[1]", "p[0]", "p[1]"]),
      exampleTable("no positions: x\u1d62\u00b7x\u2c7c/\u221a2", labels, ex.no_position, (v) => diverging(v, lim)),
      exampleTable("absolute: (x\u1d62+p\u1d62)\u00b7(x\u2c7c+p\u2c7c)/\u221a2", labels, ex.absolute, (v) => diverging(v, lim)),
      exampleTable("relative bias b[\u0394row, \u0394col]", labels, ex.bias, (v) => diverging(v, blim)),
      exampleTable("relative: x\u1d62\u00b7x\u2c7c/\u221a2 + b", labels, ex.relative, (v) => diverging(v, lim)));
    document.getElementById("example-text").textContent = describeExample(ex);
  } catch (err) { showError("example", err.message); }
}

const imageForm = document.getElementById("image-form");
imageForm.addEventListener("input", (event) => { if (event.target.id === "image-patch") { if (image) drawImage(); } else updateImage(); });
imageForm.addEventListener("submit", (event) => { event.preventDefault(); updateImage(); });
function openImageFromHash() { if (location.hash === "#image") openView("image-view"); }
window.addEventListener("hashchange", openImageFromHash);
openImageFromHash();
updateImage(); updateExample();
