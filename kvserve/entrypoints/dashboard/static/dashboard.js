// kvserve live dashboard. Reads GET /v1/engine/state?stream=true (server-sent events, <= 10 Hz; schema in the
// README, "Dashboard") and draws the KV block pool, the scheduler queues and the SLO history. No dependencies.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  // Above this many blocks the pool is drawn on a canvas instead of one element per block: a pixel raster when the
  // snapshot has per-block states (up to the server's max_cells, 65,536), else a density strip of bins.
  const GRID_MAX_CELLS = 8192;
  const HISTORY_S = 300;
  const MAX_ROWS = { running: 64, waiting: 12 }; // table rows drawn (the snapshot may list more)
  const dpr = () => window.devicePixelRatio || 1;

  const st = {
    snap: null, pending: null, history: [], historyDirty: true,
    hues: new Map(), nextHue: 0, hoverRid: null, hoverBlock: -1,
    cells: [], cellKey: [], owner: null, ownerIdx: null, lruRank: null, rows: new Map(),
    renders: 0, connected: false, buildMsSum: 0, buildMsCount: 0,
  };
  window.kvDashboard = st; // for tests and the curious

  // ------------------------------------------------------------------------------------------ helpers
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const fmt = (v, d = 0) => (v == null || !isFinite(v) ? "–" : Number(v).toLocaleString("en-US", { maximumFractionDigits: d, minimumFractionDigits: d }));
  const pct = (v, d = 1) => (v == null ? "–" : fmt(v * 100, d) + "%");

  function hue(rid) {
    if (!st.hues.has(rid)) {
      st.hues.set(rid, Math.round((st.nextHue++ * 137.508 + 205) % 360));
      if (st.hues.size > 4000) st.hues.delete(st.hues.keys().next().value);
    }
    return st.hues.get(rid);
  }
  const colourKey = (r) => r.parent_id || r.id; // the n samples of one request share a colour
  const usedColour = (h) => `hsl(${h} 62% 55%)`;
  const sharedColour = (h) => `hsl(${h} 68% 34%)`;
  function cachedColour(rank, m) {
    const f = m > 1 ? rank / (m - 1) : 0; // 0 = evicted next (light) .. 1 = most recently freed (dark)
    return `hsl(214 24% ${Math.round(84 - 28 * f)}%)`;
  }

  // ------------------------------------------------------------------------------------------ the stream
  function authHeaders() {
    const m = /(?:^#|&)key=([^&]+)/.exec(location.hash);
    if (m) sessionStorage.setItem("kvserve-key", decodeURIComponent(m[1]));
    const key = sessionStorage.getItem("kvserve-key");
    return key ? { Authorization: "Bearer " + key } : {};
  }

  // The dot says whether data arrives, not whether a socket is open: "wait" (amber) from the connection until the
  // first snapshot, "on" (green) while snapshots arrive, "stale" (amber) after STALE_S without one, "off" (red).
  const STALE_S = 5;
  function setConn(state, text) {
    st.connected = state !== "off";
    $("conn").className = "conn " + state;
    $("conn-text").textContent = text;
  }
  setInterval(() => {
    if (!st.connected || st.lastEventAt == null) return;
    const age = (performance.now() - st.lastEventAt) / 1000;
    if (age >= STALE_S) setConn("stale", `no snapshot for ${Math.round(age)} s (a long engine step?)`);
  }, 1000);

  let backoff = 500;
  async function connect() {
    try {
      const res = await fetch("/v1/engine/state?stream=true&hz=10", {
        headers: { Accept: "text/event-stream", ...authHeaders() }, cache: "no-store",
      });
      if (!res.ok) throw new Error("HTTP " + res.status);
      st.lastEventAt = null;
      setConn("wait", "connected · waiting for the first engine step…");
      backoff = 500;
      const reader = res.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          onEvent(buf.slice(0, i));
          buf = buf.slice(i + 2);
        }
      }
      setConn("off", "stream ended, reconnecting…");
    } catch (e) {
      setConn("off", `disconnected (${e.message}), retrying…`);
    }
    setTimeout(connect, backoff);
    backoff = Math.min(backoff * 2, 5000);
  }

  function onEvent(text) {
    const data = text.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
    if (!data) return;
    const msg = JSON.parse(data);
    st.lastEventAt = performance.now();
    setConn("on", "live");
    if (msg.history && msg.history.length) {
      const last = st.history.length ? st.history[st.history.length - 1].t : -Infinity;
      for (const p of msg.history) if (p.t > last) st.history.push(p);
      const horizon = st.history[st.history.length - 1].t - HISTORY_S;
      while (st.history.length && st.history[0].t < horizon) st.history.shift();
      st.historyDirty = true;
    }
    st.pending = msg.snapshot;
    requestAnimationFrame(render);
  }

  // ------------------------------------------------------------------------------------------ render
  function render() {
    const snap = st.pending;
    if (!snap) return;
    st.pending = null;
    st.snap = snap;
    if (snap.build_ms != null) { st.buildMsSum += snap.build_ms; st.buildMsCount++; }
    renderFacts(snap);
    indexBlocks(snap);
    renderPool(snap);
    renderQueues(snap);
    renderTier(snap);
    if (st.historyDirty) { renderCharts(); st.historyDirty = false; }
    applyHover();
    st.renders++;
  }

  function renderFacts(snap) {
    const e = snap.engine, kv = snap.kv;
    const facts = [
      ["model", e.model], ["pool", `${fmt(kv.num_blocks)} blocks × ${kv.block_size} tokens`],
      ["max_num_seqs", e.max_num_seqs], ["token budget", e.max_num_batched_tokens],
      ["policy", `${e.scheduling} · ${e.scheduling_policy}`],
      ["prefix caching", e.enable_prefix_caching ? (e.kv_disk_cache_dir ? "on + disk" : "on") : "off"],
      ["spec decode", e.num_speculative_tokens ? `k=${e.num_speculative_tokens}` : "off"],
      ["snapshot", snap.build_ms == null ? "–" : `${fmt(snap.build_ms, 1)} ms`],
    ];
    $("facts").innerHTML = facts.map(([k, v]) => `<span>${esc(k)} <b>${esc(v)}</b></span>`).join("");
  }

  // owner[b]: index in snap.running of the first request whose table holds block b (-1: none listed)
  function indexBlocks(snap) {
    const n = snap.kv.num_blocks;
    if (!st.owner || st.owner.length !== n) { st.owner = new Int32Array(n); st.lruRank = new Int32Array(n); }
    st.owner.fill(-1);
    st.lruRank.fill(-1);
    st.holders = new Map(); // shared block -> [request index...]
    const shared = snap.kv.shared || {};
    snap.running.forEach((r, idx) => {
      (r.block_table || []).forEach((b) => {
        if (st.owner[b] < 0) st.owner[b] = idx;
        if (shared[b] !== undefined) {
          if (!st.holders.has(b)) st.holders.set(b, []);
          st.holders.get(b).push(idx);
        }
      });
    });
    (snap.kv.cached_lru || []).forEach((b, i) => { st.lruRank[b] = i; });
  }

  function blockColour(snap, b, s) {
    if (s === "f") return "";
    if (s === "c") return cachedColour(st.lruRank[b], snap.kv.cached_blocks);
    const idx = st.owner[b];
    if (idx < 0) return "#9aa3b2";
    const h = hue(colourKey(snap.running[idx]));
    return s === "s" ? sharedColour(h) : usedColour(h);
  }

  function renderPool(snap) {
    const kv = snap.kv, n = kv.num_blocks;
    const grid = $("pool-grid");
    $("pool-summary").innerHTML =
      `<b>${fmt(kv.used_blocks)}</b> in use (${pct(kv.kv_cache_usage_perc)}) · <b>${fmt(kv.shared_blocks)}</b> shared · ` +
      `<b>${fmt(kv.cached_blocks)}</b> cached · <b>${fmt(kv.free_blocks - kv.cached_blocks)}</b> free · ` +
      `waste <b>${pct(kv.waste)}</b>`;
    grid.dataset.seq = snap.seq;
    grid.dataset.numBlocks = n;
    grid.dataset.usedBlocks = kv.used_blocks;
    grid.dataset.usage = kv.kv_cache_usage_perc;
    const asGrid = kv.blocks !== null && n <= GRID_MAX_CELLS;
    grid.classList.toggle("hidden", !asGrid);
    $("pool-density").classList.toggle("hidden", asGrid);
    grid.dataset.mode = asGrid ? "cells" : "density";
    if (asGrid) renderGrid(snap, grid); else renderDensity(snap);
    renderLru(snap);
  }

  function renderGrid(snap, grid) {
    const kv = snap.kv, n = kv.num_blocks;
    if (st.cells.length !== n) {
      grid.textContent = "";
      const width = grid.clientWidth || 700;
      // cells about square, the whole pool within ~380 px of height, 5..24 px each
      const size = Math.max(5, Math.min(24, Math.floor(Math.sqrt((width * 380) / n)) - 2));
      grid.style.setProperty("--cell", size + "px");
      const frag = document.createDocumentFragment();
      st.cells = [];
      for (let b = 0; b < n; b++) {
        const c = document.createElement("div");
        c.className = "cell";
        c.dataset.b = b;
        frag.appendChild(c);
        st.cells.push(c);
      }
      grid.appendChild(frag);
      st.cellKey = new Array(n).fill(null);
    }
    const blocks = kv.blocks;
    for (let b = 0; b < n; b++) {
      const s = blocks[b];
      const colour = blockColour(snap, b, s);
      const key = s + colour;
      if (st.cellKey[b] === key) continue;
      st.cellKey[b] = key;
      const c = st.cells[b];
      c.className = "cell s-" + s;
      c.dataset.state = s;
      c.style.background = colour;
    }
  }

  // hsl -> [r, g, b] (0..255), for drawing pixels
  function hslRgb(h, sat, l) {
    sat /= 100; l /= 100;
    const f = (n) => { const k = (n + h / 30) % 12; return l - sat * Math.min(l, 1 - l) * Math.max(-1, Math.min(k - 3, 9 - k, 1)); };
    return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
  }
  const FREE_RGB = [236, 239, 244];

  function renderDensity(snap) {
    const kv = snap.kv, cv = $("density-canvas"), ctx = cv.getContext("2d");
    const Wcss = cv.clientWidth || 700;
    if (kv.blocks) return renderRaster(snap, cv, ctx, Wcss);
    // no per-block data (pools above the server's max_cells): stacked bars, one per bin
    const d = kv.density, bins = d.used.length, W = Wcss * dpr(), H = 96 * dpr();
    cv.style.height = "96px"; cv.style.width = ""; cv.width = W; cv.height = H;
    ctx.fillStyle = "#eceff4"; ctx.fillRect(0, 0, W, H);
    const bw = W / bins;
    for (let i = 0; i < bins; i++) {
      const size = Math.min(d.bin_size, kv.num_blocks - i * d.bin_size);
      const x = i * bw, w = Math.max(1, bw - (bw > 3 ? 1 : 0));
      let y = H;
      const seg = (f, colour) => { const h = f * H; ctx.fillStyle = colour; ctx.fillRect(x, y - h, w, h); y -= h; };
      seg(d.shared[i] / size, "hsl(214 68% 30%)");
      seg((d.used[i] - d.shared[i]) / size, "hsl(214 70% 55%)");
      seg(d.cached[i] / size, "hsl(214 14% 70%)");
    }
    axisLabels(kv.num_blocks, [0, 0.25, 0.5, 0.75, 1].map((f) => [f, Math.round(f * kv.num_blocks)]));
    cv.title = `${bins} bins of ${d.bin_size} blocks: height = fraction of the bin in use (dark: shared) and cached (grey)`;
    st.raster = null;
  }

  // one pixel cell per block, in rows (block ids left to right, top to bottom), coloured as the cell grid is
  function renderRaster(snap, cv, ctx, Wcss) {
    const kv = snap.kv, n = kv.num_blocks;
    const cell = Math.max(1, Math.min(6, Math.floor(Math.sqrt((Wcss * 300) / n))));
    const cols = Math.floor(Wcss / cell), rows = Math.ceil(n / cols);
    const img = new ImageData(cols, rows);
    const px = img.data, rgbOf = new Map();
    const hl = new Set();
    if (st.hoverRid) {
      const r = snap.running.find((x) => x.id === st.hoverRid);
      if (r && r.block_table) r.block_table.forEach((b) => hl.add(b));
    }
    const m = kv.cached_blocks;
    for (let b = 0; b < n; b++) {
      const s = kv.blocks[b];
      let rgb = FREE_RGB;
      if (s === "c") {
        const level = m > 1 ? Math.round((31 * st.lruRank[b]) / (m - 1)) : 0;
        const key = "c" + level;
        if (!rgbOf.has(key)) rgbOf.set(key, hslRgb(214, 24, 84 - (28 * level) / 31));
        rgb = rgbOf.get(key);
      } else if (s !== "f") {
        const idx = st.owner[b];
        const h = idx < 0 ? -1 : hue(colourKey(snap.running[idx]));
        const key = s + h;
        if (!rgbOf.has(key)) rgbOf.set(key, h < 0 ? [154, 163, 178] : s === "s" ? hslRgb(h, 68, 34) : hslRgb(h, 62, 55));
        rgb = rgbOf.get(key);
      }
      const o = 4 * b, fade = hl.size && !hl.has(b);
      px[o] = fade ? 255 - (255 - rgb[0]) * 0.25 : rgb[0];
      px[o + 1] = fade ? 255 - (255 - rgb[1]) * 0.25 : rgb[1];
      px[o + 2] = fade ? 255 - (255 - rgb[2]) * 0.25 : rgb[2];
      px[o + 3] = 255;
    }
    const k = dpr();
    cv.style.height = rows * cell + "px";
    cv.style.width = cols * cell + "px";
    cv.width = cols * cell * k; cv.height = rows * cell * k;
    const tmp = document.createElement("canvas");
    tmp.width = cols; tmp.height = rows;
    tmp.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(tmp, 0, 0, cols * cell * k, rows * cell * k);
    st.raster = { cell, cols };
    const perRow = cols;
    axisLabels(cols, [[0, "0"], [1, `${fmt(perRow)} blocks per row · ${fmt(rows)} rows · ${cell} px per block`]]);
    cv.title = "";
  }

  function axisLabels(_n, marks) {
    const axis = $("density-axis");
    axis.innerHTML = marks.map(([f, text]) => `<span style="left:${f * 100}%">${esc(typeof text === "number" ? fmt(text) : text)}</span>`).join("");
    axis.querySelectorAll("span").forEach((s, i, all) => {
      if (i === 0) s.style.transform = "none";
      if (i === all.length - 1) s.style.transform = "translateX(-100%)";
    });
  }

  function renderLru(snap) {
    const kv = snap.kv, cv = $("lru-canvas"), ctx = cv.getContext("2d");
    const W = cv.clientWidth * dpr(), H = 14 * dpr();
    cv.width = W; cv.height = H;
    ctx.clearRect(0, 0, W, H);
    const lru = kv.cached_lru, m = kv.cached_blocks;
    if (lru && m) {
      const w = W / m;
      for (let i = 0; i < m; i++) { ctx.fillStyle = cachedColour(i, m); ctx.fillRect(i * w, 0, Math.ceil(w), H); }
      const first = lru.slice(0, 4).map((b) => "#" + b).join(", ");
      $("lru-text").textContent = `${fmt(m)} cached · next evicted: ${first}${m > 4 ? ", …" : ""}`;
    } else {
      $("lru-text").textContent = m ? `${fmt(m)} cached blocks` : "no cached blocks";
    }
  }

  // ------------------------------------------------------------------------------------------ queues
  function progress(r) {
    const total = Math.max(1, r.prompt_tokens + r.max_tokens);
    const prompt = (100 * r.prompt_tokens) / total, fill = (100 * r.num_computed_tokens) / total;
    const h = hue(colourKey(r));
    const prefill = r.num_computed_tokens < r.prompt_tokens;
    const label = prefill ? `prefill ${fmt(r.num_computed_tokens)}/${fmt(r.prompt_tokens)}`
      : `${fmt(r.num_computed_tokens)}/${fmt(r.num_tokens)}`;
    return `<div class="prog-wrap" title="computed ${r.num_computed_tokens} of ${r.num_tokens} tokens (prompt ${r.prompt_tokens}, max_tokens ${r.max_tokens}); shaded: the prompt">` +
      `<div class="prog"><div class="p-prompt" style="width:${prompt}%"></div>` +
      `<div class="p-fill" style="width:${fill}%;background:${usedColour(h)}"></div></div>` +
      `<span class="p-text${prefill ? " prefill" : ""}">${label}</span></div>`;
  }

  function renderQueues(snap) {
    const e = snap.engine, showPrompts = !!e.show_prompts;
    $("sched-summary").innerHTML = `<b>${snap.num_running}</b> running · <b>${snap.num_waiting}</b> waiting`;
    $("running-count").textContent = `${snap.num_running} / ${e.max_num_seqs}`;
    $("waiting-count").textContent = `${snap.num_waiting}`;
    const promptCell = (r) => (showPrompts ? `<div class="prompt-text" title="${esc(r.prompt || "")}">${esc((r.prompt || "").slice(0, 80))}</div>` : "");
    const idCell = (r) => `<td class="rid" title="${esc(r.id)}${r.parent_id ? " (a sample of " + esc(r.parent_id) + ")" : ""}">${esc(r.id)}${promptCell(r)}</td>`;
    let html = snap.running.slice(0, MAX_ROWS.running).map((r) =>
      `<tr class="req" data-rid="${esc(r.id)}" data-blocks="${r.block_table ? r.block_table.join(" ") : ""}" data-computed="${r.num_computed_tokens}">` +
      `<td><i class="swatch" style="background:${usedColour(hue(colourKey(r)))}"></i></td>${idCell(r)}` +
      `<td class="num">${fmt(r.prompt_tokens)}</td><td class="num">${fmt(r.output_tokens)} / ${fmt(r.max_tokens)}</td>` +
      `<td>${progress(r)}</td><td class="num">${r.block_table ? r.block_table.length : "–"}</td>` +
      `<td class="num">${r.priority}</td><td class="num${r.num_preemptions ? " pre" : ""}">${r.num_preemptions}</td>` +
      `<td class="num">${r.spec_acceptance == null ? "–" : pct(r.spec_acceptance, 0)}</td></tr>`).join("");
    if (!snap.running.length) html = `<tr><td class="empty" colspan="9">nothing running</td></tr>`;
    const moreRunning = snap.num_running - Math.min(snap.running.length, MAX_ROWS.running);
    if (moreRunning > 0) html += `<tr><td class="more" colspan="9">+ ${moreRunning} more</td></tr>`;
    $("running-body").innerHTML = html;
    html = snap.waiting.slice(0, MAX_ROWS.waiting).map((r) =>
      `<tr class="req" data-rid="${esc(r.id)}"><td><i class="swatch" style="background:#c3cad6"></i></td>${idCell(r)}` +
      `<td class="num">${fmt(r.prompt_tokens)}</td><td class="${r.status === "preempted" ? "pre" : ""}">${esc(r.status)}</td>` +
      `<td class="num">${r.priority}</td><td class="num${r.num_preemptions ? " pre" : ""}">${r.num_preemptions}</td>` +
      `<td class="num">${fmt(r.age_s, 1)} s</td></tr>`).join("");
    if (!snap.waiting.length) html = `<tr><td class="empty" colspan="7">queue empty</td></tr>`;
    const moreWaiting = snap.num_waiting - Math.min(snap.waiting.length, MAX_ROWS.waiting);
    if (moreWaiting > 0) html += `<tr><td class="more" colspan="7">+ ${moreWaiting} more waiting</td></tr>`;
    $("waiting-body").innerHTML = html;
  }

  // the disk tier's counters (snap.kv_tier; null: no tier, the panel stays hidden)
  function renderTier(snap) {
    const t = snap.kv_tier, panel = $("tier-panel");
    panel.classList.toggle("hidden", !t);
    if (!t) return;
    const mib = (b) => `${fmt(b / 1048576, 1)} MiB`;
    $("tier-summary").innerHTML = `<b>${pct(t.hit_rate)}</b> of looked-up blocks loaded · ` +
      `<b>${t.num_loading}</b> loading · writes <b>${t.write_enabled ? "on" : "off"}</b>`;
    const rows = [
      ["blocks looked up / loaded / missed", `${fmt(t.lookups)} / ${fmt(t.hits)} / ${fmt(t.misses)}`],
      ["bad entries (recomputed)", fmt(t.bad_entries)],
      ["read / written", `${mib(t.bytes_read)} / ${mib(t.bytes_written)}`],
      ["blocks written / dropped", `${fmt(t.blocks_written)} / ${fmt(t.writes_dropped)}`],
      ["loads, mean time", `${fmt(t.loads)}, ${t.mean_load_ms == null ? "–" : fmt(t.mean_load_ms, 1) + " ms"}`],
      ["on disk / budget", `${mib(t.bytes_on_disk)} / ${mib(t.capacity_bytes)}`],
    ];
    $("tier-body").innerHTML = rows.map(([k, v]) => `<tr><td>${esc(k)}</td><td class="num">${esc(v)}</td></tr>`).join("");
  }

  // ------------------------------------------------------------------------------------------ hover
  function applyHover() {
    const snap = st.snap;
    if (!snap) return;
    const grid = $("pool-grid");
    grid.querySelectorAll(".cell.hl").forEach((c) => c.classList.remove("hl"));
    document.querySelectorAll("tr.req.hl").forEach((t) => t.classList.remove("hl"));
    const r = st.hoverRid && snap.running.find((x) => x.id === st.hoverRid);
    grid.classList.toggle("dim", !!(r && r.block_table));
    if (r && r.block_table) r.block_table.forEach((b) => st.cells[b] && st.cells[b].classList.add("hl"));
    if (st.hoverRid) {
      const row = document.querySelector(`tr.req[data-rid="${CSS.escape(st.hoverRid)}"]`);
      if (row) row.classList.add("hl");
    }
    if (grid.dataset.mode === "density" && st.hoverRid) renderDensity(snap);
  }

  function showTip(html, ev) {
    const tip = $("tip");
    tip.innerHTML = html;
    tip.classList.remove("hidden");
    const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    const y = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  const hideTip = () => $("tip").classList.add("hidden");

  function describeBlock(b) {
    const snap = st.snap, kv = snap.kv, s = kv.blocks[b];
    let html = `<b>block ${b}</b> · `;
    if (s === "f") return html + "free";
    if (s === "c") return html + `cached, evictable (ref_cnt 0)<br>#${st.lruRank[b] + 1} of ${kv.cached_blocks} in eviction order`;
    const idx = st.owner[b];
    if (s === "s") {
      const who = (st.holders.get(b) || []).map((i) => esc(snap.running[i].id));
      return html + `shared prefix · <b>ref_cnt ${kv.shared[b]}</b><br>held by ${who.slice(0, 6).join(", ")}${who.length > 6 ? ", …" : ""}`;
    }
    if (idx < 0) return html + "in use (request not listed)";
    const r = snap.running[idx], logical = r.block_table.indexOf(b);
    const filled = Math.max(0, Math.min(kv.block_size, r.num_computed_tokens - logical * kv.block_size));
    return html + `in use by <b>${esc(r.id)}</b><br>logical block ${logical + 1} of ${r.block_table.length} · ${filled}/${kv.block_size} slots computed`;
  }

  function setupHover() {
    const grid = $("pool-grid");
    grid.addEventListener("mousemove", (ev) => {
      const b = ev.target.dataset && ev.target.dataset.b;
      if (b === undefined || !st.snap || !st.snap.kv.blocks) return hideTip();
      const idx = st.owner[+b];
      const rid = idx >= 0 ? st.snap.running[idx].id : null;
      if (rid !== st.hoverRid) { st.hoverRid = rid; applyHover(); }
      showTip(describeBlock(+b), ev);
    });
    grid.addEventListener("mouseleave", () => { st.hoverRid = null; applyHover(); hideTip(); });
    const cv = $("density-canvas");
    cv.addEventListener("mousemove", (ev) => {
      if (!st.raster || !st.snap || !st.snap.kv.blocks) return hideTip();
      const rect = cv.getBoundingClientRect(), { cell, cols } = st.raster;
      const col = Math.floor((ev.clientX - rect.left) / cell), row = Math.floor((ev.clientY - rect.top) / cell);
      const b = row * cols + col;
      if (col >= cols || b < 0 || b >= st.snap.kv.num_blocks) return hideTip();
      const idx = st.owner[b];
      const rid = idx >= 0 ? st.snap.running[idx].id : null;
      if (rid !== st.hoverRid) { st.hoverRid = rid; applyHover(); }
      showTip(describeBlock(b), ev);
    });
    cv.addEventListener("mouseleave", () => { st.hoverRid = null; applyHover(); hideTip(); });
    for (const id of ["running-body", "waiting-body"]) {
      const body = $(id);
      body.addEventListener("mouseover", (ev) => {
        const tr = ev.target.closest("tr.req");
        const rid = tr ? tr.dataset.rid : null;
        if (rid !== st.hoverRid) { st.hoverRid = rid; applyHover(); }
      });
      body.addEventListener("mouseleave", () => { st.hoverRid = null; applyHover(); });
    }
  }

  // ------------------------------------------------------------------------------------------ charts
  const P = ["#2f6fed", "#8b5cf6", "#d64545"];
  const q = (k, i, scale = 1) => (p) => (p[k] ? p[k][i] * scale : null);
  const CHARTS = [
    { id: "ttft", title: "Time to first token", unit: "ms", series: [["p50", q("ttft_ms", 0)], ["p90", q("ttft_ms", 1)], ["p99", q("ttft_ms", 2)]] },
    { id: "itl", title: "Inter-token latency", unit: "ms", series: [["p50", q("itl_ms", 0)], ["p90", q("itl_ms", 1)], ["p99", q("itl_ms", 2)]] },
    { id: "e2e", title: "End-to-end latency", unit: "s", digits: 2, series: [["p50", q("e2e_ms", 0, 1e-3)], ["p90", q("e2e_ms", 1, 1e-3)], ["p99", q("e2e_ms", 2, 1e-3)]] },
    { id: "tput", title: "Throughput", unit: "tok/s", series: [["output", (p) => p.output_tok_s], ["prompt (admitted)", (p) => p.prompt_tok_s]], colours: ["#2f6fed", "#9aa5bd"] },
    { id: "kv", title: "KV cache", unit: "%", max: 100, series: [["usage", (p) => p.kv_usage * 100], ["waste", (p) => (p.kv_waste == null ? null : p.kv_waste * 100)]], colours: ["#2f6fed", "#d9822b"] },
    { id: "prefix", title: "Prefix-cache hit rate", unit: "%", max: 100, off: (e) => !e.enable_prefix_caching && "prefix caching off", series: [["hit rate", (p) => (p.prefix_hit_rate == null ? null : p.prefix_hit_rate * 100)]], colours: ["#1f9d6b"] },
    { id: "preempt", title: "Preemptions", unit: "/s", digits: 1, bars: true, series: [["preemptions", (p) => (p.dt > 0 ? p.preemptions / p.dt : 0)]], colours: ["#d64545"] },
    { id: "spec", title: "Draft acceptance", unit: "%", max: 100, off: (e) => !e.num_speculative_tokens && "speculative decoding off", series: [["accepted", (p) => (p.spec_acceptance == null ? null : p.spec_acceptance * 100)]], colours: ["#8b5cf6"] },
    { id: "queues", title: "Queues", unit: "requests", series: [["running", (p) => p.running], ["waiting", (p) => p.waiting]], colours: ["#2f6fed", "#d9822b"] },
    { id: "errors", title: "HTTP errors", unit: "/s", digits: 1, bars: true, series: [["4xx", (p) => (p.dt > 0 ? (p.http_4xx || 0) / p.dt : 0)], ["5xx", (p) => (p.dt > 0 ? (p.http_5xx || 0) / p.dt : 0)]], colours: ["#d9822b", "#d64545"] },
  ];

  function setupCharts() {
    $("charts").innerHTML = CHARTS.map((c) => {
      const colours = c.colours || P;
      const keys = c.series.map(([name], i) => `<span><i style="background:${colours[i]}"></i>${esc(name)}</span>`).join("");
      return `<div class="chart" id="chart-${c.id}"><div class="chart-head"><span class="chart-title">${esc(c.title)}</span>` +
        `<span class="chart-value" id="val-${c.id}"></span></div><canvas id="cv-${c.id}"></canvas>` +
        `<div class="chart-keys">${keys}</div></div>`;
    }).join("");
  }

  function short(v) { // axis labels: 0, 2.5, 40, 1.5k, 20k, 3M
    if (v >= 1e6) return fmt(v / 1e6, v % 1e6 ? 1 : 0) + "M";
    if (v >= 1e3) return fmt(v / 1e3, v % 1e3 ? 1 : 0) + "k";
    return fmt(v, v % 1 ? 1 : 0);
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const e = Math.pow(10, Math.floor(Math.log10(v))), m = v / e;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * e;
  }

  function renderCharts() {
    const hist = st.history, engine = st.snap ? st.snap.engine : {};
    const tEnd = hist.length ? hist[hist.length - 1].t : Date.now() / 1000;
    // the x axis spans the data there is: at least a minute, at most HISTORY_S
    const span = Math.min(HISTORY_S, Math.max(60, hist.length ? tEnd - hist[0].t : 0)), tStart = tEnd - span;
    const spanText = span >= 120 ? `−${fmt(span / 60, span % 60 ? 1 : 0)} min` : `−${Math.round(span)} s`;
    for (const c of CHARTS) {
      const cv = $("cv-" + c.id), ctx = cv.getContext("2d");
      const W = cv.clientWidth * dpr(), H = 96 * dpr(), k = dpr();
      cv.width = W; cv.height = H;
      const colours = c.colours || P;
      const off = c.off && c.off(engine);
      const values = c.series.map(([, f]) => hist.map((p) => { const v = f(p); return v == null || !isFinite(v) ? null : v; }));
      let vmax = 0;
      values.forEach((vs) => vs.forEach((v) => { if (v != null && v > vmax) vmax = v; }));
      let unit = c.unit, digits = c.digits;
      if (unit === "ms" && vmax >= 2000) { // long latencies read better in seconds
        values.forEach((vs) => vs.forEach((v, i) => { if (v != null) vs[i] = v / 1000; }));
        vmax /= 1000; unit = "s"; digits = 2;
      }
      const ymax = c.max ? Math.max(c.max * (vmax > c.max ? vmax / c.max : 1), 1) : niceMax(vmax * 1.1);
      const L = 34 * k, R = 4 * k, T = 6 * k, B = 14 * k;
      const x = (t) => L + ((t - tStart) / span) * (W - L - R);
      const y = (v) => H - B - (v / ymax) * (H - T - B);
      ctx.clearRect(0, 0, W, H);
      ctx.font = `${10 * k}px system-ui, sans-serif`;
      ctx.textBaseline = "middle";
      for (const f of [0, 0.5, 1]) { // gridlines and y labels
        ctx.strokeStyle = f ? "#eef0f4" : "#d5dae3";
        ctx.lineWidth = k;
        ctx.beginPath(); ctx.moveTo(L, y(f * ymax)); ctx.lineTo(W - R, y(f * ymax)); ctx.stroke();
        ctx.fillStyle = "#8a93a6";
        ctx.textAlign = "right";
        ctx.fillText(short(f * ymax), L - 4 * k, y(f * ymax));
      }
      ctx.textAlign = "center";
      ctx.textBaseline = "alphabetic";
      ctx.textAlign = "left"; ctx.fillText(spanText, L, H - 2 * k);
      ctx.textAlign = "right"; ctx.fillText("now", W - R, H - 2 * k);
      if (off) {
        ctx.fillStyle = "#9aa3b2"; ctx.textAlign = "center"; ctx.textBaseline = "middle";
        ctx.fillText(off, (L + W) / 2, (H - B) / 2);
        $("val-" + c.id).textContent = "";
        continue;
      }
      values.forEach((vs, si) => {
        ctx.strokeStyle = ctx.fillStyle = colours[si];
        ctx.lineWidth = 1.6 * k;
        if (c.bars) {
          hist.forEach((p, i) => {
            if (vs[i]) { const bw = Math.max(k, ((p.dt || 1) / span) * (W - L - R) - k); ctx.fillRect(x(p.t) - bw, y(vs[i]), bw, y(0) - y(vs[i])); }
          });
          return;
        }
        ctx.beginPath();
        let pen = false;
        hist.forEach((p, i) => {
          const v = vs[i], gap = i > 0 && p.t - hist[i - 1].t > 3 * Math.max(1, p.dt);
          if (v == null || gap) pen = false;
          if (v == null) return;
          if (pen) ctx.lineTo(x(p.t), y(v)); else ctx.moveTo(x(p.t), y(v));
          pen = true;
        });
        ctx.stroke();
      });
      const parts = c.series.map(([name], si) => {
        const vs = values[si];
        let v = null;
        for (let i = vs.length - 1; i >= 0 && v == null; i--) v = vs[i];
        return `${esc(name)} <b>${fmt(v, digits || (v != null && v < 10 ? 1 : 0))}</b>`;
      });
      $("val-" + c.id).innerHTML = parts.slice(0, 3).join(" · ") + ` ${esc(unit)}`;
    }
  }

  // ------------------------------------------------------------------------------------------ start
  setupCharts();
  setupHover();
  window.addEventListener("resize", () => { st.cells = []; st.historyDirty = true; if (st.snap) { st.pending = st.snap; render(); } });
  connect();
})();
