"""A gateway worker listens on its share of the public port only once it can serve: the kernel
completes connections to any listening SO_REUSEPORT socket and hands it a share of the new ones,
so a worker still waiting for its config, or one whose public_tls files cannot be read, would
hold that share unanswered (on the dev machine, 5 of 8 requests hung behind such a worker)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import trio
import trio.testing

from llmgw.catalog.schema import TlsPublic
from llmgw.server.gateway.worker import Follow, GatewayWorker, reuseport_socket
from llmgw.wire.gateway import GatewayConfig, encode


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_a_worker_listens_only_once_it_can_serve(tmp_path: Path) -> None:
    sock = reuseport_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    worker = GatewayWorker("worker-0", Follow(unix_path=str(tmp_path / "no-feed.sock")), local=True)
    bad = tmp_path / "server.crt"
    bad.write_text("renewed by a broken job\n")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.serve, [sock])
        await trio.testing.wait_all_tasks_blocked()
        assert await trio.to_thread.run_sync(refused, port), "listening before its first config"
        # Its config names TLS files it cannot use: it does not serve, and takes no connection.
        worker._apply(encode(GatewayConfig(public_tls=TlsPublic(cert=str(bad), key=str(bad)), public_tls_digest="x")))
        assert not worker.configured.is_set()
        await trio.testing.wait_all_tasks_blocked()
        assert await trio.to_thread.run_sync(refused, port), "listening without the TLS it is to terminate"
        worker._apply(encode(GatewayConfig()))  # a config it can serve with (plain)
        async with httpx.AsyncClient() as client:
            with trio.fail_after(30):
                while True:
                    try:
                        r = await client.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
                        break
                    except httpx.ConnectError:
                        await trio.sleep(0.05)  # ok: the poller's interval; fail_after(30) bounds the wait
        assert r.status_code == 200
        nursery.cancel_scope.cancel()
