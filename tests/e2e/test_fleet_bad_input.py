"""Bad input on the fleet port closes that one connection with a logged reason; others go on."""

from __future__ import annotations

import struct
from pathlib import Path

import trio

from llmgw import __version__
from llmgw.fleet import ChannelClosed, dial
from llmgw.wire import messages as m
from tests.e2e.harness import Proc, Server, wait_until_async


async def healthy_agent(url: str, node_id: str, stop: trio.Event) -> None:
    async with dial(url, ssl_context=None, insecure=True, max_message=1 << 20) as ch:
        await ch.send(m.encode(m.Register(node_id=node_id, version=__version__)))
        welcome = m.decode_server_message(await ch.receive())
        assert isinstance(welcome, m.Welcome)
        seq = 0
        while not stop.is_set():
            seq += 1
            await ch.send(m.encode(m.Heartbeat(seq=seq)))
            with trio.move_on_after(welcome.heartbeat_interval):
                await stop.wait()


async def test_garbage_oversized_and_half_open_close_only_their_connection(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path)
    proc = await trio.to_thread.run_sync(server.start)
    procs.append(proc)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(healthy_agent, server.fleet_url, "healthy-1", stop)
        await wait_until_async(lambda: server.nodes().get("healthy-1", {}).get("state") == "ready", "healthy-1 ready",
                               procs=[proc])

        # 1. Garbage bytes instead of an HTTP/2 preface.
        garbage = await trio.open_tcp_stream("127.0.0.1", server.fleet_port)
        await garbage.send_all(b"\x16\x03\x01 this is not http/2 at all\r\n\r\n" * 10)
        with trio.fail_after(10):
            while await garbage.receive_some(4096):
                pass  # the server answers with SETTINGS/GOAWAY, then hangs up
        await wait_until_async(lambda: "HTTP/2 protocol error from peer" in proc.log(), "garbage logged", procs=[proc])

        # 2. An envelope that declares more than max_message (256 KiB) on a valid stream.
        async with dial(server.fleet_url, ssl_context=None, insecure=True, max_message=1 << 20) as ch:
            await ch.send_raw(struct.pack(">BI", 0, 50 * 1024 * 1024) + b"{" * 100)
            with trio.fail_after(10):
                try:
                    while True:
                        await ch.receive()
                except ChannelClosed as exc:
                    assert exc.error
        await wait_until_async(lambda: "exceeds the limit of 262144" in proc.log(), "oversized envelope logged",
                               procs=[proc])

        # 3. Half-open: a TCP connection that never says anything.
        silent = await trio.open_tcp_stream("127.0.0.1", server.fleet_port)
        with trio.fail_after(15):
            while await silent.receive_some(4096):
                pass  # server's preface, then EOF once the register timeout passes
        await wait_until_async(lambda: "half-open connection?" in proc.log(), "half-open logged", procs=[proc])

        # 4. A stream that opens but never registers.
        async with dial(server.fleet_url, ssl_context=None, insecure=True, max_message=1 << 20) as ch:
            with trio.fail_after(15):
                try:
                    await ch.receive()
                    raise AssertionError("expected the server to end the stream")
                except ChannelClosed as exc:
                    assert "no Register within" in exc.reason

        # 5. A first message that is not Register, and a malformed one.
        for payload in (m.encode(m.Heartbeat(seq=1)), b"{not json"):
            async with dial(server.fleet_url, ssl_context=None, insecure=True, max_message=1 << 20) as ch:
                await ch.send(payload)
                with trio.fail_after(10):
                    try:
                        await ch.receive()
                        raise AssertionError("expected the server to end the stream")
                    except ChannelClosed as exc:
                        assert exc.error and ("Register" in exc.reason or "malformed" in exc.reason)

        # The healthy node never noticed any of it.
        nodes = await trio.to_thread.run_sync(server.nodes)
        assert nodes["healthy-1"]["state"] == "ready", nodes
        assert "healthy-1" in proc.log() and proc.alive()
        stop.set()
