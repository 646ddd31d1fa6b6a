"""The admin pages' pure parts: content-hashed static names, the ports document the fabric page
animates, and escaping of what peers send."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from llmgw.server.admin import render
from llmgw.server.admin.pages import package_assets
from llmgw.server.admin.traffic import ports_document
from llmgw.server.views import NodeDetail
from llmgw.web.assets import IMMUTABLE, Assets, hashed_name
from llmgw.wire import messages as m


def test_a_new_content_is_a_new_name() -> None:
    old, new = Assets({"fabric.js": b"draw(1)"}), Assets({"fabric.js": b"draw(2)"})
    assert old.url("fabric.js") != new.url("fabric.js")
    assert old.url("fabric.js") == "/admin/static/fabric." + hashlib.sha256(b"draw(1)").hexdigest()[:12] + ".js"
    # The old name is not served by the new version (never the new file under an old name).
    assert new.lookup(old.url("fabric.js")) is None
    assert new.lookup(new.url("fabric.js")).body == b"draw(2)"  # type: ignore[union-attr]
    assert Assets({"a.css": b"x"}).by_name["a.css"].content_type.startswith(b"text/css")
    assert hashed_name("LICENSE", b"x").startswith("LICENSE.")
    assert b"immutable" in IMMUTABLE and b"max-age=31536000" in IMMUTABLE


def test_the_package_ships_its_files() -> None:
    assets = package_assets()
    assert {"admin.js", "admin.css", "fabric.js"} <= set(assets.by_name)
    assert assets.lookup("/admin/static/admin.js") is None  # only hashed names are served


def _node(device_counters: dict[str, int | None]) -> NodeDetail:
    base = dict(id="n1", state="ready", reason="", state_since=0.0, connected=True, address="", version="",
                last_heartbeat_age=0.0, gpus=0, gpu_name="", gpu_source="", gpu_note="", fabrics=[], ports=1,
                ports_active=1, identity=None, cert_days_left=None, features=[])
    return NodeDetail(**base, port_readings=[m.PortCounters(device="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0,
                                                            counters=device_counters)])


def test_ports_document_names_each_adapter_end_in_bytes() -> None:
    topology = {
        "adapters": [{"guid": "0xa", "node": "n1", "device": "mlx5_0"},
                     {"guid": "0xb", "node": "gone", "device": "mlx5_0"}],
        "links": [{"a": {"guid": "0xa", "port": 1}, "b": {"guid": "0xs", "port": 3}},
                  {"a": {"guid": "0xs", "port": 4}, "b": {"guid": "0xb", "port": 1}}],
    }
    doc = ports_document(topology, {"n1": _node({"port_xmit_data": 10, "port_rcv_data": 5,
                                                 "port_xmit_data_64": 1000})}, 12.5)
    assert doc["at"] == 12.5
    assert doc["ports"]["0xa:1"]["xmit_bytes"] == 4000  # the 64-bit counter, in words of 4 octets
    assert doc["ports"]["0xa:1"]["rcv_bytes"] == 20
    assert doc["ports"]["0xb:1"]["state"] == "UNKNOWN"  # a node the server does not know
    assert "0xs:3" not in doc["ports"]  # switches are not adapters
    assert ports_document(topology, {"n1": _node({"port_xmit_data": None})}, 0)["ports"]["0xa:1"]["xmit_bytes"] is None


@given(st.text(max_size=60))
def test_what_a_peer_sends_is_text_on_the_page(name: str) -> None:
    node = msgspec.convert({**msgspec.structs.asdict(_node({})), "gpu_name": name, "gpus": 1, "reason": name,
                            "state": "failed"}, NodeDetail)
    page = render.cluster_page([node], [], [], [], 0.0, lambda f: "/admin/static/" + f)
    body = page.split('<main id="main" data-refresh="15">', 1)[1]
    assert "<script" not in body.replace("&lt;script", "")
    assert render.esc(name) in body


def test_the_summary_counts_fabrics_in_english() -> None:
    page = render.cluster_page([], [], [{"id": "0xabc"}], [], 0.0, lambda f: "/admin/static/" + f)
    assert "· 1 fabric</p>" in page
    page = render.cluster_page([], [], [{"id": "0xabc"}, {"id": "0xdef"}], [], 0.0, lambda f: "/admin/static/" + f)
    assert "· 2 fabrics</p>" in page


# -- the login form's cookie (the e2e tests walk it over plain HTTP; here the TLS flag too) -----------


class _Head:
    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers

    def get(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


class _Request:
    def __init__(self, body: bytes, headers: dict[bytes, bytes] | None = None, method: str = "POST",
                 path: str = "/admin/login") -> None:
        self.head = _Head(headers or {})
        self.body, self.method, self.path, self.query = body, method, path, ""
        self.tls = None
        self.peer = "10.0.0.9:4000"


class _Responder:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self.body = status, dict(headers), body


def _pages(tls: bool) -> Any:
    from llmgw.catalog.schema import ApiSettings, ServerConfig
    from llmgw.server.admin.pages import AdminPages
    from llmgw.server.auth import Auth

    cfg = ServerConfig(api=ApiSettings(viewer_tokens=["sha256:" + hashlib.sha256(b"view-me").hexdigest()]))
    return AdminPages(reads=None, auth=Auth(cfg, insecure=False), assets=Assets({"admin.css": b"", "admin.js": b""}),
                      tls=tls)  # type: ignore[arg-type]


async def test_the_cookie_is_secure_over_tls_and_never_holds_a_bad_token() -> None:
    for tls in (True, False):
        out = _Responder()
        await _pages(tls).login(_Request(b"token=view-me&next=/admin/nodes/n1"), out)  # type: ignore[arg-type]
        assert out.status == 303 and out.headers[b"location"] == b"/admin/nodes/n1"
        cookie = out.headers[b"set-cookie"].decode()
        assert cookie.startswith("llmgw_admin=view-me;") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert ("; Secure" in cookie) is tls
    # A token that could break out of the header (or is simply wrong) never reaches Set-Cookie.
    for body in (b"token=view-me%0d%0aSet-Cookie:%20x=1", b"token=view-me;%20Path=/x", b"token="):
        out = _Responder()
        await _pages(True).login(_Request(body), out)  # type: ignore[arg-type]
        assert out.status == 401 and b"set-cookie" not in out.headers
        assert b"view-me" not in out.body
