// llmgw fabric page: the fabric drawn on one <canvas> from /api/v1/fabrics/{id}/topology, with
// traffic from /admin/fabrics/{id}/ports.json. Written for this page (no library, no build step).
//
// Layout: switches in rows by tier (core on top, leaves lowest), adapters in a row under their
// leaf, ordered by rail group; switches above the leaves sorted by where their cables go, so
// pods stay together. Parallel cables between two switches are one bundle (thicker, "×N").
// Colour: by rate (one colour per rate the fabric runs), or by rail; a degraded cable is red with
// a marker at its middle; an adapter whose port is not ACTIVE glows red. Traffic: particles run
// along each adapter's cable, as many and as fast as its send and receive rates (deltas of the
// byte counters between two readings) fill the cable.
//
// Fluid on the largest fabrics: cables are batched into one Path2D per colour and width, built
// once per layout in world coordinates and stroked under the view's transform; nodes outside the
// view are not drawn; a frame is drawn only when something moved (or particles run).
// Everything peers wrote (descriptions, names) is drawn with fillText or set as textContent:
// never parsed as HTML.
"use strict";
(function () {
  const fabricId = document.body.dataset.fabric;
  const canvas = document.getElementById("fabric-canvas");
  // Opaque: the compositor copies the canvas without blending it over the page.
  const ctx = canvas.getContext("2d", { alpha: false });
  const BACKGROUND = "#0f1419";
  const stage = document.getElementById("fabric-stage");
  const message = document.getElementById("fabric-message");
  const counts = document.getElementById("fabric-counts");
  const legend = document.getElementById("fabric-legend");
  const panel = document.getElementById("fabric-panel");
  const panelBody = document.getElementById("fabric-panel-body");
  const search = document.getElementById("fabric-search");
  const railBox = document.getElementById("fabric-rails");
  const REFRESH_MS = 15000, PORTS_MS = 5000;
  const RED = "#f85149", FADE = 0.1;
  // One colour per rate band, the same on every fabric: up to 10, 40, 56, 100, 200, 400, 800 Gb/s, more.
  const RATE_BANDS = [10, 40, 56, 100, 200, 400, 800, Infinity];
  const RATE_COLOURS = ["#8b949e", "#d2a8ff", "#79c0ff", "#56d4dd", "#3fb950", "#58a6ff", "#e3b341", "#f0883e"];
  const RAIL_COLOURS = ["#58a6ff", "#3fb950", "#e3b341", "#d2a8ff", "#56d4dd", "#f0883e", "#ff7b72", "#a5d6ff"];
  const AW = 14, LEAF_GAP = 48, MAX_PARTICLES = 6000;

  const api = window.llmgwFabric = {
    ready: false, switches: 0, adapters: 0, cables: 0, bundles: 0, degraded: 0, frames: 0, refreshes: 0,
    selected: null, error: "",
    timing: { scene: 0, blit: 0, overlay: 0, n: 0 }, // ms spent in each part of draw(), for bench-admin
    markers: () => markerPositions(),
    screenOf: (key) => { const n = model && model.byKey.get(key); return n ? toScreen(n.x, n.y) : null; },
    search: (q) => find(q),
    fit: () => fit(),
    refresh: () => loadTopology(), // what the 15 s timer does, at once
    view: () => ({ ...view }),
    // Draw the next frame whole (the scene too), as after a gesture rests: for bench-admin.
    invalidate: () => { scene.key = ""; shown.key = ""; dirty = true; },
  };

  let model = null;        // the laid-out topology
  let topoStamp = "";      // what the last topology was (discovered_at + size): re-laid out only on change
  let ports = null, lastPorts = null; // the two latest ports documents, for rates
  const rates = new Map(); // "guid:port" → {tx, rx} bytes/s
  const view = { scale: 1, tx: 0, ty: 0, fitted: false };
  let hover = -1, selected = -1, dirty = true, byRail = false;
  let width = 0, height = 0, dpr = 1;

  // -- data ------------------------------------------------------------------------------------

  async function getJson(path) {
    const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
    if (!response.ok) {
      let why = "HTTP " + response.status;
      try { why = (await response.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(why);
    }
    return response.json();
  }

  async function loadTopology() {
    try {
      const topo = await getJson("/api/v1/fabrics/" + encodeURIComponent(fabricId) + "/topology");
      // What the picture depends on (not when it was discovered: that changes every discovery):
      // the counts, and which cables are degraded.
      const stamp = JSON.stringify([topo.summary, topo.links.length,
        topo.links.filter((l) => l.degraded).map((l) => l.a.guid + ":" + l.a.port + "-" + l.b.guid + ":" + l.b.port)]);
      api.refreshes += 1;
      if (stamp !== topoStamp) {
        topoStamp = stamp;
        const keep = selected >= 0 ? model.nodes[selected].key : null;
        model = layout(topo);
        markDown();
        computeFlows();
        hover = -1;
        selected = keep !== null && model.byKey.has(keep) ? model.byKey.get(keep).i : -1;
        if (!view.fitted) fit();
        describe();
        if (selected >= 0) openPanel(selected);
      }
      message.textContent = "";
      api.ready = true;
      dirty = true;
    } catch (err) {
      api.error = err.message;
      message.textContent = "cannot load the topology: " + err.message + " (retrying every 15 s)";
    }
  }

  async function loadPorts() {
    try {
      const doc = await getJson("/admin/fabrics/" + encodeURIComponent(fabricId) + "/ports.json");
      lastPorts = ports;
      ports = doc;
      if (lastPorts && ports.at > lastPorts.at) {
        const dt = ports.at - lastPorts.at;
        for (const [key, now] of Object.entries(ports.ports)) {
          const before = lastPorts.ports[key];
          if (!before || now.xmit_bytes == null || before.xmit_bytes == null) continue;
          rates.set(key, { tx: Math.max(0, now.xmit_bytes - before.xmit_bytes) / dt,
                           rx: Math.max(0, now.rcv_bytes - before.rcv_bytes) / dt });
        }
      }
      markDown();
      computeFlows();
      dirty = true;
      if (selected >= 0) openPanel(selected);
    } catch (_) { /* the topology's message says what is wrong */ }
  }

  // -- layout ----------------------------------------------------------------------------------

  // "MF0;leaf-g1-r0:MQM9700/U1" → "leaf-g1-r0" (the switch's name between the firmware's
  // prefix and its model); any other description as it is.
  function shortName(description) {
    const m = /^[^;]*;([^:]+):/.exec(description || "");
    return m ? m[1] : (description || "");
  }

  function natural(a, b) { return a.localeCompare(b, undefined, { numeric: true, sensitivity: "base" }); }

  function layout(topo) {
    const nodes = [], byKey = new Map();
    const add = (n) => { n.i = nodes.length; nodes.push(n); byKey.set(n.key, n); return n; };
    let maxLevel = 0;
    for (const s of topo.switches) {
      maxLevel = Math.max(maxLevel, s.level);
      add({ kind: "switch", key: s.guid, label: shortName(s.description) || s.guid, level: s.level, data: s, x: 0,
            y: 0, bundles: [], rail: -1 });
    }
    const devices = [...new Set(topo.adapters.map((a) => a.device || ""))].sort(natural);
    for (const a of topo.adapters) {
      const label = a.node ? (a.node + " " + a.device).trim() : (a.description || a.guid);
      add({ kind: "adapter", key: a.guid, label, data: a, x: 0, y: 0, bundles: [], leaf: null,
            rail: devices.indexOf(a.device || "") });
    }
    // Cables, bundled by the pair of nodes they join.
    const bundles = [], pair = new Map();
    let hidden = 0;
    topo.links.forEach((link) => {
      const a = byKey.get(link.a.guid), b = byKey.get(link.b.guid);
      if (!a || !b || a === b) { hidden += 1; return; }
      const key = Math.min(a.i, b.i) + "-" + Math.max(a.i, b.i);
      let bundle = pair.get(key);
      if (!bundle) {
        bundle = { i: bundles.length, a, b, links: [], degraded: false, rate: link.rate_gbps, host: false };
        pair.set(key, bundle); bundles.push(bundle); a.bundles.push(bundle); b.bundles.push(bundle);
      }
      bundle.links.push(link);
      bundle.degraded = bundle.degraded || link.degraded;
      bundle.rate = Math.max(bundle.rate, link.rate_gbps);
      if (a.kind === "adapter" || b.kind === "adapter") {
        bundle.host = true;
        const adapter = a.kind === "adapter" ? a : b, other = a.kind === "adapter" ? b : a;
        if (other.kind === "switch" && !adapter.leaf) adapter.leaf = other;
      }
    });
    // Rows: leaves (level 0) just above the adapters, core on top, unreached above everything.
    const rowOf = (n) => n.kind === "adapter" ? 0 : (n.level < 0 ? maxLevel + 2 : n.level + 1);
    const rows = maxLevel + (topo.switches.some((s) => s.level < 0) ? 3 : 2);
    // Leaves in rail-group order (the rails list), then the rest by name; adapters under each.
    const leafOrder = [];
    const seen = new Set();
    for (const rail of topo.rails || []) {
      for (const guid of rail.leaves) {
        const n = byKey.get(guid);
        if (n && !seen.has(n)) { seen.add(n); leafOrder.push(n); }
      }
    }
    nodes.filter((n) => n.kind === "switch" && n.level === 0 && !seen.has(n))
      .sort((p, q) => natural(p.label, q.label)).forEach((n) => leafOrder.push(n));
    const railOfLeaf = new Map();
    for (const rail of topo.rails || []) for (const guid of rail.leaves) railOfLeaf.set(guid, devices.indexOf(rail.rail));
    const under = new Map(leafOrder.map((n) => [n, []]));
    const loose = [];
    for (const n of nodes) {
      if (n.kind !== "adapter") continue;
      if (n.leaf && under.has(n.leaf)) under.get(n.leaf).push(n); else loose.push(n);
    }
    let x = 0;
    for (const leaf of leafOrder) {
      const list = under.get(leaf).sort((p, q) => natural(p.label, q.label));
      const start = x;
      for (const n of list) { n.x = x; x += AW; }
      if (!list.length) x += AW;
      leaf.x = (start + x - AW) / 2;
      leaf.rail = railOfLeaf.has(leaf.key) ? railOfLeaf.get(leaf.key) : -1;
      x += LEAF_GAP;
    }
    loose.sort((p, q) => natural(p.label, q.label)).forEach((n) => { n.x = x; x += AW; });
    const W = Math.max(x, AW * 8);
    // Every tier above: sorted by the mean x of what it cables to below, spread over the width.
    for (let row = 2; row <= rows - 1; row++) {
      const tier = nodes.filter((n) => n.kind === "switch" && rowOf(n) === row);
      for (const n of tier) {
        const below = n.bundles.map((b) => (b.a === n ? b.b : b.a)).filter((m) => rowOf(m) < row && m.kind === "switch");
        n.order = below.length ? below.reduce((s, m) => s + m.x, 0) / below.length : W / 2;
      }
      tier.sort((p, q) => p.order - q.order || natural(p.label, q.label));
      tier.forEach((n, k) => { n.x = (k + 0.5) * W / tier.length; });
    }
    const rowHeight = Math.max(160, W * 0.5 / rows);
    for (const n of nodes) n.y = -rowOf(n) * rowHeight;
    // A fabric narrower than the canvas's shape (a few nodes, a few tiers) is spread across it:
    // fitted by its height it filled the middle ~40 % of the canvas, its labels crowded under the
    // cables (issue 46). Only x stretches; sizes stay, so the gaps between nodes grow.
    const aspect = width > 0 && height > 0 ? (height - 140) / Math.max(1, width - 80) : 0.6;
    let wide = W;
    if (aspect > 0.05 && rows * rowHeight / aspect > W) {
      wide = rows * rowHeight / aspect;
      const k = wide / W;
      for (const n of nodes) n.x *= k;
    }
    // How far each switch is from its nearest neighbour in its row: its label shows once that is wide.
    for (let row = 1; row < rows; row++) {
      const tier = nodes.filter((n) => n.kind === "switch" && rowOf(n) === row).sort((p, q) => p.x - q.x);
      tier.forEach((n, k) => {
        const left = k > 0 ? n.x - tier[k - 1].x : Infinity, right = k + 1 < tier.length ? tier[k + 1].x - n.x : Infinity;
        n.gap = Math.min(left, right);
      });
    }
    // A grid of cells for hit tests (hover, click).
    const cell = Math.max(AW * 4, wide / 256);
    const grid = new Map();
    for (const n of nodes) {
      const k = Math.floor(n.x / cell) + "," + Math.floor(n.y / cell);
      if (!grid.has(k)) grid.set(k, []);
      grid.get(k).push(n);
    }
    const rateList = [...new Set(bundles.filter((b) => !b.degraded).map((b) => b.rate))].sort((p, q) => p - q);
    const m = { topo, nodes, byKey, bundles, hidden, devices, rateList, W: wide, H: rows * rowHeight, rowHeight, grid, cell,
                paths: null };
    m.paths = buildPaths(m);
    m.degradedBundles = bundles.filter((b) => b.degraded);
    m.switchList = nodes.filter((n) => n.kind === "switch");
    m.adapterRow = nodes.filter((n) => n.kind === "adapter").sort((p, q) => p.x - q.x);
    return m;
  }

  function bundleColour(m, b) {
    if (b.degraded) return RED;
    if (byRail && b.host) {
      const adapter = b.a.kind === "adapter" ? b.a : b.b;
      return adapter.rail >= 0 ? RAIL_COLOURS[adapter.rail % RAIL_COLOURS.length] : "#8b949e";
    }
    return RATE_COLOURS[RATE_BANDS.findIndex((top) => b.rate <= top)];
  }

  function bundleWidth(b) { return b.links.length > 1 ? 1.5 + Math.log2(b.links.length) * 1.5 : 1; }

  // One Path2D per colour and width: a whole fabric is a handful of stroke() calls.
  function buildPaths(m) {
    const groups = new Map();
    for (const b of m.bundles) {
      const colour = bundleColour(m, b), w = bundleWidth(b);
      const key = colour + "|" + w;
      if (!groups.has(key)) groups.set(key, { colour, width: w, path: new Path2D() });
      const g = groups.get(key);
      g.path.moveTo(b.a.x, b.a.y);
      g.path.lineTo(b.b.x, b.b.y);
    }
    // Degraded last, on top.
    return [...groups.values()].sort((p, q) => (p.colour === RED) - (q.colour === RED));
  }

  // -- view --------------------------------------------------------------------------------------

  function resize() {
    dpr = window.devicePixelRatio || 1;
    width = stage.clientWidth; height = stage.clientHeight;
    canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
    dirty = true;
  }

  function fit() {
    if (!model) return;
    const pad = 40, below = 100; // room under the adapters for their labels
    const s = Math.min((width - 2 * pad) / Math.max(1, model.W), (height - pad - below) / Math.max(1, model.H));
    view.scale = s;
    view.tx = pad + (width - 2 * pad - model.W * s) / 2;
    view.ty = height - below - (height - pad - below - model.H * s) / 2;
    view.fitted = true;
    dirty = true;
  }

  function toScreen(x, y) { return { x: x * view.scale + view.tx, y: y * view.scale + view.ty }; }
  function toWorld(x, y) { return { x: (x - view.tx) / view.scale, y: (y - view.ty) / view.scale }; }

  function zoomAt(factor, sx, sy) {
    const min = model ? Math.min(width / model.W, height / model.H) * 0.3 : 1e-4;
    const next = Math.min(40, Math.max(min, view.scale * factor));
    const f = next / view.scale;
    view.tx = sx - (sx - view.tx) * f;
    view.ty = sy - (sy - view.ty) * f;
    view.scale = next;
    dirty = true;
  }

  function hit(sx, sy) {
    if (!model) return -1;
    const p = toWorld(sx, sy);
    const r = Math.max(9 / view.scale, 0);
    const c = model.cell;
    let best = -1, bestD = r * r;
    for (let gx = Math.floor((p.x - r) / c); gx <= Math.floor((p.x + r) / c); gx++) {
      for (let gy = Math.floor((p.y - r) / c); gy <= Math.floor((p.y + r) / c); gy++) {
        for (const n of model.grid.get(gx + "," + gy) || []) {
          const d = (n.x - p.x) ** 2 + (n.y - p.y) ** 2;
          if (d <= bestD) { bestD = d; best = n.i; }
        }
      }
    }
    return best;
  }

  // -- drawing -----------------------------------------------------------------------------------

  function portOf(n) {
    if (!ports || n.kind !== "adapter") return null;
    for (const b of n.bundles) {
      for (const link of b.links) {
        const end = link.a.guid === n.key ? link.a : link.b;
        const found = ports.ports[n.key + ":" + end.port];
        if (found) return { key: n.key + ":" + end.port, ...found };
      }
    }
    return null;
  }

  // Which adapters' ports are not ACTIVE (they glow red): set when a ports document arrives.
  // A port the agent reads as anything but ACTIVE (DOWN, INIT, ARMED) is down; one whose node the
  // server does not know (UNKNOWN) is not.
  let downStamp = 0, downList = "";
  function markDown() {
    if (!model || !ports) return;
    const down = [];
    for (const n of model.nodes) {
      if (n.kind !== "adapter") continue;
      const p = portOf(n);
      n.portKey = p ? p.key : null;
      const state = p && p.state ? p.state.toUpperCase() : "UNKNOWN";
      n.down = state !== "ACTIVE" && state !== "UNKNOWN";
      if (n.down) down.push(n.i);
    }
    api.down = down.length;
    const list = down.join(",");
    if (list !== downList) { downList = list; downStamp += 1; }
  }

  function related(i) {
    const n = model.nodes[i];
    const nodes = new Set([i]), bundles = new Set();
    for (const b of n.bundles) { bundles.add(b.i); nodes.add(b.a.i); nodes.add(b.b.i); }
    return { nodes, bundles };
  }

  // The scene (cables, nodes, down ports) is drawn into an offscreen canvas once per view; while
  // a pan or zoom is under way each frame only moves or scales that picture (one drawImage), and
  // the scene is drawn sharp again once the pointer and the wheel rest for IDLE_MS. Rasterising
  // 20,000 cables costs 100+ ms a frame on a 2-core machine without a GPU; a blit costs a few.
  const IDLE_MS = 250;
  const scene = { canvas: document.createElement("canvas"), key: "", scale: 0, tx: 0, ty: 0 };
  let lastWheel = -1e9;

  function sceneKey(focus) {
    return [topoStamp, byRail, focus, downStamp, canvas.width, canvas.height].join("|");
  }

  function drawScene(c, rel) {
    const s = view.scale;
    scene.canvas.width = canvas.width; scene.canvas.height = canvas.height;
    c.setTransform(1, 0, 0, 1, 0, 0);
    c.clearRect(0, 0, canvas.width, canvas.height);
    c.setTransform(dpr * s, 0, 0, dpr * s, dpr * view.tx, dpr * view.ty);
    c.lineCap = "round";
    c.globalAlpha = rel ? FADE : 1;
    for (const g of model.paths) {
      c.strokeStyle = g.colour;
      c.lineWidth = g.width / s;
      c.stroke(g.path);
    }
    if (rel) {
      c.globalAlpha = 1;
      for (const bi of rel.bundles) {
        const b = model.bundles[bi];
        c.strokeStyle = bundleColour(model, b);
        c.lineWidth = (bundleWidth(b) + 1) / s;
        c.beginPath(); c.moveTo(b.a.x, b.a.y); c.lineTo(b.b.x, b.b.y); c.stroke();
      }
    }
    // Nodes, in screen pixels, only those in view.
    c.setTransform(dpr, 0, 0, dpr, 0, 0);
    const adapterPx = adapterSize(), switchPx = switchSize();
    const down = [];
    const fills = new Map();
    for (const n of model.nodes) {
      const x = n.x * s + view.tx, y = n.y * s + view.ty;
      if (x < -20 || x > width + 20 || y < -20 || y > height + 20) continue;
      const faded = rel && !rel.nodes.has(n.i);
      let colour;
      if (n.kind === "switch") colour = byRail && n.rail >= 0 ? RAIL_COLOURS[n.rail % RAIL_COLOURS.length] : "#c9d1d9";
      else colour = byRail && n.rail >= 0 ? RAIL_COLOURS[n.rail % RAIL_COLOURS.length] : "#8b949e";
      const key = colour + (faded ? "|f" : "");
      if (!fills.has(key)) fills.set(key, { colour, faded, path: new Path2D() });
      const size = n.kind === "switch" ? switchPx : adapterPx;
      fills.get(key).path.rect(x - size / 2, y - size / 2, size, size);
      if (n.kind === "adapter" && n.down) down.push({ x, y, size });
    }
    for (const f of fills.values()) {
      c.globalAlpha = f.faded ? FADE : 1;
      c.fillStyle = f.colour;
      c.fill(f.path);
    }
    c.globalAlpha = 1;
    // Down ports glow red.
    for (const d of down) {
      const r = Math.max(8, d.size * 2.5);
      const glow = c.createRadialGradient(d.x, d.y, 0, d.x, d.y, r);
      glow.addColorStop(0, "rgba(248,81,73,0.95)"); glow.addColorStop(1, "rgba(248,81,73,0)");
      c.fillStyle = glow;
      c.fillRect(d.x - r, d.y - r, 2 * r, 2 * r);
    }
    scene.scale = view.scale; scene.tx = view.tx; scene.ty = view.ty;
  }

  function adapterSize() { return Math.min(6, Math.max(1.5, AW * view.scale * 0.5)); }
  function switchSize() { return Math.min(14, Math.max(4, 40 * view.scale)); }

  // While a gesture goes on, the last full frame is moved and scaled by the compositor (a CSS
  // transform on the canvas): nothing is painted, so a frame costs what compositing one layer
  // costs. The frame is drawn whole again once the gesture rests (IDLE_MS).
  const shown = { scale: 0, tx: 0, ty: 0, key: "" };

  function draw(now) {
    api.frames += 1;
    if (model && shown.key && ((drag && drag.moved) || performance.now() - lastWheel < IDLE_MS)
        && shown.key === sceneKey(hover >= 0 ? hover : selected)) {
      const k = view.scale / shown.scale;
      canvas.style.transform = "translate(" + (view.tx - k * shown.tx) + "px, " + (view.ty - k * shown.ty) + "px) scale(" + k + ")";
      api.timing.n += 1;
      return true;
    }
    canvas.style.transform = "";
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = BACKGROUND;
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (!model) return false;
    const focus = hover >= 0 ? hover : selected;
    const rel = focus >= 0 ? related(focus) : null;
    const key = sceneKey(focus);
    const interacting = (drag && drag.moved) || performance.now() - lastWheel < IDLE_MS;
    const moved = scene.scale !== view.scale || scene.tx !== view.tx || scene.ty !== view.ty;
    const t0 = performance.now();
    if (scene.key !== key || (moved && !interacting)) {
      drawScene(scene.canvas.getContext("2d"), rel);
      scene.key = key;
    }
    const t1 = performance.now();
    const k = view.scale / scene.scale;
    ctx.setTransform(k, 0, 0, k, dpr * (view.tx - k * scene.tx), dpr * (view.ty - k * scene.ty));
    ctx.imageSmoothingEnabled = false; // mid-zoom the picture is scaled: nearest pixels, half the cost
    ctx.drawImage(scene.canvas, 0, 0);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const t2 = performance.now();
    const moving = drawParticles(now, rel);
    drawMarkers(rel);
    const switchPx = switchSize();
    drawLabels(rel, switchPx);
    if (focus >= 0) {
      const n = model.nodes[focus], p = toScreen(n.x, n.y);
      ctx.strokeStyle = "#ffffff"; ctx.lineWidth = 2;
      ctx.strokeRect(p.x - switchPx, p.y - switchPx, 2 * switchPx, 2 * switchPx);
    }
    const t3 = performance.now(), tm = api.timing;
    tm.scene += t1 - t0; tm.blit += t2 - t1; tm.overlay += t3 - t2; tm.n += 1;
    Object.assign(shown, { scale: view.scale, tx: view.tx, ty: view.ty, key });
    // Keep drawing while particles run, a gesture goes on, or the sharp scene is still due.
    return moving || interacting || moved;
  }

  function markerPositions() {
    if (!model) return [];
    return model.bundles.filter((b) => b.degraded).map((b) => {
      const p = toScreen((b.a.x + b.b.x) / 2, (b.a.y + b.b.y) / 2);
      return { x: p.x, y: p.y, a: b.a.label, b: b.b.label };
    });
  }

  function drawMarkers(rel) {
    ctx.font = "bold 11px system-ui, sans-serif";
    ctx.textAlign = "center"; ctx.textBaseline = "middle";
    for (const b of model.degradedBundles) {
      const p = toScreen((b.a.x + b.b.x) / 2, (b.a.y + b.b.y) / 2);
      if (p.x < -10 || p.x > width + 10 || p.y < -10 || p.y > height + 10) continue;
      ctx.globalAlpha = rel && !rel.bundles.has(b.i) ? 0.35 : 1;
      ctx.fillStyle = RED;
      ctx.beginPath(); ctx.arc(p.x, p.y, 7, 0, 2 * Math.PI); ctx.fill();
      ctx.fillStyle = "#ffffff";
      ctx.fillText("!", p.x, p.y + 0.5);
    }
    ctx.globalAlpha = 1;
  }

  function drawLabels(rel, switchPx) {
    ctx.font = "11px system-ui, sans-serif";
    const s = view.scale;
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    ctx.fillStyle = "#d8dee6";
    // Switch labels once their row has room for them.
    for (const n of model.switchList) {
      const x = n.x * s + view.tx, y = n.y * s + view.ty;
      if (x < -60 || x > width + 60 || y < -20 || y > height + 20 || !switchRoom(n)) continue;
      ctx.globalAlpha = rel && !rel.nodes.has(n.i) ? FADE : 1;
      ctx.fillText(clipLabel(n.label), x, y + switchPx / 2 + 3);
    }
    // Adapter labels, written downwards, once adapters are a line of text apart: only those in
    // view (the adapter row is sorted by x).
    const row = model.adapterRow;
    if (AW * s >= 13 && row.length) {
      const y = row[0].y * s + view.ty;
      if (y > -200 && y < height + 20) {
        const left = (-60 - view.tx) / s, right = (width + 60 - view.tx) / s;
        let lo = 0, hi = row.length;
        while (lo < hi) { const mid = (lo + hi) >> 1; if (row[mid].x < left) lo = mid + 1; else hi = mid; }
        ctx.textAlign = "left"; ctx.textBaseline = "middle";
        ctx.fillStyle = "#9aa5b1";
        for (let k = lo; k < row.length && row[k].x <= right; k++) {
          const n = row[k];
          ctx.globalAlpha = rel && !rel.nodes.has(n.i) ? FADE : 1;
          ctx.save();
          ctx.translate(n.x * s + view.tx, y + 6);
          ctx.rotate(Math.PI / 2);
          ctx.fillText(clipLabel(n.label), 0, 0);
          ctx.restore();
        }
      }
    }
    ctx.globalAlpha = 1;
  }

  function clipLabel(text) { return text.length > 28 ? text.slice(0, 27) + "…" : text; }

  function switchRoom(n) { return n.gap * view.scale >= Math.min(28, n.label.length) * 6.5 + 10; }

  // The cables that carry traffic now, worked out when a ports document arrives (not per frame):
  // each adapter's cable both ways, and each leaf's uplinks carrying what its adapters send.
  let flows = [];
  function computeFlows() {
    flows = [];
    if (!model || !rates.size) return;
    const uplinkLoad = new Map(); // leaf → bytes/s its adapters move
    for (const b of model.bundles) {
      if (!b.host) continue;
      const adapter = b.a.kind === "adapter" ? b.a : b.b, sw = adapter === b.a ? b.b : b.a;
      const rate = adapter.portKey ? rates.get(adapter.portKey) : null;
      if (!rate || (rate.tx <= 0 && rate.rx <= 0)) continue;
      uplinkLoad.set(sw, (uplinkLoad.get(sw) || 0) + rate.tx + rate.rx);
      if (rate.tx > 0) flows.push({ from: adapter, to: sw, bytes: rate.tx, gbps: b.rate, bi: b.i, phase: 0 });
      if (rate.rx > 0) flows.push({ from: sw, to: adapter, bytes: rate.rx, gbps: b.rate, bi: b.i, phase: 0.5 });
    }
    for (const [leaf, load] of uplinkLoad) {
      const ups = leaf.bundles.filter((b) => !b.host);
      for (const b of ups) {
        const other = b.a === leaf ? b.b : b.a, share = load / 2 / ups.length, gbps = b.rate * b.links.length;
        flows.push({ from: leaf, to: other, bytes: share, gbps, bi: b.i, phase: 0.25 });
        flows.push({ from: other, to: leaf, bytes: share, gbps, bi: b.i, phase: 0.75 });
      }
    }
    api.flows = flows.length;
  }

  function drawParticles(now, rel) {
    if (!flows.length) return false;
    const s = view.scale;
    const dots = new Path2D();
    let count = 0;
    for (const f of flows) {
      count = emit(dots, count, f.from, f.to, f.bytes, f.gbps, now, s, rel, f.bi, f.phase);
      if (count >= MAX_PARTICLES) break;
    }
    ctx.fillStyle = "#f0f6fc";
    ctx.globalAlpha = 0.9;
    ctx.fill(dots);
    ctx.globalAlpha = 1;
    return true;
  }

  // Dots from `from` to `to`: 1-4 of them by how full the cable is, faster the fuller.
  function emit(dots, count, from, to, bytesPerS, gbps, now, s, rel, bi, phase) {
    if (bytesPerS <= 0 || count >= MAX_PARTICLES || (rel && !rel.bundles.has(bi))) return count;
    const ax = from.x * s + view.tx, ay = from.y * s + view.ty, bx = to.x * s + view.tx, by = to.y * s + view.ty;
    const len = Math.hypot(bx - ax, by - ay);
    if (len < 12) return count;
    if (Math.max(ax, bx) < 0 || Math.min(ax, bx) > width || Math.max(ay, by) < 0 || Math.min(ay, by) > height) return count;
    const fill = Math.min(1, (bytesPerS * 8 / 1e9) / Math.max(1, gbps));
    const n = Math.max(1, Math.min(4, Math.ceil(fill * 4)));
    const speed = (40 + 160 * fill) / len; // cable lengths per second
    for (let k = 0; k < n; k++) {
      const t = ((now / 1000) * speed + k / n + phase) % 1;
      dots.rect(ax + (bx - ax) * t - 1.5, ay + (by - ay) * t - 1.5, 3, 3);
    }
    return count + n;
  }

  function loop(now) {
    if (dirty) {
      dirty = false;
      if (draw(now)) dirty = true;
    }
    window.requestAnimationFrame(loop);
  }

  // -- panel, legend, search -----------------------------------------------------------------------

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function rowsTable(rows) {
    const table = el("table");
    for (const [k, v] of rows) {
      const tr = el("tr");
      tr.append(el("td", k, "muted"));
      const td = el("td");
      if (v instanceof Node) td.append(v); else td.textContent = String(v);
      tr.append(td);
      table.append(tr);
    }
    return table;
  }

  function rateText(bytesPerS) {
    const bits = bytesPerS * 8;
    if (bits >= 1e9) return (bits / 1e9).toFixed(1) + " Gb/s";
    if (bits >= 1e6) return (bits / 1e6).toFixed(1) + " Mb/s";
    return (bits / 1e3).toFixed(0) + " kb/s";
  }

  function openPanel(i) {
    const n = model.nodes[i];
    api.selected = n.key;
    panelBody.replaceChildren();
    panelBody.append(el("h3", n.kind === "switch" ? n.data.description || n.key : n.label));
    const rows = [["kind", n.kind === "switch" ? n.data.tier + " switch" : "adapter"], ["GUID", n.key]];
    if (n.kind === "switch") {
      rows.push(["LID", n.data.lid], ["ports", n.data.ports], ["cables", n.bundles.reduce((s, b) => s + b.links.length, 0)]);
    } else {
      if (n.data.node) {
        const a = el("a", n.data.node);
        a.href = "/admin/nodes/" + encodeURIComponent(n.data.node);
        rows.push(["node", a]);
      }
      rows.push(["device", n.data.device || "—"], ["description", n.data.description || "—"], ["LID", n.data.lid]);
      const p = portOf(n);
      if (p) {
        rows.push(["port state", (p.state || "?") + (p.phys_state ? " / " + p.phys_state : "")]);
        const r = rates.get(p.key);
        if (r) rows.push(["traffic", "sends " + rateText(r.tx) + ", receives " + rateText(r.rx)]);
      }
      if (n.rail >= 0) rows.push(["rail", model.devices[n.rail]]);
    }
    panelBody.append(rowsTable(rows));
    panelBody.append(el("h4", "Cables"));
    const list = el("ul");
    for (const b of n.bundles) {
      for (const link of b.links) {
        const mine = link.a.guid === n.key ? link.a : link.b, other = mine === link.a ? link.b : link.a;
        const li = el("li", "[" + mine.port + "] → " + other.name + " [" + other.port + "] " + link.width + " "
          + link.speed + " (" + link.rate_gbps + " Gb/s)");
        if (link.degraded) { li.className = "crit"; li.append(el("div", "degraded: " + (link.reason || ""))); }
        list.append(li);
      }
    }
    panelBody.append(list);
    panel.hidden = false;
  }

  function closePanel() { panel.hidden = true; selected = -1; api.selected = null; dirty = true; }

  function describe() {
    const t = model.topo;
    api.switches = t.switches.length; api.adapters = t.adapters.length; api.cables = t.links.length;
    api.bundles = model.bundles.length; api.degraded = model.bundles.filter((b) => b.degraded).length;
    canvas.dataset.switches = String(api.switches);
    canvas.dataset.adapters = String(api.adapters);
    counts.textContent = t.switches.length + " switches · " + t.adapters.length + " adapters · " + t.links.length
      + " cables (" + model.bundles.length + " bundles) · " + t.summary.degraded_links + " degraded";
    legend.replaceChildren();
    if (byRail) {
      model.devices.forEach((d, k) => {
        const sw = el("span", undefined, "swatch"); sw.style.background = RAIL_COLOURS[k % RAIL_COLOURS.length];
        legend.append(sw, document.createTextNode("rail " + (d || "?")));
      });
    } else {
      for (const rate of model.rateList) {
        const sw = el("span", undefined, "swatch");
        sw.style.background = bundleColour(model, { degraded: false, host: false, rate });
        legend.append(sw, document.createTextNode(rate + " Gb/s"));
      }
    }
    const red = el("span", undefined, "swatch"); red.style.background = RED;
    legend.append(red, document.createTextNode("degraded"));
  }

  let matches = [], matchAt = 0, lastQuery = "";
  function find(q) {
    const query = (q || "").trim().toLowerCase();
    if (!model || !query) return 0;
    if (query !== lastQuery) {
      lastQuery = query;
      const score = (n) => (n.kind === "adapter" && n.data.node && n.data.node.toLowerCase() === query ? 0 : 1);
      matches = model.nodes.filter((n) => n.label.toLowerCase().includes(query) || n.key.toLowerCase().includes(query)
        || (n.data.node || "").toLowerCase().includes(query)).sort((p, r) => score(p) - score(r));
      matchAt = 0;
    } else {
      matchAt = (matchAt + 1) % Math.max(1, matches.length);
    }
    if (!matches.length) { message.textContent = "no node, device or switch matches " + JSON.stringify(q); return 0; }
    message.textContent = matches.length > 1 ? (matchAt + 1) + " of " + matches.length + " matches (Enter: next)" : "";
    const n = matches[matchAt];
    const target = Math.max(view.scale, 46 / AW);
    view.scale = Math.min(40, target);
    view.tx = width / 2 - n.x * view.scale;
    view.ty = height / 2 - n.y * view.scale;
    selected = n.i;
    openPanel(n.i);
    dirty = true;
    return matches.length;
  }

  // -- events --------------------------------------------------------------------------------------

  let drag = null;
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    lastWheel = performance.now();
    const r = canvas.getBoundingClientRect();
    zoomAt(Math.exp(-e.deltaY * 0.0015), e.clientX - r.left, e.clientY - r.top);
  }, { passive: false });
  canvas.addEventListener("pointerdown", (e) => {
    drag = { x: e.clientX, y: e.clientY, tx: view.tx, ty: view.ty, moved: false };
    canvas.classList.add("dragging");
  });
  window.addEventListener("pointermove", (e) => {
    const r = canvas.getBoundingClientRect();
    if (drag) {
      const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 4) drag.moved = true;
      view.tx = drag.tx + dx; view.ty = drag.ty + dy;
      dirty = true;
      return;
    }
    if (e.target !== canvas) return;
    const h = hit(e.clientX - r.left, e.clientY - r.top);
    if (h !== hover) {
      hover = h; dirty = true;
      canvas.title = h >= 0 ? model.nodes[h].label : "";
      api.hovered = h >= 0 ? model.nodes[h].key : null;
    }
  });
  window.addEventListener("pointerup", (e) => {
    if (!drag) return;
    const click = !drag.moved;
    drag = null;
    canvas.classList.remove("dragging");
    if (click && e.target === canvas) {
      const r = canvas.getBoundingClientRect();
      const h = hit(e.clientX - r.left, e.clientY - r.top);
      if (h >= 0) { selected = h; openPanel(h); } else closePanel();
      dirty = true;
    }
  });
  canvas.addEventListener("pointerleave", () => { if (hover >= 0) { hover = -1; dirty = true; } });
  search.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); find(search.value); } });
  search.addEventListener("input", () => { if (search.value.trim().length >= 2) { lastQuery = ""; find(search.value); } });
  railBox.addEventListener("change", () => {
    byRail = railBox.checked;
    if (model) { model.paths = buildPaths(model); describe(); }
    dirty = true;
  });
  document.getElementById("fabric-fit").addEventListener("click", () => fit());
  document.getElementById("fabric-panel-close").addEventListener("click", () => closePanel());
  window.addEventListener("resize", () => { resize(); });

  resize();
  window.requestAnimationFrame(loop);
  loadTopology().then(loadPorts);
  window.setInterval(loadTopology, REFRESH_MS);
  window.setInterval(loadPorts, PORTS_MS);
})();
