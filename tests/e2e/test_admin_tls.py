"""The admin pages over a real TLS public port (issue 15's access rules), against a real server
with one agent on a simulated node dialling the fleet port with its node certificate.

Everything an operator would use is made by `llmgw ctl cert` (the CA, the server certificate for
127.0.0.1, operator, viewer, node and gateway certificates, the deny list) and every request is a
real TLS handshake by httpx with those files, or by a headless Chromium:
- tokens: the sign-in form answers a request without credentials, its cookie is Secure, HttpOnly
  and SameSite=Strict, it reads the pages and their JSON calls and never authorises a change;
- client certificates: viewer and operator certificates read /admin, node and gateway ones do not,
  and a viewer certificate revoked with `ctl cert revoke` stops reading once the server re-reads
  its deny list.
"""

from __future__ import annotations

import html
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.browser import Watched, chromium
from tests.e2e.harness import (
    FAST_AGENT,
    FAST_FLEET,
    Proc,
    Server,
    bearer,
    make_sim_node,
    run_llmgw,
    start_agent,
    tls_agent_config,
    token_digest,
    wait_until,
    writes,
)

pytestmark = pytest.mark.e2e

KEY, VIEWER, OPERATOR = "sk-tls-client-6b1e", "viewer-tls-3a9f", "operator-tls-d41c"
SECRETS = (KEY, VIEWER, OPERATOR)
NODE = "gpu-01"


digest = token_digest


def cert(cadir: Path, *args: str) -> None:
    result = run_llmgw("ctl", "cert", *args, "--dir", str(cadir))
    assert result.returncode == 0, result.stderr


class Cluster:
    def __init__(self, server: Server, cadir: Path, fabric_id: str) -> None:
        self.server = server
        self.cadir = cadir
        self.fabric_id = fabric_id

    @property
    def url(self) -> str:
        return self.server.url

    def pages(self) -> list[str]:
        return ["/admin/", f"/admin/nodes/{NODE}", f"/admin/fabrics/{self.fabric_id}"]

    def json_calls(self) -> list[str]:
        """What the pages' scripts fetch (admin.js re-reads the page itself; fabric.js these two)."""
        return [f"/api/v1/fabrics/{self.fabric_id}/topology", f"/admin/fabrics/{self.fabric_id}/ports.json"]

    def client(self, name: str | None = None, **kw: Any) -> httpx.Client:
        """An httpx client that trusts the CA and presents the certificate `name` (e.g. 'viewer-grafana')."""
        context = ssl.create_default_context(cafile=str(self.cadir / "ca.crt"))
        if name is not None:
            context.load_cert_chain(self.cadir / f"{name}.crt", self.cadir / f"{name}.key")
        return httpx.Client(base_url=self.url, verify=context, timeout=15, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("admin-tls")
    cadir = tmp / "ca"
    cert(cadir, "init", "--name", "admin TLS test CA")
    cert(cadir, "server", "--host", "localhost", "--ip", "127.0.0.1")
    cert(cadir, "operator", "alice")
    cert(cadir, "viewer", "grafana")
    cert(cadir, "viewer", "mallory")  # revoked by the last test
    cert(cadir, "node", NODE)
    cert(cadir, "gateway", "gw-1")
    fabric_dir = tmp / "fabric"
    made = run_llmgw("sim", "fabric", "--node-ids", NODE, "--rails", "2", "--group-size", "2", "--spines", "2",
                     "--out", str(fabric_dir))
    assert made.returncode == 0, made.stderr
    files = f"  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n"
    config = FAST_FLEET + f"""\
tls:
{files}  deny_list: {cadir / 'revoked.json'}
public_tls:
{files}gateway:
  api_keys: ["{digest(KEY)}"]
api:
  viewer_tokens: ["{digest(VIEWER)}"]
  operator_tokens: ["{digest(OPERATOR)}"]
fabric:
  discover_interval: 1s
  sm_interval: 1s
  tool_timeout: 5s
"""
    procs: list[Proc] = []
    server = Server(tmp, config, insecure=False, public_ca=cadir / "ca.crt", token=VIEWER)
    try:
        procs.append(server.start())
        base = make_sim_node(tmp, NODE, server.fleet_url, FAST_AGENT, "--ib-ports", "2", "--gpus", "2",
                             "--fabric", str(fabric_dir))
        agent_config = tls_agent_config(base, cadir / "ca.crt", cadir / f"node-{NODE}.crt", cadir / f"node-{NODE}.key")
        procs.append(start_agent(tmp, NODE, agent_config))

        def found() -> str | None:
            fabrics = server.get("/api/v1/fabrics")
            return fabrics[0]["id"] if len(fabrics) == 1 and fabrics[0]["topology"] else None

        fabric_id = wait_until(found, "the fabric discovered over the TLS fleet port", procs=procs)
        wait_until(lambda: [n for n in server.get("/api/v1/nodes") if n["state"] == "ready"], f"{NODE} ready",
                   procs=procs)
        yield Cluster(server, cadir, fabric_id)
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
            p.kill_group()


def assert_login_form(answer: httpx.Response) -> None:
    """A refusal that shows the sign-in form and nothing of the fleet."""
    assert answer.status_code == 401, (answer.status_code, answer.text[:300])
    assert 'name="token"' in answer.text and "<table" not in answer.text
    # The node's id appears only in the form's return address (the path asked for) and in the
    # refusal's line (a node certificate's own name), never as data.
    rest = re.sub(r'<p class="crit" role="alert">[^<]*</p>', "", answer.text)
    assert NODE not in rest.replace(f'value="/admin/nodes/{NODE}"', "")


# -- tokens over TLS ----------------------------------------------------------------------------------


def test_sign_in_over_tls_sets_a_secure_cookie_that_only_reads(cluster: Cluster) -> None:
    with cluster.client() as anonymous:
        for path in cluster.pages():
            assert_login_form(anonymous.get(path))
        for path in cluster.json_calls():
            assert anonymous.get(path).status_code == 401, path
        # A gateway API key opens /v1 only: the pages answer it with the form, typed or as a cookie.
        for path in cluster.pages():
            assert_login_form(anonymous.get(path, headers=bearer(KEY)))
    with cluster.client(cookies={"llmgw_admin": KEY}) as key_cookie:
        for path in cluster.pages():
            assert_login_form(key_cookie.get(path))
    with cluster.client() as anonymous:
        refused = anonymous.post("/admin/login", data={"token": KEY})
        assert refused.status_code == 401 and "set-cookie" not in refused.headers and KEY not in refused.text

    for token in (VIEWER, OPERATOR):
        with cluster.client() as browser:
            signed = browser.post("/admin/login", data={"token": token, "next": f"/admin/nodes/{NODE}"})
            assert signed.status_code == 303 and signed.headers["location"] == f"/admin/nodes/{NODE}"
            attributes = [a.strip() for a in signed.headers["set-cookie"].split(";")]
            assert {"Secure", "HttpOnly", "SameSite=Strict", "Path=/"} <= set(attributes), attributes
            assert browser.cookies.get("llmgw_admin") == token  # the jar keeps it (Secure, and this is https)
            # The cookie reads every page and what their scripts fetch.
            for path in cluster.pages():
                page = browser.get(path)
                assert page.status_code == 200 and ("<table" in page.text or "fabric-canvas" in page.text), path
                assert not any(secret in page.text for secret in SECRETS), path
            for path in cluster.json_calls():
                answer = browser.get(path)
                assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json"), path
                assert not any(secret in answer.text for secret in SECRETS), path
            assert NODE in browser.get(f"/admin/nodes/{NODE}").text
            # A cookie never authorises a change, even one holding the operator token: a page another
            # site opens (CSRF) gets the browser to send it, so it counts at the viewer door only.
            for path in ("/api/v1/reload", f"/api/v1/nodes/{NODE}/cordon", f"/api/v1/nodes/{NODE}/drain"):
                denied = browser.post(path)
                assert denied.status_code == 401, (path, denied.status_code, denied.text)
                assert token not in denied.text
            assert not cluster.server.nodes()[NODE].get("cordoned"), "a cookie cordoned the node"
            # The same token as a bearer header (what ctl sends) is the operator's, and the cookie's
            # refusal was not some other fault.
            if token == OPERATOR:
                assert browser.post("/api/v1/reload", headers=writes(OPERATOR)).status_code == 200
            signed_out = browser.get("/admin/logout")
            assert signed_out.status_code == 303 and "Secure" in signed_out.headers["set-cookie"]
            assert_login_form(browser.get("/admin/"))
    assert not any(secret in cluster.server.proc.log() for secret in SECRETS)


# -- client certificates ------------------------------------------------------------------------------


def test_viewer_and_operator_certificates_read_the_pages(cluster: Cluster) -> None:
    for name in ("viewer-grafana", "operator-alice"):
        with cluster.client(name) as client:
            for path in [*cluster.pages(), *cluster.json_calls(), "/api/v1/nodes"]:
                answer = client.get(path)
                assert answer.status_code == 200, (name, path, answer.status_code, answer.text[:300])
    with cluster.client("viewer-grafana") as viewer:
        denied = viewer.post("/api/v1/reload")
        assert denied.status_code == 403 and "'grafana' may read the fleet but not change it" in denied.text


def test_node_and_gateway_certificates_are_refused(cluster: Cluster) -> None:
    for kind, common in (("node", NODE), ("gateway", "gw-1")):
        name = f"{kind}-{common}"
        with cluster.client(name) as client:
            for path in cluster.pages():
                page = client.get(path)
                assert_login_form(page)  # with why the certificate does not open it
                assert html.escape(f"'{common}' is neither a viewer nor an operator certificate") in page.text
            for path in [*cluster.json_calls(), "/api/v1/nodes", "/api/v1/replicas"]:
                answer = client.get(path)
                assert answer.status_code == 401, (name, path, answer.status_code)
                assert f"'{common}' is neither a viewer nor an operator certificate (a {kind} certificate)" in \
                    answer.json()["error"]["message"], answer.text
            denied = client.post("/api/v1/reload")
            assert (denied.status_code == 401
                    and f"'{common}' is not an operator certificate (a {kind} certificate)"
                    in denied.json()["error"]["message"]), denied.text


def test_a_revoked_viewer_certificate_is_refused(cluster: Cluster) -> None:
    with cluster.client("viewer-mallory") as mallory:
        assert mallory.get("/admin/").status_code == 200  # it read before it was revoked
        cert(cluster.cadir, "revoke", "mallory")
        # The server re-reads its deny list on reload (an operator's certificate asks).
        with cluster.client("operator-alice") as alice:
            assert alice.post("/api/v1/reload", headers=writes(None)).status_code == 200
        wait_until(lambda: mallory.get("/admin/").status_code == 401, "mallory refused after the reload",
                   procs=[cluster.server.proc])
        page = mallory.get(f"/admin/nodes/{NODE}")
        assert_login_form(page)
        assert html.escape("'mallory' is revoked") in page.text
        for path in [*cluster.json_calls(), "/api/v1/nodes"]:
            answer = mallory.get(path)
            assert answer.status_code == 401 and "'mallory' is revoked" in answer.text, (path, answer.text)
    with cluster.client("viewer-grafana") as grafana:  # revoking one viewer leaves the others
        assert grafana.get("/admin/").status_code == 200


# -- a real browser over TLS --------------------------------------------------------------------------


def test_pages_in_chromium_over_tls(cluster: Cluster, tmp_path: Path) -> None:
    with chromium() as browser:
        # The test CA is not in the browser's store; the handshake is still real TLS.
        context = browser.new_context(viewport={"width": 1400, "height": 900}, ignore_https_errors=True)
        page = context.new_page()
        watched = Watched(page)
        page.goto(f"{cluster.url}/admin/")
        assert page.url.startswith("https://")
        page.fill("input[name=token]", VIEWER)
        page.click("button[type=submit]")
        page.wait_for_selector("table.nodes")
        watched.take_errors()  # the first visit's 401 (the sign-in form) is logged as a failed load
        [jar] = [c for c in context.cookies() if c["name"] == "llmgw_admin"]
        assert jar["secure"] and jar["httpOnly"] and jar["sameSite"] == "Strict", jar
        assert page.evaluate("document.cookie") == ""
        page.screenshot(path=str(tmp_path / "cluster-tls.png"), full_page=True)
        page.goto(f"{cluster.url}/admin/fabrics/{cluster.fabric_id}")
        page.wait_for_function("() => window.llmgwFabric && window.llmgwFabric.ready")
        assert page.evaluate("llmgwFabric.switches") == len(cluster.server.get(
            f"/api/v1/fabrics/{cluster.fabric_id}/topology")["switches"])
        page.screenshot(path=str(tmp_path / "fabric-tls.png"))
        assert watched.take_errors() == []
        assert not any(secret in page.content() for secret in SECRETS)
        context.close()

        # A viewer certificate in the browser reads the pages with no sign-in and no cookie.
        context = browser.new_context(viewport={"width": 1400, "height": 900}, ignore_https_errors=True,
                                      client_certificates=[{"origin": cluster.url,
                                                            "certPath": str(cluster.cadir / "viewer-grafana.crt"),
                                                            "keyPath": str(cluster.cadir / "viewer-grafana.key")}])
        page = context.new_page()
        watched = Watched(page)
        page.goto(f"{cluster.url}/admin/nodes/{NODE}")
        page.wait_for_selector("table.ports")
        page.goto(f"{cluster.url}/admin/fabrics/{cluster.fabric_id}")
        page.wait_for_function("() => window.llmgwFabric && window.llmgwFabric.ready")
        page.screenshot(path=str(tmp_path / "fabric-viewer-cert.png"))
        assert watched.take_errors() == []
        assert context.cookies() == []
        context.close()
