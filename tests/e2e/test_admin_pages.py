"""The admin pages end to end (issue 15): a real server with credentials, four agents on simulated
nodes whose stand-in ibnetdiscover prints a simulated fabric (one cable degraded), one sim
engine; the pages read in a real headless Chromium (Debian's package, see browser.py) and over
plain HTTP. One server and one browser for the module; every test saves a screenshot.

Hostile text rides in where peers put it: one node's GPU name and one switch's node description
are `<script>` elements. They must show as text and never run.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.browser import Watched, chromium
from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    bearer,
    engines_config,
    make_sim_fabric,
    make_sim_node,
    run_llmgw,
    start_agent,
    token_digest,
    wait_until,
)

pytestmark = pytest.mark.e2e

KEY, VIEWER, OPERATOR = "sk-admin-client-41d7", "viewer-admin-9e2c", "operator-admin-c07a"
SECRETS = (KEY, VIEWER, OPERATOR)
NODES = ["node-1", "node-2", "node-3", "node-4"]
GPU_SCRIPT = "<script>window.__pwned_gpu=1</script>H100"
SWITCH_SCRIPT = "<script>window.__pwned_switch=1</script>"


digest = token_digest


CONFIG = engines_config(f"""\
gateway:
  api_keys: ["{digest(KEY)}"]
api:
  viewer_tokens: ["{digest(VIEWER)}"]
  operator_tokens: ["{digest(OPERATOR)}"]
fabric:
  discover_interval: 1s
  sm_interval: 1s
  tool_timeout: 5s
models:
  - name: chat
    replicas: 1
    profiles:
      - name: tp1
        engine: sim
        gpus: 1
        args: ["--startup-delay", "0.2"]
""")


def make_fabric(fabric_dir: Path, *degraded: str) -> None:
    """The simulated fabric, with these nodes' last cables degraded and a <script> in spine-2's description."""
    flags = [arg for node in degraded for arg in ("--degrade", node)]
    make_sim_fabric(fabric_dir, NODES, *flags)
    text = fabric_dir / "ibnetdiscover.txt"
    text.write_text(text.read_text().replace("MF0;spine-2:", f"MF0;{SWITCH_SCRIPT}spine-2:"))


class Cluster:
    def __init__(self, tmp: Path, server: Server, fabric_id: str, topology: dict[str, Any], shots: Path) -> None:
        self.tmp = tmp
        self.server = server
        self.fabric_id = fabric_id
        self.topology = topology
        self.shots = shots

    def get(self, path: str, token: str | None = VIEWER, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.server.url}{path}", headers=bearer(token), timeout=10, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("admin")
    fabric_dir = tmp / "fabric"
    make_fabric(fabric_dir, "node-2")
    procs: list[Proc] = []
    server = Server(tmp, CONFIG, token=VIEWER)
    try:
        procs.append(server.start())
        for node in NODES:
            extra = {"node-2": ["--degraded", "1"], "node-3": ["--gpu-name", GPU_SCRIPT]}.get(node, [])
            config = make_sim_node(tmp, node, server.fleet_url, FAST_AGENT, "--ib-ports", "2", "--gpus", "2",
                                   "--fabric", str(fabric_dir), *extra)
            procs.append(start_agent(tmp, node, config))

        def found() -> tuple[str, dict[str, Any]] | None:
            fabrics = server.get("/api/v1/fabrics")
            if len(fabrics) != 1 or not fabrics[0]["topology"]:
                return None
            return fabrics[0]["id"], server.get(f"/api/v1/fabrics/{fabrics[0]['id']}/topology")

        fabric_id, topology = wait_until(found, "the fabric and its topology", procs=procs)
        wait_until(lambda: [r for r in server.get("/api/v1/replicas") if r["state"] == "ready"], "the replica ready",
                   procs=procs)
        wait_until(lambda: len([n for n in server.get("/api/v1/nodes") if n["state"] == "ready"]) == 4,
                   "four nodes ready",
                   procs=procs)
        shots = tmp / "screenshots"
        shots.mkdir()
        yield Cluster(tmp, server, fabric_id, topology, shots)
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
            p.kill_group()
        from llmgw.demo import kill_leftover_engines

        kill_leftover_engines(tmp, pattern="**/shards/*.json")


@pytest.fixture(scope="module")
def browser_page(cluster: Cluster) -> Iterator[Watched]:
    """One browser, one page, signed in through the login form like a person."""
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        page = context.new_page()
        watched = Watched(page)
        page.goto(f"{cluster.server.url}/admin/")
        page.fill("input[name=token]", VIEWER)
        page.click("button[type=submit]")
        page.wait_for_selector("table.nodes")
        watched.take_errors()  # the first visit's 401 (the login form) is logged as a failed load
        yield watched
        context.close()


def test_cluster_page_in_chromium(cluster: Cluster, browser_page: Watched, tmp_path: Path) -> None:
    page = browser_page.page
    page.goto(f"{cluster.server.url}/admin/")
    page.wait_for_selector("table.nodes")
    page.screenshot(path=str(tmp_path / "cluster.png"), full_page=True)
    (cluster.shots / "cluster.png").write_bytes((tmp_path / "cluster.png").read_bytes())
    assert browser_page.take_errors() == []
    rows = page.locator("table.nodes tbody tr")
    assert rows.count() == 4
    assert page.locator("table.replicas tbody tr").count() == 1
    assert cluster.fabric_id in page.locator("table.sms").inner_text()
    # The GPU name's <script> is text on the page, never an element, never run.
    assert GPU_SCRIPT in page.locator("table.nodes").inner_text()
    assert page.evaluate("window.__pwned_gpu") is None
    assert page.evaluate("[...document.scripts].every(s => s.src && !s.textContent)")
    # The cookie holding the token is HttpOnly: no script on the page can read it.
    assert page.evaluate("document.cookie") == ""
    assert not any(secret in page.content() for secret in SECRETS)


def test_node_page_in_chromium(cluster: Cluster, browser_page: Watched, tmp_path: Path) -> None:
    page = browser_page.page
    page.goto(f"{cluster.server.url}/admin/")
    page.click("table.nodes a:text('node-2')")
    page.wait_for_selector("table.ports")
    page.screenshot(path=str(tmp_path / "node.png"), full_page=True)
    (cluster.shots / "node.png").write_bytes((tmp_path / "node.png").read_bytes())
    assert browser_page.take_errors() == []
    assert page.url.endswith("/admin/nodes/node-2")
    assert page.locator("table.gpus tbody tr").count() == 2
    assert "GPU 1 ×18" in page.locator("table.gpus").inner_text()  # NVLink peers (nv18)
    ports = page.locator("table.ports").inner_text()
    assert "mlx5_0/1" in ports and "mlx5_1/1" in ports
    # node-2's last cable is degraded: its error counters are not zero and are shown.
    assert "symbol_error 1873" in ports and "link_downed 2" in ports
    assert not any(secret in page.content() for secret in SECRETS)


# -- over plain HTTP ----------------------------------------------------------------------------------


def _pages(cluster: Cluster) -> list[str]:
    return ["/admin/", "/admin/nodes/node-1", "/admin/nodes/node-3", f"/admin/fabrics/{cluster.fabric_id}"]


def test_who_may_read_the_pages(cluster: Cluster) -> None:
    for path in _pages(cluster):
        assert cluster.get(path).status_code == 200, path
        assert cluster.get(path, OPERATOR).status_code == 200, path
        # A gateway API key opens /v1 only; nothing of the fleet is in its answer.
        refused = cluster.get(path, KEY)
        assert refused.status_code == 401, path
        assert "<table" not in refused.text and "name=\"token\"" in refused.text  # the login form, no fleet data
        assert cluster.get(path, None).status_code == 401
    ports = cluster.get(f"/admin/fabrics/{cluster.fabric_id}/ports.json", KEY)
    assert ports.status_code == 401
    # The login form takes viewer and operator tokens only; the cookie is HttpOnly, SameSite=Strict.
    url = f"{cluster.server.url}/admin/login"
    for refused_token in (KEY, "not-a-token"):
        answer = httpx.post(url, data={"token": refused_token})
        assert answer.status_code == 401 and "set-cookie" not in answer.headers
        assert refused_token not in answer.text
    signed = httpx.post(url, data={"token": VIEWER, "next": "/admin/nodes/node-1"})
    assert signed.status_code == 303 and signed.headers["location"] == "/admin/nodes/node-1"
    cookie = signed.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie  # plain HTTP here
    jar = {"llmgw_admin": VIEWER}
    assert httpx.get(f"{cluster.server.url}/admin/", cookies=jar).status_code == 200
    # A login form on another site's page is refused (it would sign this browser in as someone else);
    # the browser login above (the browser_page fixture, Chromium sending its own Origin) is not.
    for foreign in ({"origin": "https://evil.example"}, {"sec-fetch-site": "cross-site"}):
        forged = httpx.post(url, data={"token": VIEWER}, headers=foreign)
        assert forged.status_code == 403 and "set-cookie" not in forged.headers and "another site" in forged.text
    own = httpx.post(url, data={"token": VIEWER},
                     headers={"origin": cluster.server.url, "sec-fetch-site": "same-origin"})
    assert own.status_code == 303 and "set-cookie" in own.headers
    # Elsewhere only: a redirect target off these pages falls back to /admin/.
    away = httpx.post(url, data={"token": VIEWER, "next": "https://elsewhere.example/"})
    assert away.headers["location"] == "/admin/"
    # The cookie reads; it never opens the operator door, even holding an operator token.
    assert httpx.get(f"{cluster.server.url}/api/v1/nodes", cookies=jar).status_code == 200
    assert httpx.post(f"{cluster.server.url}/api/v1/reload", cookies={"llmgw_admin": OPERATOR}).status_code == 401
    # Pages only read.
    assert httpx.post(f"{cluster.server.url}/admin/", headers=bearer(OPERATOR)).status_code == 405


def test_no_page_carries_a_secret_or_runs_inline_script(cluster: Cluster) -> None:
    for path in _pages(cluster):
        answer = cluster.get(path, OPERATOR)
        assert not any(secret in answer.text for secret in SECRETS), path
        assert "api_key" not in answer.text
        assert "<script>" not in answer.text, path  # every script is a file; hostile text is escaped
        assert "script-src 'self'" in answer.headers["content-security-policy"]
    node3 = cluster.get("/admin/nodes/node-3").text
    assert "&lt;script&gt;window.__pwned_gpu=1&lt;/script&gt;H100" in node3


def test_static_files_are_content_hashed_and_cached(cluster: Cluster) -> None:
    page = cluster.get(f"/admin/fabrics/{cluster.fabric_id}")
    assert page.headers["cache-control"] == "no-store"
    names = re.findall(r'(?:src|href)="(/admin/static/[^"]+)"', page.text)
    assert {re.sub(r"\.[0-9a-f]{12}\.", ".", n).rsplit("/", 1)[1] for n in names} == {"admin.css", "admin.js",
                                                                                      "fabric.js"}
    for name in names:
        answer = cluster.get(name, None)  # code, not fleet data: served to anyone, like the login form's style
        assert answer.status_code == 200
        assert answer.headers["cache-control"] == "public, max-age=31536000, immutable"
        # The name carries the content's hash: new content, new name.
        assert hashlib.sha256(answer.content).hexdigest()[:12] in name
        stale = re.sub(r"\.[0-9a-f]{12}\.", ".000000000000.", name)
        assert cluster.get(stale, None).status_code == 404
    assert "javascript" in cluster.get(next(n for n in names if n.endswith(".js")), None).headers["content-type"]


def _fabric_page(cluster: Cluster, watched: Watched) -> Any:
    page = watched.page
    page.goto(f"{cluster.server.url}/admin/fabrics/{cluster.fabric_id}")
    page.wait_for_function("() => window.llmgwFabric && window.llmgwFabric.ready")
    return page


def _pixel(page: Any, x: float, y: float) -> list[int]:
    return page.evaluate("""([x, y]) => {
        const c = document.getElementById('fabric-canvas'), d = window.devicePixelRatio || 1;
        return [...c.getContext('2d').getImageData(Math.round(x * d), Math.round(y * d), 1, 1).data];
    }""", [x, y])


def test_fabric_page_draws_the_fabric(cluster: Cluster, browser_page: Watched, tmp_path: Path) -> None:
    page = _fabric_page(cluster, browser_page)
    page.wait_for_timeout(300)  # let a frame or two be drawn before the screenshot (nothing is asserted on time)
    page.screenshot(path=str(tmp_path / "fabric.png"))
    (cluster.shots / "fabric.png").write_bytes((tmp_path / "fabric.png").read_bytes())
    assert browser_page.take_errors() == []
    expected = cluster.topology["summary"]
    assert page.evaluate("llmgwFabric.switches") == expected["switches"] == 6
    assert page.locator("#fabric-canvas").get_attribute("data-switches") == "6"
    assert page.evaluate("llmgwFabric.adapters") == expected["adapters"] == 8
    assert "6 switches" in page.locator("#fabric-counts").inner_text()
    assert page.evaluate("llmgwFabric.cables") == len(cluster.topology["links"])
    # node-2's degraded cable: red, with its marker drawn where the API says.
    [marker] = page.evaluate("llmgwFabric.markers()")
    assert "node-2" in marker["a"] + marker["b"]
    r, g, b, _ = _pixel(page, marker["x"] - 4, marker["y"])  # in the marker's red disc, beside its "!"
    assert r > 200 and g < 120 and b < 120, (r, g, b)
    # Hovering a spine (no cable of its own to node-2) fades the rest: the marker dims.
    spine = next(s for s in cluster.topology["switches"] if s["tier"] == "spine"
                 and SWITCH_SCRIPT not in s["description"])
    at = page.evaluate("key => llmgwFabric.screenOf(key)", spine["guid"])
    box = page.locator("#fabric-canvas").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + at["x"], box["y"] + at["y"])
    page.wait_for_function("key => llmgwFabric.hovered === key", arg=spine["guid"])
    page.wait_for_function("([x, y]) => { const c = document.getElementById('fabric-canvas'), d = "
                           "window.devicePixelRatio || 1;"
                           " return c.getContext('2d').getImageData(Math.round(x * d), Math.round(y * d), 1, "
                           "1).data[0] < 160; }",
                           arg=[marker["x"] - 4, marker["y"]])
    page.screenshot(path=str(tmp_path / "hover.png"))
    page.mouse.move(box["x"] + 2, box["y"] + 2)
    page.wait_for_function("() => llmgwFabric.hovered === null")
    # Colour by rail: the legend names the rails (the adapters' devices).
    page.check("#fabric-rails")
    legend = page.locator("#fabric-legend").inner_text()
    assert "rail mlx5_0" in legend and "rail mlx5_1" in legend, legend
    page.uncheck("#fabric-rails")
    assert browser_page.take_errors() == []


def test_fabric_search_and_click_open_the_panel(cluster: Cluster, browser_page: Watched, tmp_path: Path) -> None:
    page = _fabric_page(cluster, browser_page)
    page.fill("#fabric-search", "node-3")
    page.press("#fabric-search", "Enter")
    page.wait_for_selector("#fabric-panel:not([hidden])")
    panel = page.locator("#fabric-panel").inner_text()
    assert "node-3" in panel and "adapter" in panel
    assert page.evaluate("llmgwFabric.selected") in {a["guid"] for a in cluster.topology["adapters"]
                                                     if a["node"] == "node-3"}
    page.screenshot(path=str(tmp_path / "search.png"))
    # A click on the switch whose description carries a <script>: the panel shows it as text.
    page.click("#fabric-fit")
    spine = next(s for s in cluster.topology["switches"] if SWITCH_SCRIPT in s["description"])
    at = page.evaluate("key => llmgwFabric.screenOf(key)", spine["guid"])
    box = page.locator("#fabric-canvas").bounding_box()
    assert box is not None
    page.mouse.click(box["x"] + at["x"], box["y"] + at["y"])
    page.wait_for_function("key => llmgwFabric.selected === key", arg=spine["guid"])
    assert SWITCH_SCRIPT in page.locator("#fabric-panel").inner_text()
    assert page.evaluate("window.__pwned_switch") is None
    assert page.locator("#fabric-panel script").count() == 0
    page.screenshot(path=str(tmp_path / "panel.png"))
    (cluster.shots / "panel.png").write_bytes((tmp_path / "panel.png").read_bytes())
    assert browser_page.take_errors() == []


def test_a_small_fabric_fills_the_canvas(cluster: Cluster, browser_page: Watched) -> None:
    """Issue 46: four nodes under two leaves were fitted by their height into the middle ~40 % of
    the canvas; spread across it, the outermost adapters span most of its width."""
    page = _fabric_page(cluster, browser_page)
    page.click("#fabric-fit")
    keys = [a["guid"] for a in cluster.topology["adapters"]]
    xs = [page.evaluate("key => llmgwFabric.screenOf(key)", key)["x"] for key in keys]
    width = page.evaluate("document.getElementById('fabric-canvas').getBoundingClientRect().width")
    assert (max(xs) - min(xs)) / width > 0.7, (min(xs), max(xs), width)
    assert browser_page.take_errors() == []


def test_fabric_refresh_keeps_the_view(cluster: Cluster, browser_page: Watched, tmp_path: Path) -> None:
    """A cable degrades while the page is open: the next refresh draws it, and the view and the
    open panel stay where the operator left them. (Last in the module: it changes the fabric.)"""
    page = _fabric_page(cluster, browser_page)
    page.fill("#fabric-search", "node-1")
    page.press("#fabric-search", "Enter")
    page.wait_for_selector("#fabric-panel:not([hidden])")
    selected, view = page.evaluate("[llmgwFabric.selected, llmgwFabric.view()]")
    # The cable trains at 1x at both ends, as on a real fabric: node-4's own port reading is the
    # map's second witness (fabric/crosscheck.py), so the dump alone would not mark it.
    assert run_llmgw("sim", "node", "set-port", str(cluster.tmp / "node-4"), "mlx5_1", "1", "up",
                     "--rate", "100 Gb/sec (1X NDR)").returncode == 0
    make_fabric(cluster.tmp / "fabric", "node-2", "node-4")
    wait_until(lambda: (cluster.server.get(f"/api/v1/fabrics/{cluster.fabric_id}/topology")["summary"]
                        ["degraded_links"] == 2),
               "the second degraded cable discovered")
    page.evaluate("llmgwFabric.refresh()")
    page.wait_for_function("() => llmgwFabric.markers().length === 2")
    assert page.evaluate("[llmgwFabric.selected, llmgwFabric.view()]") == [selected, view]
    assert not page.locator("#fabric-panel").is_hidden()
    assert "2 degraded" in page.locator("#fabric-counts").inner_text()
    page.screenshot(path=str(tmp_path / "refreshed.png"))
    assert browser_page.take_errors() == []
