"""`llmgw gateway --control-plane URL`: a gateway-only process follows a real control plane over
its fleet port. Replicas added and removed show up in its rotation; with the control plane
stopped it serves on with its last endpoint set and says so; restarted, it follows again. Over
TLS only a gateway certificate may follow, and a gateway certificate is never a node."""

from __future__ import annotations

import re
import signal
import ssl
import time
from pathlib import Path

import httpx
import openai

from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    ctl,
    engines_config,
    file_serial,
    free_port,
    make_sim_node,
    one_error_line,
    run_llmgw,
    served_serial,
    start_agent,
    start_sim_engine,
    wait_until,
)

CATALOG = """\
models:
  - name: chat
    replicas: {n}
    profiles:
      - engine: sim
        gpus: 1
        args: ["--ttft-ms", "1", "--itl-ms", "1"]
"""

ROTATION = re.compile(r'^llmgw_endpoint_healthy\{endpoint="([^"]+)",model="chat"\} ', re.M)


def rotation(url: str) -> set[str]:
    return set(ROTATION.findall(httpx.get(f"{url}/metrics", timeout=5).text))


def connected(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return float(re.search(r"^llmgw_gateway_control_plane_connected (\S+)", text, re.M).group(1))  # type: ignore[union-attr]


def ready_endpoints(server: Server) -> set[str]:
    return {s["endpoint"] for r in server.get("/api/v1/replicas") if r["state"] == "ready"
            for s in r["shards"] if s.get("endpoint") and s.get("rank", 0) == 0}


def start_gateway(tmp: Path, name: str, control_plane: str, *args: str) -> tuple[Proc, str, str]:
    """The process, its client URL and its metrics URL (--metrics-listen)."""
    port, metrics = free_port(), free_port()
    proc = Proc(name, ["gateway", "--control-plane", control_plane, "--listen", f"127.0.0.1:{port}",
                       "--metrics-listen", f"127.0.0.1:{metrics}", *args], tmp)
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}"


def scale(server: Server, n: int) -> None:
    server.config.write_text(engines_config(CATALOG.format(n=n)))
    result = ctl(server.url, "reload")
    assert result.returncode == 0, result.stderr


def followed(server: Server, gw_metrics: str, what: str, procs: list[Proc]) -> set[str]:
    """Wait until the gateway's rotation is the control plane's ready set; say how long it took."""
    want = wait_until(lambda: (r := ready_endpoints(server)) and r, f"{what}: ready in the control plane", procs=procs)
    seen = time.monotonic()
    got = wait_until(lambda: rotation(gw_metrics) == ready_endpoints(server) and rotation(gw_metrics),
                     f"{what}: the gateway's rotation to follow", procs=procs)
    print(f"\n{what}: in the gateway's rotation {time.monotonic() - seen:.3f}s after the control plane showed it")
    assert got == want or got == ready_endpoints(server)
    return got


def test_a_gateway_only_process_follows_the_control_plane(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, engines_config(CATALOG.format(n=1)))
    procs.append(server.start())
    agent = start_agent(tmp_path, "node-a", make_sim_node(tmp_path, "node-a", server.fleet_url))
    procs.append(agent)
    gw_proc, gw, gw_metrics = start_gateway(tmp_path, "gateway", server.fleet_url, "--insecure")
    procs.append(gw_proc)
    wait_until(lambda: httpx.get(f"{gw}/healthz", timeout=2).status_code == 200, "the gateway to serve", procs=procs)
    one = followed(server, gw_metrics, "the first replica", procs)
    assert len(one) == 1
    # Its metrics name engine addresses: on the metrics listener, never on the client port.
    assert httpx.get(f"{gw}/metrics", timeout=5).status_code == 404

    client = openai.OpenAI(base_url=f"{gw}/v1", api_key="unused", max_retries=0, timeout=30)

    def chat() -> None:
        r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].message.content

    chat()
    scale(server, 2)  # an engine added ...
    wait_until(lambda: len(ready_endpoints(server)) == 2, "a second replica ready", procs=procs)
    assert len(followed(server, gw_metrics, "a replica added", procs)) == 2
    scale(server, 1)  # ... and one removed
    wait_until(lambda: len(ready_endpoints(server)) == 1, "back to one replica", procs=procs)
    kept = followed(server, gw_metrics, "a replica removed", procs)
    assert len(kept) == 1

    # The control plane stops: the gateway serves on with what it had, and says so.
    assert server.proc is not None
    server.proc.stop()
    procs.remove(server.proc)
    wait_until(lambda: connected(gw_metrics) == 0, "the gateway to notice", procs=[gw_proc])
    for _ in range(5):
        chat()
    assert rotation(gw_metrics) == kept
    assert "lost the control plane" in gw_proc.log() and "serving with the last endpoint set" in gw_proc.log()

    # Back: it follows again, and a change made now reaches it.
    procs.append(server.start())
    wait_until(lambda: connected(gw_metrics) == 1, "the gateway to follow again", procs=procs)
    assert "following the control plane at" in gw_proc.log()
    wait_until(lambda: len(ready_endpoints(server)) == 1, "the engine adopted by the new control plane", procs=procs)
    scale(server, 2)
    wait_until(lambda: len(ready_endpoints(server)) == 2, "a second replica after the restart", procs=procs)
    assert len(followed(server, gw_metrics, "a replica added after the restart", procs)) == 2
    chat()


def cert(cadir: Path, *args: str) -> None:
    result = run_llmgw("ctl", "cert", *args, "--dir", str(cadir))
    assert result.returncode == 0, result.stderr


def test_only_a_gateway_certificate_follows_as_a_gateway(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    cert(cadir, "init")
    cert(cadir, "server", "--ip", "127.0.0.1")
    cert(cadir, "gateway", "gw-1")
    cert(cadir, "node", "gpu-01")
    cert(cadir, "viewer", "dash")
    engine_port = free_port()  # a static endpoint: what the gateway is told, no engine needed
    config = FAST_FLEET + (
        f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n"
        f"  require_identity: false\n"
        f"endpoints:\n  - model: chat\n    url: http://127.0.0.1:{engine_port}\n"
    )
    server = Server(tmp_path, config, insecure=False)
    procs.append(server.start())
    ca = str(cadir / "ca.crt")

    def gateway(name: str, crt: str) -> tuple[Proc, str, str]:
        proc, url, metrics = start_gateway(tmp_path, f"gateway-{name}", server.fleet_url,
                                  "--cert", str(cadir / f"{crt}.crt"), "--key", str(cadir / f"{crt}.key"), "--ca", ca)
        procs.append(proc)
        return proc, url, metrics

    good, good_url, good_metrics = gateway("good", "gateway-gw-1")
    wait_until(lambda: httpx.get(f"{good_url}/healthz", timeout=2).status_code == 200, "the gateway to follow",
               procs=procs)
    assert rotation(good_metrics) == {f"http://127.0.0.1:{engine_port}"}
    # Its name in the control plane's metrics is its certificate's.
    wait_until(lambda: 'worker="gw-1"' in httpx.get(f"{server.url}/metrics", timeout=5).text,
               "the gateway's metrics in the control plane's scrape", procs=procs)
    assert "gateway gw-1 serving (following" in good.log()  # its own log says the same name

    for name, crt in (("node", "node-gpu-01"), ("viewer", "viewer-dash")):
        bad, _, _ = gateway(name, crt)
        wait_until(lambda bad=bad: "not a gateway certificate" in bad.log(),
                   f"a {name} certificate refused as a gateway",
                   procs=procs)
        assert " serving (following" not in bad.log()  # it never got a configuration, so it never opened its port
    # Each dialled again (two refusals each) and never said it follows: a refused stream is not following.
    wait_until(lambda: re.search(r'^llmgw_fleet_refused_total\{reason="not_gateway"\} ([4-9]|\d\d)',
                                 httpx.get(f"{server.url}/metrics", timeout=5).text, re.M),
               "each refused gateway to dial again", procs=procs)
    for proc in procs:
        if proc.name in ("gateway-node", "gateway-viewer"):
            assert "following the control plane" not in proc.log(), proc.log()
            assert proc.log().count("cannot follow the control plane") == 1, proc.log()
            assert "not serving until it does" in proc.log()

    # A gateway certificate never registers as a node, even with require_identity off.
    node_dir = tmp_path / "gw-as-node"
    result = run_llmgw("sim", "node", "--dir", str(node_dir), "--node-id", "gw-1", "--server", server.fleet_url)
    assert result.returncode == 0, result.stderr
    agent_cfg = node_dir / "agent.yaml"
    agent_cfg.write_text(agent_cfg.read_text() + f"tls:\n  ca: {ca}\n  cert: {cadir / 'gateway-gw-1.crt'}\n"
                                                  f"  key: {cadir / 'gateway-gw-1.key'}\n")
    agent = Proc("agent-gw", ["agent", "--config", str(agent_cfg)], tmp_path)
    procs.append(agent)
    wait_until(lambda: "not a node certificate" in agent.log(), "the gateway certificate refused as a node",
               procs=[server.proc] if server.proc else [])
    assert server.nodes() == {}


def test_a_remote_gateway_serves_its_clients_over_tls(tmp_path: Path, procs: list[Proc]) -> None:
    """--public-tls-cert/--public-tls-key: a client that verifies the CA is served; SIGHUP re-reads
    a certificate renewed in place, as the server's reload does for its public port."""
    cadir = tmp_path / "ca"
    cert(cadir, "init")
    cert(cadir, "server", "--ip", "127.0.0.1")
    ca = cadir / "ca.crt"
    engine, engine_url = start_sim_engine(tmp_path, "engine", "--served-model-name", "chat", "--ttft-ms", "1",
                                          "--itl-ms", "1")
    procs.append(engine)
    server = Server(tmp_path, FAST_FLEET + f"endpoints:\n  - model: chat\n    url: {engine_url}\n")
    procs.append(server.start())
    gw_proc, plain_url, _ = start_gateway(tmp_path, "gateway", server.fleet_url, "--insecure",
                                          "--public-tls-cert", str(cadir / "server.crt"),
                                          "--public-tls-key", str(cadir / "server.key"))
    procs.append(gw_proc)
    url = plain_url.replace("http://", "https://")
    port = int(url.rsplit(":", 1)[1])
    verify = ssl.create_default_context(cafile=str(ca))
    wait_until(lambda: httpx.get(f"{url}/healthz", timeout=2, verify=verify).status_code == 200,
               "the gateway to serve over TLS", procs=procs)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=verify, timeout=30))
    reply = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.content
    plain = httpx.get(f"{plain_url}/healthz", timeout=5)  # plain HTTP on its TLS port: as on the server's
    assert plain.status_code == 400 and "use an https:// URL" in plain.json()["error"]["message"]
    wait_until(lambda: "did not speak TLS" in gw_proc.log(), "the gateway's line for the plain-HTTP client",
               procs=procs)

    before = served_serial(port, ca)
    assert before == file_serial(cadir / "server.crt")
    cert(cadir, "server", "--ip", "127.0.0.1", "--force")
    after = file_serial(cadir / "server.crt")
    gw_proc.signal(signal.SIGHUP)
    wait_until(lambda: served_serial(port, ca) == after, "new handshakes to see the renewed certificate", procs=procs)
    assert f"client port certificate re-read from {cadir / 'server.crt'}" in gw_proc.log()
    reply = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "again"}], max_tokens=2)
    assert reply.choices[0].message.content

    # A renewal that went wrong (a key of another pair) is one line; the running certificate stays.
    (cadir / "server.key").write_bytes((cadir / "ca.key").read_bytes())
    gw_proc.signal(signal.SIGHUP)
    wait_until(lambda: "the running certificate stays" in gw_proc.log(), "the refused renewal's line", procs=procs)
    assert served_serial(port, ca) == after and gw_proc.alive()


def test_a_remote_gateway_with_unusable_tls_files_says_so_in_one_line(tmp_path: Path) -> None:
    cadir = tmp_path / "ca"
    cert(cadir, "init")
    cert(cadir, "server", "--ip", "127.0.0.1")
    cert(cadir, "viewer", "dash")
    crt = str(cadir / "server.crt")

    def gateway(*args: str) -> str:
        result = run_llmgw("gateway", "--control-plane", "http://127.0.0.1:9", "--insecure",
                           "--listen", f"127.0.0.1:{free_port()}", *args, timeout=30)
        assert result.returncode == 2, (result.returncode, result.stderr)
        return one_error_line(result)

    missing = str(tmp_path / "missing.key")
    assert f"key file {missing} does not exist" in gateway("--public-tls-cert", crt, "--public-tls-key", missing)
    other = str(cadir / "viewer-dash.key")
    assert f"key file {other} does not match certificate {crt}" in gateway("--public-tls-cert", crt,
                                                                          "--public-tls-key", other)
    assert "--public-tls-key is missing" in gateway("--public-tls-cert", crt)
