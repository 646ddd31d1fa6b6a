"""`make bench-admin`: the fabric page's frame rate while panning and zooming, in headless Chromium.

Two fabrics, each served by a real `llmgw server` whose one agent's stand-in ibnetdiscover prints it:
the largest real sample (tests/fixtures/real/ibnetdiscover, a DGX A100 SuperPOD: 206 switches) and
a generated 2,000-node, 8-rail, three-tier fabric (`llmgw sim fabric`). The page is opened at its
fitted view (the whole fabric on screen: the most to draw) and, for a fixed number of frames, every
animation frame dispatches one pointer move of a drag (pan) or one wheel step (zoom) on the canvas,
so every frame is redrawn through the page's own handlers. Frames per second = frames / elapsed.

Baseline, measured in the same run on the same page: the frame rate of the same canvas filled whole
each frame with nothing drawn on it (what the browser itself costs per frame: paint, upload,
composite; at most its vsync cap, 60). Bar (issue 15): ≥ 30 fps for pan and zoom; the ratio to the
baseline says how much of the browser's rate the drawing leaves. Also printed: the ms per frame the
page's own code spends (scene: drawing cables and nodes; blit: moving the cached picture;
overlay: particles, markers, labels), from `llmgwFabric.timing`.

On a shared machine the figures move with its load (`uptime` is printed with them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.harness import Proc, Server, make_sim_node, run_llmgw, start_agent, wait_until  # noqa: E402

LARGEST = ROOT / "tests" / "fixtures" / "real" / "ibnetdiscover" / "dgx-a100-superpod-hdr-206sw-sharp-an.txt"
BAR_FPS = 30.0
CONFIG = """\
fabric:
  discover_interval: 2s
  sm_interval: 1s
  tool_timeout: 60s
"""

MEASURE = """async ([kind, frames]) => {
  const canvas = document.getElementById('fabric-canvas');
  const r = canvas.getBoundingClientRect();
  const cx = r.left + r.width / 2, cy = r.top + r.height / 2;
  const next = () => new Promise((resolve) => requestAnimationFrame(resolve));
  if (kind === 'pan') canvas.dispatchEvent(new PointerEvent('pointerdown', {clientX: cx, clientY: cy, bubbles: true}));
  await next();
  const drawn0 = llmgwFabric.frames, t0 = performance.now();
  for (let k = 0; k < frames; k++) {
    if (kind === 'pan') {
      const a = k / 15;
      canvas.dispatchEvent(new PointerEvent('pointermove', {clientX: cx + 60 * Math.sin(a),
                                                            clientY: cy + 30 * Math.cos(a), bubbles: true}));
    } else if (kind === 'full') {
      llmgwFabric.invalidate();  // the whole scene drawn again, as once a gesture rests
    } else if (kind === 'repaint') {
      const c = canvas.getContext('2d');  // the whole canvas changes, nothing is drawn on it
      c.setTransform(1, 0, 0, 1, 0, 0);
      c.fillStyle = k % 2 ? '#0f1419' : '#10151a';
      c.fillRect(0, 0, canvas.width, canvas.height);
    } else if (kind === 'zoom') {
      canvas.dispatchEvent(new WheelEvent('wheel', {clientX: cx, clientY: cy,
                                                    deltaY: (Math.floor(k / 20) % 2 ? 40 : -40),
                                                    bubbles: true, cancelable: true}));
    }
    await next();
  }
  const elapsed = performance.now() - t0;
  if (kind === 'pan') canvas.dispatchEvent(new PointerEvent('pointerup', {clientX: cx, clientY: cy, bubbles: true}));
  return {fps: frames * 1000 / elapsed, drawn: llmgwFabric.frames - drawn0};
}"""


def serve(tmp: Path, label: str, text: str | None, sim_args: list[str]) -> tuple[list[Proc], Server, str]:
    """A server and one agent whose stand-in ibnetdiscover prints `text` (or the generated fabric)."""
    fabric_dir = tmp / f"{label}-fabric"
    made = run_llmgw("sim", "fabric", *sim_args, "--out", str(fabric_dir), "-o", "json", timeout=300)
    if made.returncode != 0:
        raise SystemExit(f"llmgw sim fabric failed: {made.stderr.strip()}")
    if text is not None:
        (fabric_dir / "ibnetdiscover.txt").write_text(text)
    server = Server(tmp, CONFIG, name=f"server-{label}")
    procs = [server.start()]
    config = make_sim_node(tmp, "node-1", server.fleet_url, "", "--ib-ports", "2", "--fabric", str(fabric_dir),
                           "--force")
    procs.append(start_agent(tmp, f"node-1-{label}", config))

    def found() -> str | None:
        fabrics = server.get("/api/v1/fabrics")
        return fabrics[0]["id"] if fabrics and fabrics[0]["topology"] else None

    fabric_id = wait_until(found, f"the {label} fabric's topology", deadline=180, procs=procs)
    return procs, server, fabric_id


def measure(browser: object, url: str, frames: int) -> dict[str, float]:
    page = browser.new_page(viewport={"width": 1600, "height": 1000})  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.wait_for_function("() => window.llmgwFabric && window.llmgwFabric.ready", timeout=120_000)
    counts = page.evaluate("({switches: llmgwFabric.switches, adapters: llmgwFabric.adapters, cables: "
                           "llmgwFabric.cables})")
    page.evaluate(MEASURE, ["idle", 30])  # warm up: first frames compile and lay out
    out = {**counts}
    for kind in ("idle", "repaint", "pan", "zoom", "full"):
        page.evaluate("() => { Object.assign(llmgwFabric.timing, {scene: 0, blit: 0, overlay: 0, n: 0}); }")
        result = page.evaluate(MEASURE, [kind, frames if kind != "full" else max(10, frames // 6)])
        timing = page.evaluate("() => llmgwFabric.timing")
        n = max(1, timing["n"])
        out[f"{kind}_ms"] = {part: round(timing[part] / n, 2) for part in ("scene", "blit", "overlay")}
        out[kind] = result["fps"]
        out[f"{kind}_drawn"] = result["drawn"]
    if errors:
        raise SystemExit(f"the page failed: {errors[0]}")
    page.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=180)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--chromium-arg", action="append", default=[], help="an extra Chromium flag (repeatable)")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise SystemExit("bench-admin needs Debian's chromium (apt-get install chromium; `make test` installs it)")
    from playwright.sync_api import sync_playwright

    cases = [
        ("real", LARGEST.read_text(), ["--node-ids", "node-1", "--rails", "2", "--group-size", "2", "--spines", "2"]),
        ("generated", None, ["--nodes", str(args.nodes), "--rails", "8", "--group-size", "32", "--spines", "8",
                             "--core", "8", "--groups-per-pod", "8"]),
    ]
    ok = True
    results = {}
    print("load average:", " ".join(f"{x:.1f}" for x in os.getloadavg()), f"({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-admin-") as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage", *args.chromium_arg])
        for label, text, sim_args in cases:
            procs, server, fabric_id = serve(Path(tmp), label, text, sim_args)
            try:
                result = measure(browser, f"{server.url}/admin/fabrics/{fabric_id}", args.frames)
            finally:
                for p in reversed(procs):
                    p.stop(timeout=5)
            results[label] = result
            full_ms = 1000 / result["full"]
            name = LARGEST.name if label == "real" else f"generated {args.nodes} nodes"
            print(f"{name}: {result['switches']} switches, {result['adapters']} adapters, {result['cables']} cables")
            for kind in ("pan", "zoom"):
                fps, base = result[kind], result["repaint"]
                passed = fps >= BAR_FPS
                ok = ok and passed
                print(f"  {kind:4s} {fps:6.1f} fps  (baseline: the same canvas repainted empty {base:.1f} fps, idle "
                      f"{result['idle']:.1f}; ratio {fps / base:.2f}; bar ≥ {BAR_FPS:.0f} fps) "
                      f"{'ok' if passed else 'BELOW THE BAR'}"
                      f"  [{result[f'{kind}_drawn']} frames drawn; ms per frame in {result[f'{kind}_ms']}]")
            print(f"  full {result['full']:6.1f} fps  ({full_ms:.0f} ms a frame drawn whole; JS ms in "
                  f"{result['full_ms']})")
        browser.close()
    print(json.dumps(results))
    print("(full: one frame drawn whole, as once a gesture rests; no bar: it happens once per gesture)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
