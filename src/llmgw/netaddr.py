"""Addresses as people and URLs want them: IPv6 literals in brackets, peers as host:port; and
the one read size every socket reader in llmgw uses."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
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


# ---- which interface holds an address (the agent's netif.py reads the table) -----------------

HOW_ADDRESS = "address"  # an interface holds the address
HOW_NONE = "none"  # none does (no address known, or it is not local: NAT, a proxy in between)


def same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.split("%", 1)[0]) == ipaddress.ip_address(b.split("%", 1)[0])
    except ValueError:
        return False


def choose_interface(address: str, addresses: Mapping[str, Iterable[str]]) -> tuple[str, str]:
    """(interface, "address"): the interface holding `address`, or ("", "none") when none does."""
    if address:
        for name in sorted(addresses):
            if any(same_address(address, held) for held in addresses[name]):
                return name, HOW_ADDRESS
    return "", HOW_NONE


def holding(candidates: Iterable[str], addresses: Mapping[str, Iterable[str]]) -> tuple[str, str]:
    """(interface, address): the first of `candidates` an interface holds, or ("", "")."""
    for address in candidates:
        name, how = choose_interface(address, addresses)
        if how == HOW_ADDRESS:
            return name, address.split("%", 1)[0]
    return "", ""


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return True
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host.rstrip(".").lower() == "localhost"
