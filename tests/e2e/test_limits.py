"""Limits a peer cannot push past: the size of an engine answer the gateway holds, and the
label values a node can add to /metrics. Real server process, real sockets, real TLS."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from llmgw import __version__
from llmgw.fleet import dial
from llmgw.tls import client_context
from llmgw.web import http1
from llmgw.wire import messages as m
from tests.e2e.harness import FAST_FLEET, Proc, Server, run_llmgw, wait_until_async
from tests.unit.loopback import serve_tcp

CAP = 1 << 20
PIECE = b"x" * 65536


def _kernel_buffers() -> int:
    """The most the two kernels' socket buffers can hold between the engine and the gateway
    (the largest receive buffer autotuning may grow to, plus the largest send buffer)."""
    with open("/proc/sys/net/ipv4/tcp_rmem") as fh:
        rmem = int(fh.read().split()[2])
    with open("/proc/sys/net/ipv4/tcp_wmem") as fh:
        wmem = int(fh.read().split()[2])
    return rmem + wmem


class BigEngine:
    """An engine that answers every POST with far more than the gateway's cap and counts what
    it managed to send before the gateway hung up."""

    def __init__(self, total: int, declare_length: bool, huge_gets: bool = False) -> None:
        self.total = total
        self.declare_length = declare_length
        self.huge_gets = huge_gets  # its /health and /metrics answers are endless too
        self.sent = 0
        self.per_answer: list[int] = []  # what each finished answer got out
        self.hung_up = trio.Event()

    async def __call__(self, stream: trio.SocketStream) -> None:
        buf = bytearray()
        while (end := http1.find_head_end(buf)) < 0:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        head = http1.parse_request_head(bytes(buf[:end]))
        if head.method != b"POST" and not self.huge_gets:  # the gateway's scrapes and health checks
            await stream.send_all(http1.response_head(200, [(b"content-type", b"text/plain")], content_length=0))
            return
        if self.declare_length:
            await stream.send_all(http1.response_head(200, [(b"content-type", b"application/json")],
                                                      content_length=self.total))
        else:  # no length: the body ends when the connection does
            await stream.send_all(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n")
        sent = 0
        try:
            while sent < self.total:
                await stream.send_all(PIECE)
                sent += len(PIECE)
                self.sent += len(PIECE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.per_answer.append(sent)
            self.hung_up.set()


async def test_an_engine_answer_over_the_cap_is_a_502_and_is_not_read_past_it(tmp_path: Path,
                                                                              procs: list[Proc]) -> None:
    slack = _kernel_buffers()
    total = CAP + slack + (64 << 20)  # without a cap the gateway would read all of it
    unbounded = BigEngine(total, declare_length=False)
    declared = BigEngine(total, declare_length=True)
    async with trio.open_nursery() as nursery:
        ports = [await serve_tcp(nursery, unbounded), await serve_tcp(nursery, declared)]
        config = FAST_FLEET + f"gateway:\n  max_response: {CAP}\n  scrape_interval: 60s\n  max_attempts: 1\n" + (
            "endpoints:\n"
            f"  - {{model: unbounded, url: 'http://127.0.0.1:{ports[0]}'}}\n"
            f"  - {{model: declared, url: 'http://127.0.0.1:{ports[1]}'}}\n"
        )
        server = Server(tmp_path, config)
        proc = await trio.to_thread.run_sync(server.start)
        procs.append(proc)
        async with httpx.AsyncClient(timeout=30) as client:
            for model, engine in (("unbounded", unbounded), ("declared", declared)):
                response = await client.post(f"{server.url}/v1/chat/completions",
                                             json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
                assert response.status_code == 502, response.text
                error = response.json()["error"]
                assert (error["code"] == "response_too_large"
                        and "1048576 bytes, gateway.max_response" in error["message"]), error
                assert (f"127.0.0.1:{ports[0]}" not in error["message"]
                        and f"127.0.0.1:{ports[1]}" not in error["message"])
                with trio.fail_after(30):
                    await engine.hung_up.wait()
                # What the engine got out is what the gateway read plus what sat in the two
                # kernels' buffers when it hung up: never the whole answer.
                assert engine.sent < CAP + slack, (model, engine.sent, slack)
                assert engine.sent < total
            # The gateway answered and is still fine: the engine was not blamed (no breaker).
            health = await client.get(f"{server.url}/healthz")
            assert health.status_code == 200
        assert proc.alive()
        nursery.cancel_scope.cancel()


async def test_health_checks_and_scrapes_do_not_read_an_endless_answer(tmp_path: Path, procs: list[Proc]) -> None:
    """The gateway's own GETs (health every second, metrics scrapes) hold at most 4 MiB of an
    answer (SCRAPE_MAX), whatever the engine sends."""
    from llmgw.server.gateway.probes import SCRAPE_MAX

    slack = _kernel_buffers()
    total = SCRAPE_MAX + slack + (64 << 20)
    engine = BigEngine(total, declare_length=False, huge_gets=True)
    async with trio.open_nursery() as nursery:
        port = await serve_tcp(nursery, engine)
        config = FAST_FLEET + (
            "gateway:\n  scrape_interval: 60s\n  health_interval: 0.2s\n  health_timeout: 10s\n"
            f"endpoints:\n  - {{model: chatty, url: 'http://127.0.0.1:{port}'}}\n"
        )
        server = Server(tmp_path, config)
        proc = await trio.to_thread.run_sync(server.start)
        procs.append(proc)
        # One scrape at start, then a health check every 0.2 s: each is given up on early.
        await wait_until_async(lambda: len(engine.per_answer) >= 4, "four GETs answered and given up on", procs=[proc])
        assert max(engine.per_answer) < SCRAPE_MAX + slack, (engine.per_answer, slack)
        await wait_until_async(lambda: "over the limit" in proc.log(), "a check refused for its size", procs=[proc])
        assert proc.alive()
        nursery.cancel_scope.cancel()


def _cert(*args: str) -> None:
    result = run_llmgw("ctl", "cert", *args)
    assert result.returncode == 0, result.stderr


async def test_unknown_fleet_message_types_do_not_grow_metrics(tmp_path: Path, procs: list[Proc]) -> None:
    cadir = tmp_path / "ca"
    for args in (("init", "--name", "test CA"), ("server", "--host", "localhost", "--ip", "127.0.0.1"),
                 ("node", "gpu-01")):
        await trio.to_thread.run_sync(_cert, *args, "--dir", str(cadir))
    config = (FAST_FLEET
              + f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {cadir / 'server.key'}\n")
    server = Server(tmp_path, config, insecure=False)
    proc = await trio.to_thread.run_sync(server.start)
    procs.append(proc)

    def metrics() -> str:
        return httpx.get(f"{server.url}/metrics", timeout=5).text

    def unknown_count(text: str) -> float:
        for line in text.splitlines():
            if line.startswith('llmgw_fleet_messages_total{type="unknown"}'):
                return float(line.split()[-1])
        return 0.0

    n = 20_000
    ctx = client_context(str(cadir / "ca.crt"), str(cadir / "node-gpu-01.crt"), str(cadir / "node-gpu-01.key"))
    async with dial(server.fleet_url, ssl_context=ctx, max_message=1 << 20) as ch:
        await ch.send(m.encode(m.Register(node_id="gpu-01", version=__version__)))
        assert isinstance(m.decode_server_message(await ch.receive()), m.Welcome)
        await ch.send(m.encode(m.Heartbeat(seq=1)))
        await wait_until_async(lambda: 'llmgw_fleet_messages_total{type="Heartbeat"}' in metrics(),
                               "a heartbeat counted",
                               procs=[proc])
        before = await trio.to_thread.run_sync(metrics)
        for i in range(n):
            await ch.send(b'{"type": "Made-up-%d", "x": 1}' % i)
        await ch.send(m.encode(m.Heartbeat(seq=2)))
        after = await wait_until_async(lambda: (text := metrics()) and unknown_count(text) == n and text,
                                       f"{n} unknown messages counted", procs=[proc])
    assert "Made-up" not in after
    # One new series (type="unknown", with its _created twin), whatever the node made up.
    assert len(after) - len(before) < 1024, (len(before), len(after))
    # The node was not cut off for it (unknown types are skipped), and the log names only a few.
    log = proc.log()
    assert log.count("unknown type") <= 64 and "no longer logging new ones" in log
