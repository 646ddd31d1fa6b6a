"""`gateway.workers: 2` with `public_tls`: the workers terminate the public port's TLS with the
server's certificate, key and client CA (all made by `llmgw ctl cert`), and every door answers
exactly as on a one-process server with the same config: the two servers run side by side and
each request (a real TLS handshake by httpx, a new connection each, ten through the workers so
both of them answer) is compared, status and refusal line. Then one TLS worker is killed under
OpenAI-client load, and a certificate renewed in place and reloaded reaches new handshakes on
both servers.
"""

from __future__ import annotations

import re
import signal
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmgw.server.forgery import WRITE_HEADERS
from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    bearer,
    ctl,
    file_serial,
    run_llmgw,
    served_serial,
    start_sim_engine,
    token_digest,
    wait_until,
)
from tests.e2e.test_gateway_workers import both_serve, client, kill_one_under_load, two_workers

KEY, VIEWER, OPERATOR = "sk-workers-tls-51c2", "viewer-workers-tls-8e0a", "operator-workers-tls-c3d7"
TRIES = 10  # new connections per request through the workers: the kernel hands them to both


def cert(cadir: Path, *args: str) -> None:
    result = run_llmgw("ctl", "cert", *args, "--dir", str(cadir))
    assert result.returncode == 0, result.stderr


class Pair:
    """A one-process server and a two-worker server, same config, same certificate files."""

    def __init__(self, single: Server, workers: Server, cadir: Path, other_ca: Path, procs: list[Proc]) -> None:
        self.single, self.workers, self.cadir, self.other_ca, self.procs = single, workers, cadir, other_ca, procs

    def http(self, server: Server, name: str | None = None, ca_dir: Path | None = None) -> httpx.Client:
        """A client that verifies the server's CA and presents `name`'s certificate ('viewer-grafana')."""
        context = ssl.create_default_context(cafile=str(self.cadir / "ca.crt"))
        if name is not None:
            where = ca_dir or self.cadir
            context.load_cert_chain(where / f"{name}.crt", where / f"{name}.key")
        return httpx.Client(base_url=server.url, verify=context, timeout=15,
                            limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("workers-tls")
    cadir, other = tmp / "ca", tmp / "other-ca"
    cert(cadir, "init", "--name", "workers TLS test CA")
    cert(cadir, "server", "--host", "localhost", "--ip", "127.0.0.1")
    cert(cadir, "operator", "alice")
    cert(cadir, "viewer", "grafana")
    cert(cadir, "viewer", "mallory")
    cert(cadir, "revoke", "mallory")
    cert(cadir, "node", "gpu-01")
    cert(cadir, "gateway", "gw-1")
    cert(other, "init", "--name", "another cluster's CA")
    cert(other, "viewer", "grafana")
    procs: list[Proc] = []
    try:
        engine, url = start_sim_engine(tmp, "engine", "--served-model-name", "chat", "--ttft-ms", "1", "--itl-ms", "1")
        procs.append(engine)
        files = f"  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n"

        def config(workers: int) -> str:
            return FAST_FLEET + f"""\
tls:
{files}  deny_list: {cadir / 'revoked.json'}
public_tls:
{files}gateway:
  workers: {workers}
  api_keys: ["{token_digest(KEY)}"]
api:
  viewer_tokens: ["{token_digest(VIEWER)}"]
  operator_tokens: ["{token_digest(OPERATOR)}"]
endpoints:
  - model: chat
    url: {url}
"""

        single = Server(tmp, config(1), name="single", insecure=False, public_ca=cadir / "ca.crt", token=VIEWER)
        procs.append(single.start())
        workers = Server(tmp, config(2), name="workers", insecure=False, public_ca=cadir / "ca.crt", token=VIEWER)
        procs.append(workers.start())
        two_workers(workers, procs)
        yield Pair(single, workers, cadir, other, procs)
    finally:
        for p in reversed(procs):
            p.stop(timeout=10)
            p.kill_group()


def test_clients_verifying_the_ca_are_served_by_both_tls_workers(pair: Pair) -> None:
    c = client(pair.workers, retries=0, api_key=KEY)
    reply = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.content
    both_serve(pair.workers, pair.procs, api_key=KEY)  # per-worker counts from the one /metrics
    # A client that does not trust the CA is refused by the handshake, on its side.
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=f"{pair.workers.url}/v1", api_key=KEY, max_retries=0).models.list()


def outcome(http: httpx.Client, method: str, path: str, headers: dict[str, str]) -> tuple[Any, ...]:
    """What the caller learns: the status and the refusal's line, or how the connection failed.
    A change carries what ctl sends besides its credential (server/forgery.py)."""
    try:
        answer = http.request(method, path, headers=headers if method == "GET" else {**WRITE_HEADERS, **headers})
    except httpx.HTTPError as exc:
        return ("no answer", type(exc).__name__)
    if answer.status_code < 400:
        return (answer.status_code,)
    if answer.headers.get("content-type", "").startswith("application/json"):
        return answer.status_code, answer.json()["error"]["message"]
    alert = re.search(r'<p class="crit" role="alert">([^<]*)</p>', answer.text)
    return answer.status_code, alert.group(1) if alert else answer.text[:200]


# A forged header: the operator certificate's fields, as a worker would pass them on. A client
# that sends it is still whoever its own certificate (or none) says.
FORGED = {"x-llmgw-peer-certificate": '{"subject":[[["organizationalUnitName","operators"]],[["commonName","alice"]]],'
                                      '"serialNumber":"01"}'}
REQUESTS = [("GET", "/v1/models"), ("GET", "/api/v1/nodes"), ("GET", "/metrics"), ("GET", "/admin/"),
            ("POST", "/api/v1/reload")]


def test_every_door_answers_through_a_tls_worker_as_on_one_process(pair: Pair) -> None:
    callers: list[tuple[str, str | None, Path | None, dict[str, str]]] = [
        ("nobody", None, None, {}),
        ("an API key", None, None, bearer(KEY)),
        ("a viewer token", None, None, bearer(VIEWER)),
        ("an operator token", None, None, bearer(OPERATOR)),
        ("a wrong token", None, None, bearer("not-" + OPERATOR)),
        ("a viewer certificate", "viewer-grafana", None, {}),
        ("an operator certificate", "operator-alice", None, {}),
        ("a node certificate", "node-gpu-01", None, {}),
        ("a gateway certificate", "gateway-gw-1", None, {}),
        ("a revoked viewer certificate", "viewer-mallory", None, {}),
        ("another CA's viewer certificate", "viewer-grafana", pair.other_ca, {}),
        ("nobody with a forged header", None, None, FORGED),
        ("a viewer certificate with a forged header", "viewer-grafana", None, FORGED),
        ("an API key with a forged address", None, None, {**bearer(KEY), "x-llmgw-peer-address": "10.0.0.1:1"}),
    ]
    seen: dict[str, set[tuple[Any, ...]]] = {}
    for who, name, ca_dir, headers in callers:
        with pair.http(pair.single, name, ca_dir) as one, pair.http(pair.workers, name, ca_dir) as two:
            for method, path in REQUESTS:
                want = outcome(one, method, path, headers)
                got = {outcome(two, method, path, headers) for _ in range(TRIES)}
                assert got == {want}, (who, method, path, want, got)
                seen.setdefault(who, set()).add(want)
    # The comparison is worth something only if the doors differ: spot-check what they said.
    assert (200,) in seen["an operator certificate"] and (200,) in seen["a viewer certificate"]
    assert any(o[0] == 403 and "'grafana' may read the fleet but not change it" in o[1]
               for o in seen["a viewer certificate with a forged header"])
    assert any(o[0] == 401 and "'mallory' is revoked" in o[1] for o in seen["a revoked viewer certificate"])
    assert any(o[0] == 401 and "a node certificate" in o[1] for o in seen["a node certificate"])
    assert all(o[0] == "no answer" for o in seen["another CA's viewer certificate"])  # the handshake refuses it
    assert all(o[0] in (401, 403) for o in seen["nobody with a forged header"])


def test_plain_http_on_the_tls_port_meets_what_one_process_gives(pair: Pair) -> None:
    """A 400 in plain text that says to use https:// (and the server's log line), never an empty reply."""
    def plain(server: Server) -> str:
        try:
            answer = httpx.get(server.url.replace("https://", "http://") + "/v1/models", headers=bearer(KEY),
                               timeout=10)
        except httpx.HTTPError as exc:
            return type(exc).__name__
        return f"{answer.status_code} {answer.text[:200]}"

    want = plain(pair.single)
    assert {plain(pair.workers) for _ in range(TRIES)} == {want}
    assert want.startswith("400 ") and "plain HTTP request on a TLS port; use an https:// URL" in want
    for server in (pair.single, pair.workers):
        assert server.proc is not None
        wait_until(lambda server=server: "did not speak TLS (is it configured with an http:// URL" in server.proc.log(),
                   f"{server.name}'s log line for the plain-HTTP client")


def test_a_tls_worker_killed_under_load_comes_back(pair: Pair) -> None:
    workers = two_workers(pair.workers, pair.procs)
    back = kill_one_under_load(pair.workers, workers, pair.procs, api_key=KEY)
    assert back["worker-1"]["pid"] == workers["worker-1"]["pid"]


def test_a_certificate_renewed_in_place_reaches_new_handshakes_on_reload(pair: Pair) -> None:
    crt = pair.cadir / "server.crt"
    before = file_serial(crt)
    for server in (pair.single, pair.workers):
        assert {served_serial(server.public_port, pair.cadir / "ca.crt") for _ in range(TRIES)} == {before}
    cert(pair.cadir, "server", "--host", "localhost", "--ip", "127.0.0.1", "--force")
    after = file_serial(crt)
    assert after != before
    # Not before a reload: the running certificate stays until the operator says so.
    assert served_serial(pair.workers.public_port, pair.cadir / "ca.crt") == before

    assert pair.single.proc is not None
    pair.single.proc.signal(signal.SIGHUP)
    result = ctl(pair.workers.url, "reload", env={"LLMGW_TOKEN": OPERATOR, "LLMGW_CA": str(pair.cadir / "ca.crt")})
    assert result.returncode == 0, result.stderr
    assert "public port certificate re-read" in result.stdout  # the operator reads that it took
    for server in (pair.single, pair.workers):
        wait_until(lambda server=server: {served_serial(server.public_port, pair.cadir / "ca.crt")
                                          for _ in range(TRIES)} == {after},
                   f"{server.name}: every new handshake to see the renewed certificate", procs=pair.procs)
    assert pair.workers.proc is not None
    log = pair.workers.proc.log()
    for worker in ("worker-0", "worker-1"):
        assert f"gateway {worker}: public port TLS reloaded from {crt}" in log
    # Clients keep being served on the renewed certificate.
    both_serve(pair.workers, pair.procs, api_key=KEY)
