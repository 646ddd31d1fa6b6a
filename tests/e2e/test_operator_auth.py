"""The public port's security end to end: who may call the mutating API (reload, forget, restart).

Real `llmgw server` and `llmgw ctl` processes, real TLS handshakes on the public port, and
certificates and token hashes made by the CLI an operator uses (`ctl cert`, `ctl hash-secret`).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    ctl,
    one_error_line,
    run_llmgw,
    start_sim_engine,
    wait_until,
)

TOKEN = "op-token-5f0c2a9e71"


def llmgw_ok(*args: str, stdin: str | None = None) -> str:
    result = run_llmgw(*args, input=stdin)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cluster CA with a server certificate for 127.0.0.1, an operator and a node certificate."""
    cadir = tmp_path_factory.mktemp("pki") / "ca"
    llmgw_ok("ctl", "cert", "init", "--dir", str(cadir), "--name", "test CA")
    llmgw_ok("ctl", "cert", "server", "--dir", str(cadir), "--host", "localhost", "--ip", "127.0.0.1")
    llmgw_ok("ctl", "cert", "operator", "alice", "--dir", str(cadir))
    llmgw_ok("ctl", "cert", "viewer", "grafana", "--dir", str(cadir))
    llmgw_ok("ctl", "cert", "node", "gpu-01", "--dir", str(cadir))
    return cadir


@pytest.fixture(scope="module")
def token_hash() -> str:
    line = llmgw_ok("ctl", "hash-secret", stdin=TOKEN + "\n").strip()
    assert line.startswith("sha256:") and TOKEN not in line
    return line


def public_tls(cadir: Path) -> str:
    return f"public_tls:\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n  ca: {cadir / 'ca.crt'}\n"


def tokens(*hashes: str) -> str:
    return "api:\n  operator_tokens: [" + ", ".join(f'"{h}"' for h in hashes) + "]\n"


def refused(result, status: int = 401) -> str:  # type: ignore[no-untyped-def]
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    line = one_error_line(result)
    assert f"HTTP {status}" in line
    return line


def test_operator_credentials_on_the_tls_public_port(tmp_path: Path, procs: list[Proc], pki: Path,
                                                     token_hash: str) -> None:
    engine, engine_url = start_sim_engine(tmp_path, "engine", "--served-model-name", "chat", "--ttft-ms", "1",
                                          "--itl-ms", "1")
    procs.append(engine)
    base = FAST_FLEET + public_tls(pki) + f"endpoints:\n  - model: chat\n    url: {engine_url}\n"
    # --insecure (plain fleet port), but operator credentials are configured: nobody gets in without one.
    server = Server(tmp_path, base + tokens(token_hash), public_ca=pki / "ca.crt")
    procs.append(server.start())
    url, ca = server.url, str(pki / "ca.crt")
    operator = ["--cert", str(pki / "operator-alice.crt"), "--key", str(pki / "operator-alice.key")]
    node = ["--cert", str(pki / "node-gpu-01.crt"), "--key", str(pki / "node-gpu-01.key")]

    # No credential: each mutating call is one line with the 401 and how to get in.
    for args in (["reload"], ["forget", "gpu-09"], ["restart", "r-nope"]):
        line = refused(ctl(url, "--ca", ca, *args))
        assert "needs an operator credential" in line and "--token" in line and "cert operator" in line, line
    # A wrong token, by flag or by environment.
    line = refused(ctl(url, "--ca", ca, "--token", "not-" + TOKEN, "reload"))
    assert "operator token was refused" in line and "not-" + TOKEN not in line
    refused(ctl(url, "--ca", ca, "reload", env={"LLMGW_TOKEN": TOKEN.upper()}))
    # The right token, by flag and by environment.
    ok = ctl(url, "--ca", ca, "--token", TOKEN, "reload")
    assert ok.returncode == 0 and "reloaded" in ok.stdout, ok.stderr
    ok = ctl(url, "--ca", ca, "reload", env={"LLMGW_TOKEN": TOKEN})
    assert ok.returncode == 0 and "reloaded" in ok.stdout, ok.stderr
    # With a credential the call itself runs: an unknown node is a 404, not a 401.
    refused(ctl(url, "--ca", ca, "--token", TOKEN, "forget", "gpu-09"), status=404)
    refused(ctl(url, "--ca", ca, "--token", TOKEN, "restart", "r-nope"), status=404)

    # An operator certificate over TLS is a credential; a node certificate of the same CA is not.
    ok = ctl(url, "--ca", ca, *operator, "reload")
    assert ok.returncode == 0 and "reloaded" in ok.stdout, ok.stderr
    wait_until(lambda: "reload requested by operator certificate 'alice'" in server.proc.log(),
               "the operator named in the log")
    line = refused(ctl(url, "--ca", ca, *node, "reload"))
    assert "'gpu-01' is not an operator certificate" in line and "cert operator" in line

    # A certificate from another CA: the handshake fails, and ctl says why in one line.
    other = tmp_path / "other-ca"
    llmgw_ok("ctl", "cert", "init", "--dir", str(other))
    llmgw_ok("ctl", "cert", "operator", "mallory", "--dir", str(other))
    result = ctl(url, "--ca", ca, "--cert", str(other / "operator-mallory.crt"),
                 "--key", str(other / "operator-mallory.key"), "reload")
    assert result.returncode == 1 and "refused our client certificate" in one_error_line(result)

    # Reads of the fleet need a credential too (one is configured); an operator's works, a node's does not.
    line = refused(ctl(url, "--ca", ca, "nodes"))
    assert "viewer or operator credential" in line and "cert viewer" in line, line
    refused(ctl(url, "--ca", ca, *node, "nodes"))
    # A viewer certificate (OU=viewers) reads, and is refused a change with 403.
    viewer = ["--cert", str(pki / "viewer-grafana.crt"), "--key", str(pki / "viewer-grafana.key")]
    listed = ctl(url, "--ca", ca, *viewer, "replicas", "-o", "json")
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stderr
    line = refused(ctl(url, "--ca", ca, *viewer, "reload"), status=403)
    assert "viewer certificate 'grafana' may read the fleet but not change it" in line, line
    listed = ctl(url, "--ca", ca, *operator, "nodes", "-o", "json")
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stderr
    listed = ctl(url, "--ca", ca, "--token", TOKEN, "endpoints", "-o", "json")
    assert listed.returncode == 0 and engine_url in listed.stdout, listed.stderr
    # The gateway needs no operator credential and no client certificate (no API keys here).
    with httpx.Client(verify=server.verify, timeout=30) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", http_client=http, max_retries=0)
        assert [m.id for m in client.models.list()] == ["chat"]
        chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.content
        assert http.get(f"{url}/api/v1/replicas").status_code == 401
        denied = http.post(f"{url}/api/v1/reload")
        assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Bearer")
        assert denied.json()["error"]["code"] == "unauthorized"

    # ctl without --ca: the server's certificate cannot be verified; one line that says what to do.
    result = ctl(url, "nodes")
    assert result.returncode == 1
    line = one_error_line(result)
    assert "certificate verify failed" in line and "--ca" in line, line
    # http:// to the TLS port: not "is the server running?", but "use https://".
    result = ctl(url.replace("https://", "http://"), "nodes")
    assert result.returncode == 3 and "https://" in one_error_line(result)

    # Reload without api.operator_tokens: the token stops working; the public port's CA still
    # makes operator certificates a credential, so --insecure opens nothing.
    server.config.write_text(base)
    assert ctl(url, "--ca", ca, "--token", TOKEN, "reload").returncode == 0
    refused(ctl(url, "--ca", ca, "--token", TOKEN, "reload"))
    line = refused(ctl(url, "--ca", ca, "reload"))
    assert "cert operator" in line and "api.operator_tokens" not in line, line
    assert ctl(url, "--ca", ca, *operator, "reload").returncode == 0
    assert TOKEN not in server.proc.log()


def test_insecure_server_is_open_only_without_operator_credentials(tmp_path: Path, procs: list[Proc],
                                                                   token_hash: str) -> None:
    server = Server(tmp_path, FAST_FLEET)
    procs.append(server.start())
    # --insecure and no operator credential configured: a lab; anyone may act.
    ok = ctl(server.url, "reload")
    assert ok.returncode == 0 and "reloaded" in ok.stdout, ok.stderr
    wait_until(lambda: "reload requested by anyone (--insecure and no credentials configured)" in server.proc.log(),
               "the open door logged")
    # Configure a token (the reload itself is still open): from then on only the token works.
    server.config.write_text(FAST_FLEET + tokens(token_hash))
    assert ctl(server.url, "reload").returncode == 0
    line = refused(ctl(server.url, "reload"))
    assert "--token" in line
    refused(ctl(server.url, "restart", "r-nope"))
    assert ctl(server.url, "--token", TOKEN, "reload").returncode == 0
    # Back to no credentials: open again (the rule follows the live config, not the one at start).
    server.config.write_text(FAST_FLEET)
    assert ctl(server.url, "--token", TOKEN, "reload").returncode == 0
    assert ctl(server.url, "reload").returncode == 0

    # https:// to this plain-HTTP port: one line at once (not a 30 s wait for a request head).
    started = time.monotonic()
    result = ctl(server.url.replace("http://", "https://"), "nodes")
    assert result.returncode == 1 and "does not speak TLS" in one_error_line(result)
    assert time.monotonic() - started < 8


def test_secure_server_without_operator_credentials_refuses_everyone(tmp_path: Path, procs: list[Proc],
                                                                     pki: Path) -> None:
    # The fleet port on TLS (no --insecure) and no operator credential at all: nobody may act,
    # and the refusal says what to configure.
    fleet_tls = f"tls:\n  ca: {pki / 'ca.crt'}\n  cert: {pki / 'server.crt'}\n  key: {pki / 'server.key'}\n"
    server = Server(tmp_path, FAST_FLEET + fleet_tls, insecure=False)
    procs.append(server.start())
    line = refused(ctl(server.url, "reload"))
    assert "no operator credential is configured" in line and "api.operator_tokens" in line, line
    refused(ctl(server.url, "--token", TOKEN, "reload"))
    assert ctl(server.url, "nodes", "-o", "json").returncode == 0
