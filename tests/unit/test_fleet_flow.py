"""The fleet transport on a real loopback socket: a real FleetListener and a real dialed client.

Flow control (a slow consumer blocks the sender; the inbox is bounded by the window), the
reader keeps answering control frames while the application does not read, the message size
limit at both ends, and what the agent sees when the server shuts down. The server side runs
the production FleetService where the behaviour under test is the server's (logging, shutdown).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from llmgw import __version__
from llmgw.fleet import ChannelClosed, FleetChannel, FleetListener, StreamRefused, dial
from llmgw.fleet.h2conn import window_for
from llmgw.server.fleet_service import FleetService
from llmgw.server.metrics import ServerMetrics
from llmgw.server.registry import NodeRegistry
from llmgw.wire import messages as m
from llmgw.wire.envelope import HEADER_SIZE, encode_envelope
from tests.unit.fakes import NoHardware

MAX = 64 * 1024  # max_message at both ends in these tests
WINDOW = window_for(MAX)
DEADLINE = 10.0  # every wait below is for a condition, bounded by this


class ServerEnd:
    """A stream handler that hands the server's channel to the test and holds the stream open."""

    def __init__(self) -> None:
        self.channel: FleetChannel | None = None
        self.accepted = trio.Event()
        self.release = trio.Event()

    async def handle(self, channel: FleetChannel) -> None:
        self.channel = channel
        self.accepted.set()
        await self.release.wait()


@asynccontextmanager
async def fleet_port(handler: Callable[[FleetChannel], Awaitable[None]],
                     max_message: int = MAX) -> AsyncIterator[tuple[FleetListener, str]]:
    """A FleetListener serving h2c on a loopback port; yields it and the URL agents dial."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    listener = FleetListener(handler, ssl_context=None, max_message=max_message, handshake_timeout=DEADLINE)
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.serve, listeners)
        yield listener, f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def connected_pair(max_message: int = MAX) -> AsyncIterator[tuple[FleetChannel, FleetChannel, ServerEnd]]:
    """(agent's channel, server's channel) of one Connect stream over loopback."""
    end = ServerEnd()
    async with fleet_port(end.handle, max_message) as (_, url), \
            dial(url, ssl_context=None, insecure=True, max_message=max_message) as client:
        with trio.fail_after(DEADLINE):
            await end.accepted.wait()
        assert end.channel is not None
        yield client, end.channel, end
        end.release.set()


async def until(check: Callable[[], object], what: str, deadline: float = DEADLINE) -> None:
    """Wait for a condition (polled), failing with `what` after `deadline` seconds."""
    with trio.move_on_after(deadline):
        while not check():  # noqa: ASYNC110 - the conditions are transport state, no event to wait on
            await trio.sleep(0.005)  # ok: poll interval of a deadline-bounded wait
        return
    raise AssertionError(f"timed out after {deadline:g}s waiting for {what}")


def message(i: int, size: int = MAX) -> bytes:
    head = f"{i:08d}".encode()
    return head + bytes([i % 251]) * (size - len(head))


def window_left(channel: FleetChannel) -> int:
    return channel.connection.h2.local_flow_control_window(channel.stream_id)


def track_peak(channel: FleetChannel) -> list[int]:
    """Record the receiver's buffered bytes after every DATA frame its reader handles."""
    peak = [0]
    original = channel._on_data

    def on_data(data: bytes, flow_controlled_length: int) -> None:
        original(data, flow_controlled_length)
        peak[0] = max(peak[0], channel.buffered)

    channel._on_data = on_data  # type: ignore[method-assign]
    return peak


# -- (a) a slow consumer blocks the sender through flow control alone -------------------------


@pytest.mark.parametrize("direction", ["agent-to-server", "server-to-agent"])
async def test_slow_consumer_blocks_the_sender_until_it_reads(direction: str) -> None:
    count = 7
    async with connected_pair() as (client, server, _):
        sender, receiver = (client, server) if direction == "agent-to-server" else (server, client)
        peak = track_peak(receiver)
        sent: list[int] = []

        async def send_all() -> None:
            for i in range(count):
                await sender.send(message(i))
                sent.append(i)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all)
            # The window holds exactly two whole messages (2 × (max + header)): the third send
            # must wait, with every byte sent so far sitting unread in the receiver's inbox.
            await until(lambda: len(sent) == 2 and window_left(sender) == 0 and receiver.buffered == WINDOW,
                        "the sender to fill the window")
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert len(sent) == 2, "send returned although the receiver read nothing"
            assert receiver.buffered == WINDOW and peak[0] <= WINDOW

            # Each message the consumer takes opens the window by one message: the sender
            # resumes by exactly that much, and the inbox never exceeds the window.
            got: list[bytes] = []
            for taken in range(1, count + 1):
                with trio.fail_after(DEADLINE):
                    got.append(await receiver.receive())
                expected = min(count, taken + 2)
                await until(lambda e=expected: len(sent) == e, f"{expected} sends to return")
                await until(lambda t=taken: receiver.buffered == (len(sent) - t) * (MAX + HEADER_SIZE),
                            "the resumed message to arrive")
                assert peak[0] <= WINDOW
        assert got == [message(i) for i in range(count)]
        assert peak[0] == WINDOW  # it did fill up, and no further


# -- (b) the reader answers control frames while the application does not read ----------------


async def test_reader_handles_ping_and_window_updates_while_the_application_is_not_reading() -> None:
    async with connected_pair() as (client, server, _):
        peak = track_peak(server)

        async def flood() -> None:
            for i in range(10):
                await client.send(message(i))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await until(lambda: server.buffered == WINDOW and window_left(client) == 0, "the server's inbox to fill")

            # PING both ways: the not-reading server's reader acks the agent's PING, and it
            # takes the agent's ack of its own PING.
            client.connection.ping()
            await until(lambda: client.connection.ping_acks == 1, "the server to ack the agent's PING")
            server.connection.ping()
            await until(lambda: server.connection.ping_acks == 1, "the agent to ack the server's PING")

            # The server sends 5 windows' worth the other way: it can only get through if the
            # server's reader processes the agent's WINDOW_UPDATEs, while its app still does not read.
            back = [message(100 + i) for i in range(10)]

            async def send_back() -> None:
                for payload in back:
                    await server.send(payload)

            nursery.start_soon(send_back)
            with trio.fail_after(DEADLINE):
                received = [await client.receive() for _ in back]
            assert received == back
            assert server.buffered == WINDOW and peak[0] <= WINDOW  # still nothing read on that side

            with trio.fail_after(DEADLINE):
                assert [await server.receive() for _ in range(10)] == [message(i) for i in range(10)]


# -- (c) the message size limit --------------------------------------------------------------


async def test_largest_message_passes_both_ways_and_one_byte_more_is_refused_by_the_sender() -> None:
    async with connected_pair() as (client, server, _):
        biggest = message(1)
        assert len(biggest) == MAX
        with trio.fail_after(DEADLINE):
            await client.send(biggest)
            assert await server.receive() == biggest
            await server.send(biggest)
            assert await client.receive() == biggest
        for sender in (client, server):
            with pytest.raises(ValueError,
                               match=rf"message of {MAX + 1} bytes exceeds the limit of {MAX} \(max_message\)"):
                await sender.send(biggest + b"x")
        # Refused before anything went out: the stream is still good.
        with trio.fail_after(DEADLINE):
            await client.send(b"still here")
            assert await server.receive() == b"still here"
            await server.send(b"and here")
            assert await client.receive() == b"and here"


async def test_oversized_envelope_on_the_wire_closes_the_connection_and_the_server_logs_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    fleet = FleetService(NodeRegistry(1.0), ServerMetrics(lambda: {}), register_timeout=DEADLINE,
                         require_identity=False)
    async with fleet_port(fleet.handle) as (_, url), dial(url, ssl_context=None, insecure=True,
                                                          max_message=MAX) as client:
        # Past the sender's own check, as a buggy or hostile agent would.
        await client.send_raw(encode_envelope(message(2, MAX + 1)))
        with trio.fail_after(DEADLINE), pytest.raises(ChannelClosed) as info:
            await client.receive()
    assert info.value.error
    assert "GOAWAY" in info.value.reason and f"envelope of {MAX + 1} bytes exceeds the limit of {MAX}" in (
        info.value.reason)
    logged = [r for r in caplog.records
              if r.name.startswith("llmgw.server") and f"exceeds the limit of {MAX}" in r.getMessage()]
    assert logged and logged[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "bad envelope" in logged[0].getMessage() and "127.0.0.1" in logged[0].getMessage()


async def test_oversized_envelope_from_the_server_closes_the_agents_stream_and_the_agent_logs_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from llmgw.agent.agent import Agent
    from llmgw.catalog.schema import AgentConfig

    caplog.set_level(logging.INFO)
    server_saw: list[ChannelClosed] = []

    async def bad_server(channel: FleetChannel) -> None:
        register = m.decode_agent_message(await channel.receive())
        assert isinstance(register, m.Register)
        await channel.send(m.encode(m.Welcome(server_version=__version__, heartbeat_interval=60)))
        await channel.send_raw(encode_envelope(b"{" * (MAX + 1)))
        try:
            while True:
                await channel.receive()
        except ChannelClosed as exc:
            server_saw.append(exc)

    async with fleet_port(bad_server) as (_, url):
        cfg = AgentConfig(server=url, node_id="gpu-01")
        agent = Agent(cfg, hardware=NoHardware(),
                      dialer=lambda: dial(url, ssl_context=None, insecure=True, max_message=MAX))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.run)
            await until(lambda: server_saw, "the server to see the agent close the stream")
            await until(lambda: any("bad envelope" in r.getMessage() for r in caplog.records
                                    if r.name == "llmgw.agent"),
                        "the agent to log why it closed the stream")
            nursery.cancel_scope.cancel()
    line = next(r for r in caplog.records if r.name == "llmgw.agent" and "bad envelope" in r.getMessage())
    assert line.levelno == logging.WARNING
    assert f"envelope of {MAX + 1} bytes exceeds the limit of {MAX}" in line.getMessage()
    assert server_saw[0].error and f"exceeds the limit of {MAX}" in server_saw[0].reason


# -- (d) server shutdown ---------------------------------------------------------------------


async def test_server_shutdown_ends_each_stream_with_its_reason_then_goaway() -> None:
    fleet = FleetService(NodeRegistry(1.0), ServerMetrics(lambda: {}), register_timeout=DEADLINE,
                         require_identity=False)
    async with fleet_port(fleet.handle) as (listener, url), \
            dial(url, ssl_context=None, insecure=True, max_message=MAX) as one, \
            dial(url, ssl_context=None, insecure=True, max_message=MAX) as two:
        for node, ch in (("gpu-01", one), ("gpu-02", two)):
            await ch.send(m.encode(m.Register(node_id=node, version=__version__)))
            with trio.fail_after(DEADLINE):
                assert isinstance(m.decode_server_message(await ch.receive()), m.Welcome)
        with trio.fail_after(DEADLINE):
            await fleet.shutdown()
            await listener.wait_idle()
        for ch in (one, two):
            with trio.fail_after(DEADLINE), pytest.raises(ChannelClosed) as info:
                await ch.receive()
            assert info.value.reason == "the server is shutting down" and info.value.error
            assert ch.connection.closed_reason is not None and "GOAWAY" in ch.connection.closed_reason


async def test_a_sender_waiting_for_window_gets_the_servers_reason() -> None:
    """An agent stuck in send() (the server not reading) must hear why the stream ended."""
    release = trio.Event()

    async def refusing_server(channel: FleetChannel) -> None:
        await release.wait()
        raise StreamRefused("shutdown", "the server is shutting down")

    async with fleet_port(refusing_server) as (_, url), dial(url, ssl_context=None, insecure=True,
                                                             max_message=MAX) as client:
        sent: list[int] = []
        errors: list[ChannelClosed] = []

        async def flood() -> None:
            try:
                for i in range(10):
                    await client.send(message(i))
                    sent.append(i)
            except ChannelClosed as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await until(lambda: len(sent) == 2 and window_left(client) == 0, "the agent to block in send")
            release.set()
            await until(lambda: errors, "the blocked send to end")
        assert errors[0].reason == "the server is shutting down" and errors[0].error, errors[0].reason


async def test_flushed_waits_for_a_goaway_queued_after_the_connection_closed() -> None:
    """fail() queues a GOAWAY and marks the connection closed; flushed() must still wait for the
    writer to send it (the caller closes the socket next), not return at once."""
    from llmgw.fleet.h2conn import H2Connection

    ours, theirs = trio.testing.memory_stream_pair()
    conn = H2Connection(ours, client_side=False, max_message=MAX)
    conn.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.writer)
        with trio.fail_after(DEADLINE):
            await conn.flushed()
        preface = await theirs.receive_some()
        assert preface
        conn.fail("bad envelope: test")
        with trio.fail_after(DEADLINE):
            await conn.flushed()
        # Everything is already in the peer's buffer: no waiting, no reader running here.
        with trio.fail_after(DEADLINE):
            sent = await theirs.receive_some()
        nursery.cancel_scope.cancel()
    assert b"bad envelope: test" in sent


async def test_an_agent_cancelled_from_outside_still_ends_its_stream_cleanly() -> None:
    """`llmgw agent` on SIGTERM cancels everything, the transport's writer included; the
    goodbye (END_STREAM, GOAWAY) must still go out, so the server sees a clean end, not a
    connection that dropped."""
    saw: list[ChannelClosed] = []

    async def server(channel: FleetChannel) -> None:
        try:
            while True:
                await channel.receive()
        except ChannelClosed as exc:
            saw.append(exc)

    async with fleet_port(server) as (_, url):
        with trio.CancelScope() as agent_scope:
            async with dial(url, ssl_context=None, insecure=True, max_message=MAX) as client:
                await client.send(b"hello")
                agent_scope.cancel()
                await trio.sleep_forever()
        await until(lambda: saw, "the server to see the stream end")
    assert saw[0].reason == "peer ended the stream" and not saw[0].error, saw[0].reason
