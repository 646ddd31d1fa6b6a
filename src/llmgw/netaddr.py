"""Addresses as people and URLs want them: IPv6 literals in brackets, peers as host:port."""

from __future__ import annotations

import trio


def url_host(host: str) -> str:
    """A host for a URL or a Host header: an IPv6 literal goes in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def hostport(host: str, port: int) -> str:
    return f"{url_host(host)}:{port}"


def peer_name(stream: trio.SocketStream) -> str:
    """The remote end of a connection, for logs ("unknown" once it is gone)."""
    try:
        host, port, *_ = stream.socket.getpeername()
    except (OSError, ValueError):
        return "unknown"
    return hostport(host, port)
