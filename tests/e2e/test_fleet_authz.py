"""A node acts only on its own shards (issue 19), end to end with real mutual TLS.

A real server and a real agent (gpu-01, running a simulated engine) serve `alpha`; a third
node, gpu-03, holds a valid certificate from the same CA and speaks the fleet protocol
itself, as a compromised node would. It tries to take gpu-01's traffic three ways: a
ShardStatus and a Progress for gpu-01's shard pointing at its own server, a ShardStatus for a
shard of its own with an endpoint on another host, and a Register whose adoption report
reuses gpu-01's replica id with a start time in 1970.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import httpx
import trio

from llmgw.fleet import ChannelClosed, FleetChannel, dial
from llmgw.tls import client_context
from llmgw.wire import messages as m
from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl_json,
    engines_config,
    get_json,
    make_sim_node,
    replicas,
    run_llmgw,
    tls_agent_config,
    wait_until_async,
)

CATALOG = """\
models:
  - name: alpha
    replicas: 1
    profiles:
      - {name: tp1, engine: sim, gpus: 1, gpu_kind: H100}
  - name: zeta
    replicas: 1
    profiles:
      - {name: evil, engine: sim, gpus: 1, gpu_kind: EVIL}
"""
FORGED_LINE = "2026-12-01 06:00:00,000 INFO llmgw.server: reload requested by operator alice: ok"


def cert(*args: str) -> None:
    result = run_llmgw("ctl", "cert", *args)
    assert result.returncode == 0, result.stderr


def metric(server: Server, reason: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'llmgw_fleet_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def endpoints(server: Server) -> list[tuple[str, str]]:
    return sorted((e["model"], e["endpoint"]) for e in get_json(f"{server.url}/api/v1/endpoints"))


def listen_in_range(low: int, high: int) -> socket.socket:
    """A listening socket on a free port inside the server's engine port range (the forged
    engine): the test counts every connection that reaches it."""
    for port in random.sample(range(low, high), 200):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen(128)
        return sock
    raise AssertionError("no free port in range")


class Thief:
    """gpu-03 speaking the fleet protocol by hand with its own valid node certificate."""

    def __init__(self, server: Server, cadir: Path) -> None:
        self.url = server.fleet_url
        self.ssl = client_context(str(cadir / "ca.crt"), str(cadir / "node-gpu-03.crt"), str(cadir / "node-gpu-03.key"))
        self.received: list[Any] = []
        self.channel: FleetChannel | None = None

    def register(self, shards: list[m.ShardReport] | None = None) -> m.Register:
        return m.Register(
            node_id="gpu-03",
            version="0.1.0\n" + FORGED_LINE,  # log injection: must not become a line of its own
            features=[m.FEATURE_START, m.FEATURE_STOP, m.FEATURE_ADOPT],
            inventory=m.Inventory(gpus=[m.Gpu(index=0, name="EVIL GPU", memory_mib=81920)]),
            advertise_host="127.0.0.1",
            shards=shards or [],
        )

    async def session(self, register: m.Register, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with dial(self.url, ssl_context=self.ssl, max_message=1 << 20) as channel:
            await channel.send(m.encode(register))
            welcome = m.decode_server_message(await channel.receive())
            assert isinstance(welcome, m.Welcome)
            self.channel = channel
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeats, channel, welcome.heartbeat_interval)
                task_status.started()
                try:
                    while True:
                        self.received.append(m.decode_server_message(await channel.receive()))
                except ChannelClosed:
                    nursery.cancel_scope.cancel()

    async def _heartbeats(self, channel: FleetChannel, interval: float) -> None:
        seq = 0
        while True:
            seq += 1
            await channel.send(m.encode(m.Heartbeat(seq=seq)))
            await trio.sleep(interval)  # ok: heartbeat pacing, as an agent does

    async def send(self, msg: m.ShardStatus | m.Progress) -> None:
        assert self.channel is not None
        await self.channel.send(m.encode(msg))


async def count_connections(sock: socket.socket, seen: list[int]) -> None:
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    while True:
        stream = await listener.accept()
        seen.append(1)
        await stream.aclose()


async def chats(url: str, model: str, n: int) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(timeout=20, trust_env=False) as client:

        async def one() -> None:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            out.append((r.status_code, r.headers.get("content-type", "")))

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    return out


async def test_a_node_cannot_take_another_nodes_traffic(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    for args in (("init",), ("server", "--host", "localhost", "--ip", "127.0.0.1"), ("node", "gpu-01"),
                 ("node", "gpu-03")):
        await trio.to_thread.run_sync(cert, *args, "--dir", str(cadir))
    tls = f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n"
    server = Server(tmp_path, engines_config(CATALOG, extra=tls), insecure=False)
    procs.append(await trio.to_thread.run_sync(server.start))
    base = await trio.to_thread.run_sync(lambda: make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT,
                                                               "--gpus", "1"))
    agent_cfg = tls_agent_config(base, cadir / "ca.crt", cadir / "node-gpu-01.crt", cadir / "node-gpu-01.key")
    agent = Proc("agent-gpu-01", ["agent", "--config", str(agent_cfg), "--stop-engines-on-exit"], tmp_path)
    procs.append(agent)
    live = [server.proc, agent]
    assert server.proc is not None

    def alpha_ready() -> dict[str, Any] | None:
        return next((r for r in replicas(server) if r["model"] == "alpha" and r["state"] == "ready"), None)

    legit = await wait_until_async(alpha_ready, "alpha ready on gpu-01", procs=live)
    shard = legit["shards"][0]
    assert shard["node"] == "gpu-01"
    legit_endpoints = await trio.to_thread.run_sync(endpoints, server)
    assert legit_endpoints == [("alpha", shard["endpoint"])]

    forged = listen_in_range(20000, 29999)
    forged_port = forged.getsockname()[1]
    reached: list[int] = []
    thief = Thief(server, cadir)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(count_connections, forged, reached)
        await nursery.start(thief.session, thief.register())
        # The server places zeta on gpu-03 (the only EVIL GPU): a shard of its own.
        start = await wait_until_async(lambda: next((x for x in thief.received if isinstance(x, m.Start)), None),
                                       "gpu-03 to receive zeta's Start", procs=live)

        # 1. ShardStatus and Progress for gpu-01's shard, pointing at the forged engine, under load.
        forged_url = f"http://127.0.0.1:{forged_port}"
        sent = 0

        async def forge() -> None:
            nonlocal sent
            for _ in range(20):
                await thief.send(m.ShardStatus(shard_id=shard["shard_id"], replica_id=legit["id"], state="ready",
                                               endpoint=forged_url))
                await thief.send(m.Progress(shard_id=shard["shard_id"], source="hf", done_bytes=1, total_bytes=2))
                sent += 2
                await trio.sleep(0.02)  # ok: spreads the forgeries over the load below

        async with trio.open_nursery() as load:
            load.start_soon(forge)
            answers = await chats(server.url, "alpha", 40)
        assert [code for code, _ in answers] == [200] * 40
        await wait_until_async(lambda: metric(server, "foreign shard") >= sent, "every forgery refused and counted",
                               procs=live)
        answers = await chats(server.url, "alpha", 40)  # and after the last one was processed
        assert [code for code, _ in answers] == [200] * 40
        assert reached == [], "requests reached the forged endpoint"
        assert await trio.to_thread.run_sync(endpoints, server) == legit_endpoints
        log = server.proc.log()
        # once per node
        assert log.count(f"gpu-03 sent ShardStatus for shard {shard['shard_id']}, which runs on gpu-01") == 1
        now = await trio.to_thread.run_sync(alpha_ready)
        assert (now is not None and now["shards"][0]["pid"] == shard["pid"]
                and now["shards"][0]["endpoint"] == shard["endpoint"])

        # 2. Its own shard, reported ready with an endpoint on another host: refused.
        own = start.spec
        await thief.send(m.ShardStatus(shard_id=own.shard_id, replica_id=own.replica_id, state="ready",
                                       endpoint=f"http://127.0.0.2:{own.port}"))
        await wait_until_async(lambda: metric(server, "endpoint") >= 1, "the foreign-host endpoint refused", procs=live)
        zeta = next(r for r in replicas(server) if r["model"] == "zeta")
        assert zeta["state"] == "starting" and zeta["shards"][0]["endpoint"] == ""
        assert "127.0.0.2" in server.proc.log()
        assert await trio.to_thread.run_sync(endpoints, server) == legit_endpoints
        # Its own shard failing, with a reason that tries to forge a log line: logged escaped.
        await thief.send(m.ShardStatus(shard_id=own.shard_id, replica_id=own.replica_id, state="failed",
                                       reason="boom\n" + FORGED_LINE))
        await wait_until_async(lambda: "gpu-03: boom\\x0a2026-12-01" in server.proc.log(),
                               "the failure logged, escaped",
                               procs=live)
        nursery.cancel_scope.cancel()

    # 3. A new stream whose Register adopts "an engine" under gpu-01's replica id, started in 1970.
    evil = m.ShardSpec(shard_id="evil-1.1", replica_id=legit["id"], model="alpha", profile="tp1", engine="sim",
                       gpus=[0], port=forged_port)
    report = m.ShardReport(spec=evil, state="ready", pid=1, started_at=1.0, endpoint=f"http://127.0.0.1:{forged_port}")
    # And one whose replica id is a path (issue 21, finding 1): were it adopted, a re-placement
    # would have another node's agent write `<replica>.<attempt>.log` and `.json` there.
    owned = tmp_path / "x" / "owned"
    path_id = m.ShardReport(spec=m.ShardSpec(shard_id=f"{owned}.1", replica_id=str(owned), model="alpha", profile="tp1",
                                             engine="sim", gpus=[0], port=forged_port + 1), state="failed")
    thief = Thief(server, cadir)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(count_connections, forged, reached)
        await nursery.start(thief.session, thief.register([report, path_id]))
        await wait_until_async(lambda: metric(server, "bad id") >= 1, "the path-shaped id refused", procs=live)
        assert not any("owned" in r["id"] for r in replicas(server))
        await wait_until_async(
            lambda: any(isinstance(x, m.Stop) and x.shard_id == "evil-1.1" for x in thief.received),
            "the surplus rule to stop the adopted impostor", procs=live)
        answers = await chats(server.url, "alpha", 20)
        assert [code for code, _ in answers] == [200] * 20
        now = await trio.to_thread.run_sync(alpha_ready)
        assert now is not None and now["id"] == legit["id"] and now["shards"][0]["pid"] == shard["pid"]
        assert reached == []
        nursery.cancel_scope.cancel()
    listed = await trio.to_thread.run_sync(ctl_json, server.url, "endpoints")
    assert [(e["model"], e["endpoint"]) for e in listed] == legit_endpoints

    assert not (tmp_path / "x").exists()
    # The version's newline was quoted: no forged line of its own in the server's log.
    log = server.proc.log()
    assert "0.1.0\\n2026-12-01" in log
    assert not any(line.startswith(FORGED_LINE[:30]) for line in log.splitlines())
