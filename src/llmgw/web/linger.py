"""Lingering closes: an answer the client can read before the connection goes."""

from __future__ import annotations

import socket
from typing import Protocol

import trio

LINGER_SECONDS = 2.0
LINGER_BYTES = 4 * 1024 * 1024


async def answer_plain_on_tls(tcp: trio.SocketStream, data: bytes) -> None:
    """A plain-HTTP request on a TLS port is answered in plain text, as nginx does ("400 The
    plain HTTP request was sent to HTTPS port"): the client reads why and what to do, not
    "empty reply from server". The mirror of the ClientHello check in llmgw.web.server. Its write
    side is shut first and what else it sent is read and dropped briefly: closing with the
    request unread would reset the connection before the client reads the answer."""
    with trio.move_on_after(LINGER_SECONDS):
        try:
            await tcp.send_all(data)
            await tcp.send_eof()
            dropped = 0
            while dropped < LINGER_BYTES and (data := await tcp.receive_some(65536)):
                dropped += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


class _Reads(Protocol):
    async def recv(self) -> bytes: ...


async def drop_unread(sock: trio.socket.SocketType, raw: _Reads) -> None:
    """After a whole error answer on plain TCP: the client may still be sending a body nobody
    will read (a 413 is decided on Content-Length alone), and closing with unread data sends a
    reset that can destroy the answer before the client reads it. So the write side is shut and
    what still comes is read and dropped, for a bounded time and size (nginx's lingering close)."""
    with trio.move_on_after(LINGER_SECONDS):
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        dropped = 0
        while dropped < LINGER_BYTES:
            data = await raw.recv()
            if not data:
                return
            dropped += len(data)
