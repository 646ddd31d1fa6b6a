"""llmgw.web.relayhub.RelayHub under a running hub task, engine and client on real loopback
TCP sockets: engine socket -> hub -> client socket."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from llmgw.web import http1
from llmgw.web.relayhub import RelayError, RelayHub
from tests.unit.loopback import DEADLINE, recv_exactly, recv_until_eof, send_all, tcp_pair, wait_for


class Pipe:
    """One relayed stream's sockets: the engine writes `engine`, the hub reads `upstream`
    and writes `hub_side`, the client reads `client`."""

    def __init__(self, engine: trio.socket.SocketType, upstream: trio.socket.SocketType,
                 hub_side: trio.socket.SocketType, client: trio.socket.SocketType) -> None:
        self.engine, self.upstream, self.hub_side, self.client = engine, upstream, hub_side, client

    @classmethod
    async def open(cls, *, small_client_buffers: bool = False) -> Pipe:
        engine, upstream = await tcp_pair()
        hub_side, client = await tcp_pair()
        if small_client_buffers:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            hub_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        return cls(engine, upstream, hub_side, client)

    async def relay(self, hub: RelayHub, idle: float = DEADLINE, initial: bytes = b"") -> tuple[int, bytes]:
        return await hub.relay(self.upstream.fileno(), self.hub_side.fileno(), initial, idle)

    def close(self) -> None:
        for s in (self.engine, self.upstream, self.hub_side, self.client):
            s.close()


def events(tag: int, n: int, size: int = 0) -> list[bytes]:
    return [b"data: {\"s\": %d, \"t\": %d, \"pad\": \"%s\"}\n\n" % (tag, k, b"x" * size) for k in range(n)]


def body_of(evs: list[bytes]) -> bytes:
    return b"".join(http1.chunk(e) for e in evs) + http1.LAST_CHUNK


@asynccontextmanager
async def running_hub(**kwargs: float) -> AsyncIterator[RelayHub]:
    hub = RelayHub(**kwargs)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            yield hub
            nursery.cancel_scope.cancel()
    finally:
        hub.close()


def assert_not_watched(hub: RelayHub, *fds: int) -> None:
    """No fd left in the hub's table nor in its epoll set."""
    assert hub._by_fd == {}
    for fd in fds:
        with pytest.raises(FileNotFoundError):
            hub._ep.unregister(fd)


async def test_many_concurrent_streams_are_relayed_byte_for_byte() -> None:
    async with running_hub() as hub:
        results: dict[int, tuple[bytes, bytes, int, bytes]] = {}

        async def one(i: int) -> None:
            pipe = await Pipe.open()
            evs = events(i, 40 + i % 7)
            whole = body_of(evs)
            initial = b"".join(http1.chunk(e) for e in evs[:2])  # already read with the head
            got: list[bytes] = []
            out: list[tuple[int, bytes]] = []

            async def engine() -> None:
                for e in evs[2:]:
                    await send_all(pipe.engine, http1.chunk(e))
                    await trio.sleep(0.0005 * (i % 3))
                await send_all(pipe.engine, http1.LAST_CHUNK)

            async def client() -> None:
                got.append(await recv_exactly(pipe.client, len(whole)))

            async def relay() -> None:
                out.append(await pipe.relay(hub, initial=initial))

            async with trio.open_nursery() as n:
                n.start_soon(engine)
                n.start_soon(client)
                n.start_soon(relay)
            chunks, leftover = out[0]
            results[i] = (got[0], whole, chunks, leftover)
            pipe.close()

        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, i)
        for i, (got, whole, chunks, leftover) in results.items():
            assert got == whole, i
            assert chunks == 40 + i % 7 and leftover == b""
        assert len(results) == 40
        assert hub._by_fd == {}


async def test_a_slow_client_parks_the_stream_without_losing_or_reordering_bytes() -> None:
    async with running_hub() as hub:
        parks = 0
        park = hub._park

        def counting_park(stream: object, rest: bytes) -> None:
            nonlocal parks
            parks += 1
            park(stream, rest)  # type: ignore[arg-type]

        hub._park = counting_park  # type: ignore[method-assign]
        pipe = await Pipe.open(small_client_buffers=True)
        evs = events(1, 300, size=900)
        whole = body_of(evs)
        # a big first read (the client's buffer after the head) that cannot all go at once
        initial = b"".join(http1.chunk(e) for e in evs[:100])
        got = bytearray()

        async def engine() -> None:
            for e in evs[100:]:
                await send_all(pipe.engine, http1.chunk(e))
            await send_all(pipe.engine, http1.LAST_CHUNK)

        async def slow_client() -> None:
            while len(got) < len(whole):
                data = await pipe.client.recv(1500)
                assert data
                got.extend(data)
                await trio.sleep(0.0005)  # ok: paces a slow reader; a reader slower than the engine

        with trio.fail_after(DEADLINE * 3):
            async with trio.open_nursery() as n:
                n.start_soon(engine)
                n.start_soon(slow_client)
                chunks, leftover = await pipe.relay(hub, initial=initial)
        assert bytes(got) == whole
        assert chunks == 300 and leftover == b""
        assert parks > 0
        assert_not_watched(hub, pipe.upstream.fileno(), pipe.hub_side.fileno())

        # the hub is still healthy: another stream goes through
        again = await Pipe.open()
        evs2 = events(2, 5)
        await send_all(again.engine, body_of(evs2))
        with trio.fail_after(DEADLINE):
            assert (await again.relay(hub))[0] == 5
            assert await recv_exactly(again.client, len(body_of(evs2))) == body_of(evs2)
        pipe.close()
        again.close()


async def test_the_engine_closing_mid_stream_is_an_upstream_error() -> None:
    async with running_hub() as hub:
        pipe = await Pipe.open()
        await send_all(pipe.engine, http1.chunk(b"data: 1\n\n"))
        pipe.engine.close()
        with trio.fail_after(DEADLINE), pytest.raises(RelayError) as info:
            await pipe.relay(hub)
        assert info.value.kind == "upstream" and not info.value.timeout
        assert await recv_exactly(pipe.client, 14) == http1.chunk(b"data: 1\n\n")
        assert_not_watched(hub, pipe.upstream.fileno())
        pipe.close()


async def test_bad_framing_from_the_engine_is_an_upstream_error() -> None:
    async with running_hub() as hub:
        pipe = await Pipe.open()
        await send_all(pipe.engine, http1.chunk(b"data: 1\n\n") + b"+5\r\nhello\r\n")
        with trio.fail_after(DEADLINE), pytest.raises(RelayError) as info:
            await pipe.relay(hub)
        assert info.value.kind == "upstream"
        assert_not_watched(hub, pipe.upstream.fileno())
        pipe.close()


async def test_the_client_closing_mid_stream_is_a_client_error_and_the_stream_leaves_the_hub() -> None:
    async with running_hub() as hub:
        pipe = await Pipe.open()
        finished = trio.Event()
        errors: list[RelayError] = []

        async def relay() -> None:
            try:
                await pipe.relay(hub)
            except RelayError as exc:
                errors.append(exc)
            finished.set()

        async def engine() -> None:
            k = 0
            while not finished.is_set():  # tokens keep coming until the gateway gives up
                await send_all(pipe.engine, http1.chunk(b"data: %d\n\n" % k))
                k += 1
                await trio.sleep(0.001)  # ok: paces the simulated engine's tokens

        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as n:
                n.start_soon(relay)
                await send_all(pipe.engine, http1.chunk(b"data: first\n\n"))
                await recv_exactly(pipe.client, 1)  # the stream is flowing
                pipe.client.close()
                n.start_soon(engine)
        assert len(errors) == 1 and errors[0].kind == "client"
        assert_not_watched(hub, pipe.upstream.fileno(), pipe.hub_side.fileno())
        pipe.close()


@pytest.mark.parametrize("parked", [False, True])
async def test_a_client_hanging_up_while_the_engine_is_silent_ends_the_stream_at_once(parked: bool) -> None:
    """No write tells the hub (the engine sends nothing more, prefill or a pause between tokens):
    it sees the client's hang-up itself (EPOLLRDHUP), long before the idle timeout, so the
    gateway needs no watcher task for a stream the hub relays."""
    async with running_hub() as hub:
        pipe = await Pipe.open(small_client_buffers=parked)
        if parked:  # the client reads nothing: the stream waits on the client socket
            await send_all(pipe.engine, body_of(events(1, 200, size=900))[:-5])
        else:
            await send_all(pipe.engine, http1.chunk(b"data: 1\n\n"))
        errors: list[RelayError] = []

        async def relay() -> None:
            with pytest.raises(RelayError) as info:
                await pipe.relay(hub, idle=600.0)
            errors.append(info.value)

        with trio.fail_after(DEADLINE):  # not the 600 s idle timeout
            async with trio.open_nursery() as n:
                n.start_soon(relay)
                await wait_for(lambda: pipe.hub_side.fileno() in hub._by_fd, "the hub watching the client")
                if not parked:
                    first = http1.chunk(b"data: 1\n\n")
                    assert await recv_exactly(pipe.client, len(first)) == first
                # A FIN, not a reset (which unread bytes would cause, and which any epoll reports)
                pipe.client.shutdown(socket.SHUT_WR)
        assert errors[0].kind == "client" and not errors[0].timeout
        assert_not_watched(hub, pipe.upstream.fileno(), pipe.hub_side.fileno())
        pipe.close()


@pytest.mark.parametrize("parked", [False, True])
async def test_cancelling_the_waiting_task_takes_the_stream_out_of_the_hub(parked: bool) -> None:
    async with running_hub() as hub:
        pipe = await Pipe.open(small_client_buffers=parked)
        if parked:  # the client reads nothing: the hub parks the stream on the client socket
            await send_all(pipe.engine, body_of(events(1, 200, size=900))[:-5])
        else:
            await send_all(pipe.engine, http1.chunk(b"data: 1\n\n"))
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as n:
                n.start_soon(pipe.relay, hub)
                await wait_for(
                    lambda: (pipe.hub_side.fileno() if parked else pipe.upstream.fileno()) in hub._by_fd,
                    "the stream waiting in the hub",
                )
                n.cancel_scope.cancel()
        assert_not_watched(hub, pipe.upstream.fileno(), pipe.hub_side.fileno())
        pipe.close()


async def test_a_silent_engine_times_out(autojump_clock: trio.testing.MockClock) -> None:
    async with running_hub() as hub:
        pipe = await Pipe.open()
        await send_all(pipe.engine, http1.chunk(b"data: 1\n\n"))
        start = trio.current_time()
        with pytest.raises(RelayError) as info:
            await pipe.relay(hub, idle=30.0)
        assert info.value.kind == "upstream" and info.value.timeout
        assert trio.current_time() - start == pytest.approx(30.0, abs=0.01)
        assert_not_watched(hub, pipe.upstream.fileno())
        pipe.close()


async def test_a_client_that_stops_reading_times_out_as_a_client_error() -> None:
    async with running_hub() as hub:
        pipe = await Pipe.open(small_client_buffers=True)
        evs = events(1, 2000, size=900)

        async def engine() -> None:
            try:
                for e in evs:
                    await send_all(pipe.engine, http1.chunk(e))
            except OSError:
                pass

        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as n:
                n.start_soon(engine)
                with pytest.raises(RelayError) as info:
                    await pipe.relay(hub, idle=0.3)
                n.cancel_scope.cancel()
        assert info.value.kind == "client" and info.value.timeout
        assert_not_watched(hub, pipe.upstream.fileno(), pipe.hub_side.fileno())
        pipe.close()


async def test_the_whole_body_in_the_initial_bytes_needs_no_engine_read() -> None:
    async with running_hub() as hub:
        pipe = await Pipe.open()
        whole = body_of(events(1, 3))
        with trio.fail_after(DEADLINE):
            chunks, leftover = await pipe.relay(hub, initial=whole + b"HTTP/1.1 200 OK\r\n")
            assert (chunks, leftover) == (3, b"HTTP/1.1 200 OK\r\n")
            assert await recv_exactly(pipe.client, len(whole)) == whole
        assert_not_watched(hub, pipe.upstream.fileno())
        pipe.engine.close()
        assert await recv_until_eof(pipe.upstream) == b""  # the hub read nothing of the engine
        pipe.close()


# ---- coalescing: a gap between passes only under load ----------------------------------------


async def run_batches(hub: RelayHub, streams: int, rounds: int, every: float) -> None:
    """`streams` engines each write one token every `every` seconds, all at the same instant
    (a batch engine emits a token for every sequence of the batch at each step)."""
    pipes = [await Pipe.open() for _ in range(streams)]
    evs = events(0, rounds)
    whole = body_of(evs)
    got: dict[int, bytes] = {}

    async def engine(p: Pipe) -> None:
        for e in evs:
            await send_all(p.engine, http1.chunk(e))
            await trio.sleep(every)
        await send_all(p.engine, http1.LAST_CHUNK)

    async def client(i: int, p: Pipe) -> None:
        got[i] = await recv_exactly(p.client, len(whole))

    async with trio.open_nursery() as n:
        for i, p in enumerate(pipes):
            n.start_soon(engine, p)
            n.start_soon(client, i, p)
            n.start_soon(p.relay, hub, 1000.0)
    assert got == {i: whole for i in range(streams)}
    for p in pipes:
        p.close()


async def test_below_the_busy_rate_every_token_goes_at_once(autojump_clock: trio.testing.MockClock) -> None:
    # 10 streams × 50 tokens/s = 500 tokens/s, in bursts of 10 at the same instant
    async with running_hub(coalesce=0.002, busy_rate=2000) as hub:
        await run_batches(hub, streams=10, rounds=60, every=0.02)
        assert hub.passes > 0
        assert hub.gaps == 0
        assert hub.rate < 2000


async def test_above_the_busy_rate_passes_are_spaced(autojump_clock: trio.testing.MockClock) -> None:
    # 40 streams × 1,000 tokens/s = 40,000 tokens/s
    async with running_hub(coalesce=0.002, busy_rate=2000) as hub:
        await run_batches(hub, streams=40, rounds=100, every=0.001)
        assert hub.gaps > 0
    async with running_hub(coalesce=0.0, busy_rate=2000) as hub:
        await run_batches(hub, streams=40, rounds=100, every=0.001)
        assert hub.gaps == 0  # coalesce 0: never
