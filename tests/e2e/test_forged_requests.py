"""Issue 40, finding 1: a page on another site makes the operator's browser change the fleet.

A browser sends an installed operator certificate to any site that asks, as it sends a cookie.
Here the "browser" is an HTTP client holding operator alice's certificate, sending what an HTML
form on another site can make it send: a `text/plain` POST (`{"force": true}` as its body, the
form trick for JSON) with the Origin and Fetch Metadata a browser adds, or, as an older browser
would, without them. Through the real TLS public port every such cordon, uncordon, reload and
forced drain is refused with one JSON line saying what to send, and nothing is done; `llmgw ctl`
with the same certificate does each of them; a same-origin call with the headers (what the
server's own pages would send) passes too.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.harness import (
    FAST_AGENT,
    FAST_FLEET,
    Proc,
    Server,
    ctl,
    make_sim_node,
    start_agent,
    wait_until,
)
from tests.e2e.test_operator_auth import llmgw_ok, public_tls

if TYPE_CHECKING:
    from playwright.sync_api import Route

NODE = "gpu-01"
EVIL = "https://evil.example"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cadir = tmp_path_factory.mktemp("pki") / "ca"
    llmgw_ok("ctl", "cert", "init", "--dir", str(cadir))
    llmgw_ok("ctl", "cert", "server", "--dir", str(cadir), "--ip", "127.0.0.1")
    llmgw_ok("ctl", "cert", "operator", "alice", "--dir", str(cadir))
    return cadir


def browser(pki: Path) -> httpx.Client:
    """An HTTP client that presents alice's certificate to whoever asks, as a browser would."""
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "operator-alice.crt"), str(pki / "operator-alice.key"))
    return httpx.Client(verify=context, timeout=10)


# What a cross-site <form enctype="text/plain" method="post"> makes a browser send, by browser age.
FORMS = {
    "fetch metadata": {"content-type": "text/plain", "origin": EVIL, "sec-fetch-site": "cross-site",
                       "sec-fetch-mode": "navigate"},
    "origin only": {"content-type": "text/plain", "origin": EVIL},
    "neither": {"content-type": "text/plain"},
}


def test_a_cross_site_form_changes_nothing_and_ctl_still_does(tmp_path: Path, procs: list[Proc], pki: Path) -> None:
    server = Server(tmp_path, FAST_FLEET + public_tls(pki), public_ca=pki / "ca.crt")
    procs.append(server.start())
    agent = start_agent(tmp_path, NODE, make_sim_node(tmp_path, NODE, server.fleet_url, FAST_AGENT))
    procs.append(agent)
    url, ca = server.url, str(pki / "ca.crt")
    as_alice = ["--ca", ca, "--cert", str(pki / "operator-alice.crt"), "--key", str(pki / "operator-alice.key")]

    def ctl_ok(*args: str) -> str:
        result = ctl(url, *as_alice, *args)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def mark() -> str:
        return {n["id"]: n for n in json.loads(ctl_ok("nodes", "-o", "json"))}[NODE]["mark"]

    wait_until(lambda: ctl(url, *as_alice, "nodes", "-o", "json").stdout.count(NODE), f"{NODE} registered", procs=procs)
    attacks = [f"/api/v1/nodes/{NODE}/cordon", f"/api/v1/nodes/{NODE}/drain?force=1", f"/api/v1/nodes/{NODE}/drain",
               "/api/v1/reload"]

    def attack(path: str) -> None:
        with browser(pki) as http:
            for age, headers in FORMS.items():
                answer = http.post(f"{url}{path}", headers=headers, content=b'{"force": true}')
                assert answer.status_code in (403, 415), (path, age, answer.status_code, answer.text)
                message = answer.json()["error"]["message"]
                assert "\n" not in message and "X-Llmgw-Request: 1" in message and "application/json" in message
                if age != "neither":
                    assert "another site" in message and EVIL in message, message

    for path in attacks:
        attack(path)
    log = server.proc.log()
    assert mark() == "" and "cordoned by" not in log and "reload requested by" not in log and "drain" not in log
    wait_until(lambda: "operator certificate 'alice', but Sec-Fetch-Site: cross-site" in server.proc.log(),
               "the refusal logged with the certificate it came with", procs=procs)

    # The operator's own ctl, with the same certificate: each change is made.
    assert "cordoned" in ctl_ok("cordon", NODE) and mark() == "cordoned"
    attack(f"/api/v1/nodes/{NODE}/uncordon")
    assert mark() == "cordoned"
    assert "uncordoned" in ctl_ok("uncordon", NODE) and mark() == ""
    assert "reloaded" in ctl_ok("reload")
    ctl_ok("drain", NODE, "--force", "--timeout", "30")
    assert mark() == "draining"
    ctl_ok("uncordon", NODE)

    # A page of this server's own origin that sends the headers passes: what the admin pages'
    # scripts would send (they change nothing today; their reads are GETs, untouched by this).
    with browser(pki) as http:
        own = {"content-type": "application/json", "x-llmgw-request": "1", "origin": url,
               "sec-fetch-site": "same-origin"}
        assert http.post(f"{url}/api/v1/nodes/{NODE}/cordon", headers=own).status_code == 200
        # The same call from another page of the same site (another port) is not the server's own.
        sibling = {**own, "origin": url.rsplit(":", 1)[0] + ":1", "sec-fetch-site": "same-site"}
        assert http.post(f"{url}/api/v1/nodes/{NODE}/uncordon", headers=sibling).status_code == 403
        # Reads are as they were: a GET needs no header.
        assert http.get(f"{url}/api/v1/nodes/{NODE}").json()["mark"] == "cordoned"


EVIL_PAGE = """<!doctype html><title>cute cats</title>
<form id="f" method="post" enctype="text/plain" action="{action}">\
<input type="hidden" name='{{"force": true, "x": "' value='"}}'></form>
<script>document.getElementById("f").submit()</script>"""


def serving(html: str) -> Callable[[Route], None]:
    """A Playwright route handler that answers with `html` (one parameter: Playwright passes the
    request too to a handler that takes two)."""
    return lambda route: route.fulfill(content_type="text/html", body=html)


def test_a_real_browser_on_another_site_cannot_cordon_an_open_lab(tmp_path: Path, procs: list[Proc]) -> None:
    """The same attack from a real Chromium, on a lab server that opens changes to anyone (--insecure,
    no credential): a page of another origin submits its form to the API; Chromium adds the Origin
    and Fetch Metadata itself. Refused, nothing cordoned; a same-origin call with the headers, made
    by a script of the server's own origin in the same browser, still cordons."""
    from tests.e2e.browser import chromium

    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    procs.append(start_agent(tmp_path, NODE, make_sim_node(tmp_path, NODE, server.fleet_url, FAST_AGENT)))
    wait_until(lambda: NODE in server.nodes(), f"{NODE} registered", procs=procs)
    with chromium() as browser:
        page = browser.new_context().new_page()
        for path in (f"/api/v1/nodes/{NODE}/cordon", f"/api/v1/nodes/{NODE}/drain?force=1", "/api/v1/reload"):
            target = f"{server.url}{path}"
            page.route("http://evil.example/", serving(EVIL_PAGE.format(action=target)))
            with page.expect_response(target) as answer:
                page.goto("http://evil.example/")
            assert answer.value.status == 403, (path, answer.value.status)
            assert "another site" in answer.value.json()["error"]["message"]
            page.unroute("http://evil.example/")
        assert server.nodes()[NODE]["mark"] == ""
        log = server.proc.log()
        assert "cordoned by" not in log and "reload requested by" not in log
        assert "Sec-Fetch-Site: cross-site, from 'http://evil.example'" in log

        # The server's own origin, in the same browser: a script that sends the headers changes the fleet.
        page.goto(f"{server.url}/healthz")
        status = page.evaluate("""async (path) => (await fetch(path, {method: "POST",
            headers: {"Content-Type": "application/json", "X-Llmgw-Request": "1"}})).status""",
                               f"/api/v1/nodes/{NODE}/cordon")
        assert status == 200 and server.nodes()[NODE]["mark"] == "cordoned"
