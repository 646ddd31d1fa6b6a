"""One stream interface over plain sockets and TLS: `ByteStream` (recv, send_all, fd).

A plain TCP socket is read and written through its file descriptor (`RawSocket`), waiting for
readiness through trio; a TLS connection goes through trio.SSLStream (`TlsSocket`). `fd` says
which: a plain socket's bytes may be written to the fd directly (the relay hub does, see
llmgw.web.relay); a TLS stream has none.

Why not trio.SocketStream here: relaying a token stream is one small read and one small write
per token, and trio's high-level stream spends most of its time around the system calls
(conflict detection, a try-then-wait helper that makes two recv calls per read, context
managers). Measured on the gateway's streaming benchmark (200 streams × 200 tokens): ~58 µs of
gateway CPU per relayed chunk through SocketStream, against the 20 µs bar; the figures with
this module are in bench/bench_gateway.py's output. Waiting still goes through
trio.lowlevel.wait_readable/wait_writable, so cancellation and timeouts work as usual.
"""

from __future__ import annotations

import os
from typing import Protocol

import trio

from llmgw.netaddr import READ_SIZE


class Sink(Protocol):
    """Where bytes go: `send_all` raises trio.BrokenResourceError (or ClosedResourceError, or
    llmgw.web.server.ClientGone) when the peer is gone. `fd` is the plain socket's file
    descriptor when the bytes may be written to it untouched, else None."""

    @property
    def fd(self) -> int | None: ...

    async def send_all(self, data: bytes) -> None: ...


class ByteStream(Sink, Protocol):
    """A connection both ways: a plain socket (RawSocket) or TLS (TlsSocket)."""

    async def recv(self) -> bytes:
        """Some bytes, or b"" at EOF (a broken connection counts as EOF)."""
        ...


class RawSocket:
    """A connected, non-blocking TCP socket used through its fd. Owns nothing: close the
    trio socket (or stream) it came from to close it."""

    __slots__ = ("fd", "readable_hint")

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.fd = sock.fileno()
        self.readable_hint = False  # True right after a read filled the buffer: try again at once

    async def recv(self) -> bytes:
        """Some bytes, or b"" at EOF (a reset counts as EOF)."""
        fd = self.fd
        if not self.readable_hint:
            await trio.lowlevel.wait_readable(fd)
        while True:
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                continue
            except (ConnectionResetError, OSError):
                self.readable_hint = False
                return b""
            self.readable_hint = len(data) == READ_SIZE
            return data

    async def send_all(self, data: bytes) -> None:
        """Write everything; raises trio.BrokenResourceError if the peer is gone."""
        fd = self.fd
        try:
            try:
                sent = os.write(fd, data)  # the common case: the socket buffer takes it all
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            view = memoryview(data)
            total = len(view)
            while sent < total:
                try:
                    sent += os.write(fd, view[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(fd)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise trio.BrokenResourceError(f"socket write failed: {exc}") from exc


class TlsSocket:
    """A TLS connection behind the same interface as RawSocket; `fd` is None (the bytes on the
    socket are records, not the stream's bytes)."""

    __slots__ = ("stream",)
    fd: None = None

    def __init__(self, stream: trio.SSLStream) -> None:
        self.stream = stream

    async def recv(self) -> bytes:
        try:
            return bytes(await self.stream.receive_some(READ_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def send_all(self, data: bytes) -> None:
        await self.stream.send_all(data)
