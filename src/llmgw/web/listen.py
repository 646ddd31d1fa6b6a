"""The sockets a listener starts from: bound before anything else starts, so that a port in use is
one clear line (`llmgw server`'s ports, `llmgw gateway`'s client and metrics ports, the server's
Unix sockets). Here rather than in server/app.py so that a gateway on its own binds its port
without importing the control plane (issue 42)."""

from __future__ import annotations

import os
import socket

from llmgw.errors import UsageError


def split_hostport(text: str, what: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{what} address {text!r} must be HOST:PORT (set it with {flag})")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def bind_socket(text: str, what: str, flag: str, *, reserve: bool = False, listen: bool | None = None) -> socket.socket:
    """Bind now, so that a port in use is one clear line before anything starts. `reserve`: bind
    with SO_REUSEPORT and do not listen (the gateway workers listen on the port; this socket
    only holds it for them and names the port they are to bind when it was 0). `listen=False`:
    bound only, the caller listens once it can serve (`llmgw gateway`, after its first config)."""
    host, port = split_hostport(text, what, flag)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reserve:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} for the {what}: {exc.strerror or exc}; choose another with {flag}"
        ) from None
    if (not reserve) if listen is None else listen:
        sock.listen(4096)
    sock.setblocking(False)
    return sock


def unix_socket(path: str) -> socket.socket:
    """A listening Unix socket only this user can reach (0600): a stale file from a killed
    server is replaced."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(4096)
    sock.setblocking(False)
    return sock
