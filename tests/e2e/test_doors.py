"""The client door and the operator door, end to end: a real `llmgw server` with API keys,
viewer and operator tokens, a real agent and engine so every route has something to show,
real `llmgw ctl` processes. Every registered API route is walked, so a new route that forgets
its door fails here."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import httpx
import pytest

from llmgw.server.api import API_ROUTES
from llmgw.server.auth import Door
from tests.e2e.harness import (
    FAST_AGENT,
    FAST_FLEET,
    Proc,
    Server,
    bearer,
    ctl,
    engines_config,
    free_port,
    make_sim_node,
    one_error_line,
    run_llmgw,
    start_agent,
    wait_until,
    writes,
)

KEY, VIEWER, OPERATOR = "sk-client-7f1e", "viewer-3c9a", "operator-d52b"


def digest(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


CREDENTIALS = f"""\
gateway:
  api_keys: ["{digest(KEY)}"]
api:
  viewer_tokens: ["{digest(VIEWER)}"]
  operator_tokens: ["{digest(OPERATOR)}"]
"""

FAST_FABRIC = """\
fabric:
  discover_interval: 1s
  sm_interval: 1s
"""

CATALOG = """\
models:
  - name: chat
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
        args: ["--ttft-ms", "1", "--itl-ms", "1"]
"""


def metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=bearer(VIEWER), timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_every_route_stands_behind_its_door(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG, CREDENTIALS + FAST_FABRIC), token=VIEWER)
    procs.append(server.start())
    fabric_dir = tmp_path / "fabric"  # so that the fabric routes have a fabric to show
    assert run_llmgw("sim", "fabric", "--node-ids", "gpu-01", "--out", str(fabric_dir)).returncode == 0
    cfg = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "2", "--fabric", str(fabric_dir))
    procs.append(start_agent(tmp_path, "gpu-01", cfg, "--stop-engines-on-exit"))
    replica = wait_until(lambda: next((r for r in server.get("/api/v1/replicas") if r["state"] == "ready"), None),
                         "a ready replica", procs=procs)
    fabric = wait_until(lambda: next((f["id"] for f in server.get("/api/v1/fabrics") if f["topology"]), None),
                        "a fabric with its topology", procs=procs)
    ids = {"node": "gpu-01", "replica": replica["id"], "fabric": fabric, "move": "1", "name": replica["model"]}
    # Reads stand behind the viewer door and every change behind the operator door.
    routes = [(r.method, "/api/v1/" + r.path.format(**ids), r.door)
              for r in API_ROUTES] + [("GET", "/metrics", Door.VIEWER)]
    for method, path, door in routes:
        assert door is (Door.VIEWER if method == "GET" else Door.OPERATOR), (method, path, door)
    reads = [(m, p) for m, p, _ in routes if m == "GET"]
    changes = [(m, p) for m, p, _ in routes if m != "GET"]
    assert len(reads) >= 7 and len(changes) >= 3

    with httpx.Client(base_url=server.url, timeout=10) as http:
        for method, path in reads + changes:
            for who, headers in (("nobody", {}), ("an API key", bearer(KEY)),
                                 ("a wrong token", bearer("not-" + OPERATOR))):
                r = http.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, who, r.status_code, r.text)
                error = r.json()["error"]
                assert error["code"] == "unauthorized" and r.headers["www-authenticate"].startswith("Bearer"), r.text
                assert "\n" not in error["message"] and KEY not in error["message"]
        for method, path in reads:
            for token in (VIEWER, OPERATOR):
                r = http.request(method, path, headers=bearer(token))
                # No move has happened yet: past the door, the route itself says so.
                assert r.status_code == (404 if "/moves/" in path else 200), (method, path, r.status_code, r.text)
        # The client door (before the changes below restart the replica): /v1/models with an API key, not
        # without; no fleet credential opens it.
        assert http.get("/v1/models", headers=bearer(KEY)).json()["data"][0]["id"] == "chat"
        for headers in ({}, bearer(OPERATOR), bearer(VIEWER)):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # the OpenAI shape
        # /healthz stays open for load balancers and says nothing but ok.
        r = http.get("/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        for method, path in changes:
            r = http.request(method, path, headers=bearer(VIEWER))
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (method, path, r.text)
            assert "may read the fleet but not change it" in r.json()["error"]["message"]
        # The operator token alone is not enough for a change: a browser could have been made to send
        # it from another site (issue 40); with JSON and X-Llmgw-Request it passes.
        for method, path in changes:
            r = http.request(method, path, headers=bearer(OPERATOR))
            assert r.status_code in (403, 415) and "X-Llmgw-Request: 1" in r.json()["error"]["message"], (method, path)
        # The operator token passes every change (what the change then says is the route's business:
        # gpu-01 is connected, so forgetting it is a 409).
        for method, path in changes:
            r = http.request(method, path, headers=writes(OPERATOR))
            assert r.status_code not in (401, 403, 415), (method, path, r.text)
        assert http.delete("/api/v1/nodes/gpu-01", headers=writes(OPERATOR)).status_code == 409
        # Paths no route knows: a credential first, then 404 (nothing is learned without one).
        assert http.get("/api/v1/nothing").status_code == 401
        assert http.get("/api/v1/nothing", headers=bearer(VIEWER)).status_code == 404

    # Refusals are counted by door and logged without the secret.
    assert metric(server, "llmgw_auth_failures_total", door="viewer") >= 3 * len(reads)
    assert metric(server, "llmgw_auth_failures_total", door="operator") >= 4 * len(changes)
    assert metric(server, "llmgw_auth_failures_total", door="client") >= 3
    log = server.proc.log()
    assert "refused at the viewer door" in log and "refused at the operator door" in log
    assert "refused at the client door" in log
    assert all(secret not in log for secret in (KEY, VIEWER, OPERATOR, "not-" + OPERATOR))
    # The server said at start that the tokens travel in cleartext on this plain-HTTP port.
    assert "cross the network in cleartext" in log


def test_admin_listener_is_the_only_operator_door(tmp_path: Path, procs: list[Proc]) -> None:
    admin_port = free_port()
    config = FAST_FLEET + f"admin_listen: 127.0.0.1:{admin_port}\n" + CREDENTIALS
    server = Server(tmp_path, config)
    procs.append(server.start())
    admin = f"http://127.0.0.1:{admin_port}"
    wait_until(lambda: httpx.get(f"{admin}/healthz", timeout=2).json() == {"status": "ok"}, "the admin listener",
               procs=procs)
    assert f"admin {admin}" in server.proc.log()
    with httpx.Client(timeout=10) as http:
        # The client port: the gateway and /healthz; the operator door is not here, whatever the credential.
        for path in ("/api/v1/nodes", "/api/v1/replicas", "/api/v1/endpoints", "/metrics"):
            assert http.get(server.url + path, headers=bearer(OPERATOR)).status_code == 404, path
        assert http.post(server.url + "/api/v1/reload", headers=writes(OPERATOR)).status_code == 404
        assert http.get(server.url + "/v1/models", headers=bearer(KEY)).status_code == 200
        # The admin listener: the API and metrics behind their doors, no gateway.
        assert http.get(admin + "/api/v1/nodes", headers=bearer(VIEWER)).json() == []
        assert http.get(admin + "/api/v1/nodes").status_code == 401
        assert "llmgw_nodes" in http.get(admin + "/metrics", headers=bearer(VIEWER)).text
        assert http.get(admin + "/v1/models", headers=bearer(KEY)).status_code == 404
    # `llmgw ctl` against the admin listener works; against the client port it finds nothing.
    listed = ctl(admin, "--token", VIEWER, "nodes", "-o", "json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    done = ctl(admin, "--token", OPERATOR, "reload")
    assert done.returncode == 0 and "reloaded" in done.stdout, done.stderr
    missed = ctl(server.url, "--token", VIEWER, "nodes")
    assert missed.returncode == 1 and "HTTP 404" in one_error_line(missed) and "admin listener" in missed.stderr


@pytest.mark.parametrize("credential", [["--token", OPERATOR], ["--cert", "op.crt", "--key", "op.key"]])
def test_ctl_sends_no_credential_in_cleartext_to_another_machine(credential: list[str]) -> None:
    """Issue 21, finding 9: `--server http://…` with a token sent it in cleartext on every call.
    The name resolves nowhere: the refusal comes before any lookup or connection."""
    started = time.monotonic()
    result = ctl("http://llmgw-control.invalid:8080", *credential, "nodes")
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert "refusing to send" in line and "plain http://" in line and "https://" in line and "--insecure" in line, line
    assert OPERATOR not in result.stderr and time.monotonic() - started < 10
    # --insecure sends it anyway, with a warning: here the name resolves nowhere, so it is unreachable.
    forced = ctl("http://llmgw-control.invalid:8080", "--insecure", "--token", OPERATOR, "nodes")
    assert forced.returncode == 3, forced.stderr
    assert "llmgw: warning: sending the token over plain http:// to llmgw-control.invalid (--insecure)" in forced.stderr


def test_engine_failures_reach_the_client_without_internal_addresses(tmp_path: Path, procs: list[Proc]) -> None:
    """Issue 21, finding 11: a 503 carried the engine's internal address and the connection error."""
    dead = free_port()  # nothing listens here
    server = Server(tmp_path, FAST_FLEET + f"endpoints:\n  - model: chat\n    url: http://127.0.0.1:{dead}\n")
    procs.append(server.start())
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-request-id": "rid-21-11"}, timeout=10,
                   json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code in (502, 503), r.text
    message = r.json()["error"]["message"]
    assert "chat" in message and "rid-21-11" in message, message
    for internal in (str(dead), "127.0.0.1", "refused", "connect"):
        assert internal not in r.text, (internal, r.text)
    log = wait_until(lambda: (text := server.proc.log()) and "rid-21-11" in text and text, "the details in the log")
    line = next(line for line in log.splitlines() if "rid-21-11" in line)
    assert f"127.0.0.1:{dead}" in line, line
