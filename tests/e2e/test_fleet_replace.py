"""A second stream claiming a connected node id replaces the first, and the log says so."""

from __future__ import annotations

from pathlib import Path

import trio

from llmgw import __version__
from llmgw.fleet import ChannelClosed, dial
from llmgw.wire import messages as m
from tests.e2e.harness import Proc, Server, wait_until_async


async def test_second_stream_for_a_node_replaces_the_first(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path)
    proc = await trio.to_thread.run_sync(server.start)
    procs.append(proc)
    first_end: list[ChannelClosed] = []
    ended = trio.Event()

    async def first_agent(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with dial(server.fleet_url, ssl_context=None, insecure=True, max_message=1 << 20) as ch:
            await ch.send(m.encode(m.Register(node_id="gpu-07", version=__version__)))
            assert isinstance(m.decode_server_message(await ch.receive()), m.Welcome)
            task_status.started()
            try:
                while True:
                    await ch.receive()
            except ChannelClosed as exc:
                first_end.append(exc)
                ended.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(first_agent)
        first_addr = (await trio.to_thread.run_sync(server.nodes))["gpu-07"]["address"]
        async with dial(server.fleet_url, ssl_context=None, insecure=True, max_message=1 << 20) as ch:
            await ch.send(m.encode(m.Register(node_id="gpu-07", version=__version__)))
            assert isinstance(m.decode_server_message(await ch.receive()), m.Welcome)
            with trio.fail_after(10):
                await ended.wait()
            assert first_end[0].error and "replaced by a newer stream for gpu-07" in first_end[0].reason
            node = await wait_until_async(
                lambda: (n := server.nodes()["gpu-07"]) and n["address"] != first_addr and n["state"] == "ready" and n,
                "the node on the new stream", procs=[proc])
            assert node["connected"]
            assert f"node gpu-07: new stream from {node['address']} replaces the one from {first_addr}" in proc.log()
