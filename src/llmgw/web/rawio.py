"""Reads and writes on a plain TCP socket's file descriptor, waiting for readiness through trio.

Why not trio.SocketStream here: relaying a token stream is one small read and one small write
per token, and trio's high-level stream spends most of its time around the system calls
(conflict detection, a try-then-wait helper that makes two recv calls per read, context
managers). Measured on the gateway's streaming benchmark (200 streams × 200 tokens): ~58 µs of
gateway CPU per relayed chunk through SocketStream, against the 20 µs bar; the figures with
this module are in bench/bench_gateway.py's output. Waiting still goes through
trio.lowlevel.wait_readable/wait_writable, so cancellation and timeouts work as usual.
TLS connections keep using trio.SSLStream.
"""

from __future__ import annotations

import os

import trio

from llmgw.netaddr import READ_SIZE


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
