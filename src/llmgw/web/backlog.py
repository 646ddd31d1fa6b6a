"""Connections waiting in a listening socket's accept queue, taken before the socket closes.

Closing a listening socket resets every connection the kernel queued on it and nobody accepted
yet, and with SO_REUSEPORT nothing moves them to the other sockets of the port (Linux does only
with the net.ipv4.tcp_migrate_req sysctl). A gateway worker that a reload retires while its
peers serve on would reset them: its e2e test (2 -> 3 -> 2 workers under load) saw one failed
request in about a third of its runs. Accepting what is queued right before the close, with no
checkpoint between the last accept and the close, leaves only a handshake still under way.
"""

from __future__ import annotations

import os
import socket

import trio


def accept_queued(listener: trio.SocketListener, most: int = 4096) -> list[trio.socket.SocketType]:
    """What waits in `listener`'s accept queue, accepted without blocking (at most `most`)."""
    own = socket.socket(fileno=os.dup(listener.socket.fileno()))
    own.setblocking(False)
    found: list[trio.socket.SocketType] = []
    try:
        while len(found) < most:
            try:
                sock, _ = own.accept()
            except OSError:  # EAGAIN: the queue is empty
                break
            found.append(trio.socket.from_stdlib_socket(sock))
    finally:
        own.close()
    return found
