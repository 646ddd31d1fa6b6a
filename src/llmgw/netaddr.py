"""Addresses as people and URLs want them: IPv6 literals in brackets, peers as host:port; and
the one read size every socket reader in llmgw uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type here: importing this module loads no event loop (tests/unit/test_purity.py)
    import trio

READ_SIZE = 65536  # bytes asked of one recv(): a TLS record is at most 16 KiB, an HTTP/2 frame 16 KiB by default


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
