// kvflow live dashboard: draws the snapshots that /dashboard/stream pushes (no libraries).
"use strict";

const $ = (id) => document.getElementById(id);
const css = getComputedStyle(document.documentElement);
const color = (name) => css.getPropertyValue(name).trim();
const state = { body: null, clockOffset: 0 };
window.kvflow = state; // for the curious (and the browser test)

// A request keeps its colour for its whole life; successive requests step round the colour
// wheel by the golden angle, so that requests running together look different.
const hues = new Map();
let nextHue = 0;
function colorFor(id) {
  if (!hues.has(id)) {
    if (hues.size > 4096) hues.clear(); // long-gone requests; colours restart
    hues.set(id, (nextHue++ * 137.508) % 360);
  }
  return `hsl(${hues.get(id).toFixed(0)}, 65%, 50%)`;
}

function fitCanvas(canvas, height) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 560;
  canvas.style.height = height + "px";
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return { ctx, w, h: height };
}

// -- queues ----------------------------------------------------------------------------
function bar(kind, done, total) {
  const pct = total > 0 ? Math.min(100, (100 * done) / total) : 0;
  return `<div class="bar ${kind}"><i style="width:${pct.toFixed(1)}%"></i><span>${done} / ${total}</span></div>`;
}

// "cmpl-54348f0066894edb88...-0" -> "54348f00-0": enough to tell requests apart at a glance.
const shortId = (id) => {
  const m = id.match(/^(?:chat)?(?:cmpl-)?(.*?)(-\d+)?$/);
  return m[1].slice(0, 8) + (m[2] || "");
};
const esc = (s) => s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function renderQueue(el, reqs, running) {
  el.innerHTML = reqs.map((r) => `
    <div class="req" data-id="${esc(r.id)}" title="${esc(r.id)}${r.preempted ? ` (preempted ${r.preempted}x)` : ""}">
      <i class="swatch" style="background:${running ? colorFor(r.id) : "transparent"}"></i>
      <span class="id">${esc(shortId(r.id))}</span>
      ${bar("prompt", r.computed, r.prompt)}
      ${bar("output", r.output, r.max_tokens)}
      <span class="blocks">${running ? r.blocks + " blk" : r.preempted ? "preempted" : ""}</span>
    </div>`).join("");
}

// -- tokens per step -------------------------------------------------------------------
function renderSteps(snap) {
  const { ctx, w, h } = fitCanvas($("steps"), 180);
  const steps = snap.steps; // [step, prefill, decode, image tokens encoded (of prefill)]
  const used = steps.map((s) => s[1] + s[2]);
  const top = Math.min(snap.budget, Math.max(8, ...used) * 1.2);
  const pad = { l: 36, r: 6, t: 10, b: 18 };
  const ph = h - pad.t - pad.b, pw = w - pad.l - pad.r;
  const y = (v) => pad.t + ph - (ph * v) / top;
  ctx.font = "10px sans-serif";
  ctx.fillStyle = color("--muted");
  ctx.fillText(String(Math.round(top)), 2, pad.t + 4);
  ctx.fillText("0", 2, h - pad.b);
  const slot = pw / 120;
  steps.forEach((s, i) => {
    const x = pad.l + pw - (steps.length - i) * slot;
    ctx.fillStyle = color("--decode");
    ctx.fillRect(x, y(s[2]), Math.max(1, slot - 1), y(0) - y(s[2]));
    ctx.fillStyle = color("--prefill");
    ctx.fillRect(x, y(s[1] + s[2]), Math.max(1, slot - 1), y(s[2]) - y(s[1] + s[2]));
    if (s[3]) { // the prefill's image tokens, whose encoder ran this step
      ctx.fillStyle = color("--encoder");
      ctx.fillRect(x, y(s[2] + s[3]), Math.max(1, slot - 1), y(s[2]) - y(s[2] + s[3]));
    }
  });
  ctx.strokeStyle = color("--budget");
  ctx.fillStyle = color("--budget");
  if (top >= snap.budget) {
    ctx.beginPath(); ctx.moveTo(pad.l, y(snap.budget)); ctx.lineTo(w - pad.r, y(snap.budget)); ctx.stroke();
  } else {
    ctx.fillText(`budget ${snap.budget} above ↑`, w - pad.r - 110, pad.t + 4);
  }
  if (steps.length) {
    ctx.fillStyle = color("--muted");
    ctx.fillText(`step ${steps[0][0]}`, pad.l, h - 4);
    ctx.fillText(`step ${steps[steps.length - 1][0]}`, w - pad.r - 60, h - 4);
  }
  const last = used.length ? used[used.length - 1] : 0;
  const encoded = steps.length ? steps[steps.length - 1][3] || 0 : 0;
  $("budget").textContent = `budget ${snap.budget} · last step ${last} tokens` +
    (encoded ? ` (${encoded} image tokens encoded)` : "");
}

// -- block map -------------------------------------------------------------------------
function renderBlocks(snap) {
  const owners = snap.block_owners, n = owners.length, L = snap.legend;
  const canvas = $("blocks");
  const w = canvas.clientWidth || 560;
  const cols = Math.max(1, Math.ceil(Math.sqrt((n * w) / 200)));
  const cell = Math.max(2, Math.floor(w / cols));
  const rows = Math.ceil(n / cols);
  const { ctx } = fitCanvas(canvas, Math.max(cell, rows * cell));
  const ownerColors = snap.running.map((r) => colorFor(r.id));
  const gap = cell >= 6 ? 1 : 0, s = cell - gap;
  // Cached-free and shared blocks get a mark as well as a colour (where cells are big enough
  // to show one), so that no request's hue can be mistaken for them.
  const mark = s >= 6 ? Math.round(s / 5) : 0;
  let used = 0, shared = 0, cached = 0;
  for (let b = 0; b < n; b++) {
    const o = owners[b], x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
    if (o >= L.owner_base) {
      used++;
      ctx.fillStyle = ownerColors[o - L.owner_base];
      ctx.fillRect(x, y, s, s);
    } else if (o === L.shared) {
      used++; shared++;
      ctx.fillStyle = color("--shared");
      ctx.fillRect(x, y, s, s);
      if (mark) { // a thin white square inside
        ctx.strokeStyle = "#fff";
        ctx.strokeRect(x + mark + 0.5, y + mark + 0.5, s - 2 * mark - 1, s - 2 * mark - 1);
      }
    } else if (o === L.held) { // shared, but per-request cache hits are not shown
      used++;
      ctx.fillStyle = color("--held");
      ctx.fillRect(x, y, s, s);
    } else if (o === L.cached_free) {
      cached++;
      ctx.fillStyle = color("--free");
      ctx.fillRect(x, y, s, s);
      ctx.fillStyle = color("--cached");
      ctx.fillRect(x + mark, y + mark, s - 2 * mark, s - 2 * mark);
    } else {
      ctx.fillStyle = color("--free");
      ctx.fillRect(x, y, s, s);
    }
  }
  const summary = $("block-summary");
  summary.textContent = `${n} blocks × ${snap.block_size} tokens · used ${used} · shared ${shared} · cached ${cached} · free ${n - used}`;
  summary.dataset.used = used;
  summary.dataset.cached = cached;
}

// -- latency ---------------------------------------------------------------------------
function median(xs) {
  if (!xs.length) return null;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
}

function renderLatency() {
  const body = state.body;
  if (!body) return;
  const now = Date.now() / 1000 - state.clockOffset; // server clock
  const pts = body.latencies.filter((p) => now - p[0] <= 60);
  const { ctx, w, h } = fitCanvas($("latency"), 180);
  const pad = { l: 44, r: 6, t: 10, b: 18 };
  const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
  const top = Math.max(0.01, ...pts.map((p) => Math.max(p[1], p[2] || 0))) * 1.15;
  const x = (t) => pad.l + pw - (pw * (now - t)) / 60;
  const y = (v) => pad.t + ph - (ph * v) / top;
  ctx.font = "10px sans-serif";
  ctx.fillStyle = color("--muted");
  ctx.fillText(`${(top * 1000).toFixed(0)} ms`, 2, pad.t + 4);
  ctx.fillText("0", 2, h - pad.b);
  ctx.fillText("-60 s", pad.l, h - 4);
  ctx.fillText("now", w - pad.r - 20, h - 4);
  ctx.strokeStyle = color("--line");
  ctx.strokeRect(pad.l, pad.t, pw, ph);
  const dot = (t, v, c) => {
    ctx.fillStyle = c; ctx.beginPath(); ctx.arc(x(t), y(v), 3, 0, 2 * Math.PI); ctx.fill();
  };
  for (const p of pts) {
    dot(p[0], p[1], color("--ttft"));
    if (p[2] !== null) dot(p[0], p[2], color("--itl"));
  }
  const ttft = median(pts.map((p) => p[1]));
  const itl = median(pts.filter((p) => p[2] !== null).map((p) => p[2]));
  const ms = (v) => (v === null ? "–" : `${(v * 1000).toFixed(0)} ms`);
  $("latency-summary").textContent = `${pts.length} finished · median TTFT ${ms(ttft)} · median ITL ${ms(itl)}`;
}

// -- KV transfers (with --kv-transfer-config) ----------------------------------------------
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function renderTransfers(kt) {
  $("transfer-panel").hidden = !kt;
  if (!kt) return;
  const p = kt.prefill, d = kt.decode;
  $("tx-sent-count").textContent = `${p.pulls_served} pulls served`;
  $("tx-sent-active").textContent = `leases: ${p.leases_active}`;
  $("tx-sent-blocks").textContent = p.blocks_sent;
  $("tx-sent-bytes").textContent = bytes(p.bytes_sent);
  $("tx-sent-other").textContent =
    `${p.leases_granted} lent · ${p.leases_released} released · ${p.leases_expired} expired`;
  $("tx-recv-count").textContent = `${d.loads_done} done · ${d.loads_failed} failed`;
  $("tx-recv-active").textContent = `pulls: ${d.loads_active}`;
  $("tx-recv-blocks").textContent = d.blocks_received;
  $("tx-recv-bytes").textContent = bytes(d.bytes_received);
  $("tx-recv-latency").textContent =
    d.mean_load_s === null ? "–" : `${(d.mean_load_s * 1000).toFixed(1)} ms`;
  $("tx-recv-other").textContent = `${d.late_frames} late frames`;
}

// -- the stream ------------------------------------------------------------------------
function render(body) {
  state.body = body;
  state.clockOffset = Date.now() / 1000 - body.time;
  $("model").textContent = body.model;
  const snap = body.snapshot;
  if (snap) {
    $("step").textContent = `step ${snap.step}`;
    $("running-count").textContent = snap.running.length;
    $("waiting-count").textContent = snap.num_waiting;
    renderQueue($("running"), snap.running, true);
    renderQueue($("waiting"), snap.waiting, false);
    renderSteps(snap);
    renderBlocks(snap);
  }
  renderLatency();
  renderTransfers(body.kv_transfer);
}

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + cls;
}

const source = new EventSource("/dashboard/stream");
source.onopen = () => setStatus("live", "live");
source.onerror = () => setStatus("disconnected, retrying…", "down");
source.onmessage = (e) => {
  const body = JSON.parse(e.data);
  setStatus(body.engine_dead ? "engine stopped" : "live", body.engine_dead ? "down" : "live");
  render(body);
};
setInterval(renderLatency, 1000); // points drift left even when nothing new arrives
