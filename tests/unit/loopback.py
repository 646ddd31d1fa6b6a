"""Real TCP sockets on 127.0.0.1 for the llmgw.web tests (trio)."""

from __future__ import annotations

import functools
import socket
from collections.abc import Awaitable, Callable

import trio

DEADLINE = 10.0  # seconds a condition may take on a loaded 2-core machine


async def tcp_pair() -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    """Two connected, non-blocking TCP sockets on loopback."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    a = trio.socket.socket()
    await a.connect(listener.getsockname())
    b, _ = await listener.accept()
    listener.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


async def recv_exactly(sock: trio.socket.SocketType, n: int) -> bytes:
    """n bytes, or fewer if the peer closes first."""
    out = bytearray()
    while len(out) < n:
        data = await sock.recv(n - len(out))
        if not data:
            break
        out += data
    return bytes(out)


async def recv_until_eof(sock: trio.socket.SocketType) -> bytes:
    out = bytearray()
    while True:
        try:
            data = await sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    return bytes(out)


async def send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def wait_for(condition: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    """Poll a condition with a deadline (for state with no event to wait on)."""
    with trio.fail_after(deadline):
        while not condition():  # noqa: ASYNC110 - state with no event to wait on
            await trio.sleep(0.001)  # ok: poll interval of a deadline-bounded wait
    assert condition(), what


ConnHandler = Callable[[trio.SocketStream], Awaitable[None]]


async def serve_tcp(nursery: trio.Nursery, handler: ConnHandler) -> int:
    """Serve handler on a free loopback port; returns the port."""
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


def closed_port() -> int:
    """A loopback port with (almost certainly) nothing listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
