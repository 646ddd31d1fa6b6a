"""The management interface: the name of the interface holding the address the agent reaches
the server from. Engines get it as NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: left to itself
NCCL picks the first interface that is not `lo` or `docker*`, which on a GPU node is often an
IPoIB or a storage interface the other ranks cannot reach, and the bootstrap hangs.

`choose_interface` is pure; `interface_addresses` reads the kernel's lists (SIOCGIFCONF for
IPv4, aliases included; /proc/net/if_inet6 for IPv6). `eth0` is the last resort, logged.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Iterable, Mapping

log = logging.getLogger(__name__)

FALLBACK_INTERFACE = "eth0"
HOW_ADDRESS = "address"
HOW_FALLBACK = "fallback"

_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union
_MAX_IFREQ = 1024


def _same(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a.split("%", 1)[0]) == ipaddress.ip_address(b.split("%", 1)[0])
    except ValueError:
        return False


def choose_interface(address: str, addresses: Mapping[str, Iterable[str]]) -> tuple[str, str]:
    """(interface, how): the interface holding `address` ("address"), or eth0 ("fallback")
    when none does (no address known, or it is not local: NAT, a proxy in between)."""
    if address:
        for name in sorted(addresses):
            if any(_same(address, held) for held in addresses[name]):
                return name, HOW_ADDRESS
    return FALLBACK_INTERFACE, HOW_FALLBACK


def _ipv4_addresses() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    buf = array.array("B", bytes(_IFREQ_SIZE * _MAX_IFREQ))
    pointer, _ = buf.buffer_info()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        result = fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, struct.pack("iL", len(buf), pointer))
    length = struct.unpack("iL", result)[0]
    data = buf.tobytes()[:length]
    for offset in range(0, length - _IFREQ_SIZE + 1, _IFREQ_SIZE):
        label = data[offset : offset + 16].split(b"\0", 1)[0].decode(errors="replace")
        address = socket.inet_ntoa(data[offset + 20 : offset + 24])
        out.setdefault(label.split(":", 1)[0], []).append(address)  # eth0:1 is an alias of eth0
    return out


def _ipv6_addresses(path: str = "/proc/net/if_inet6") -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and len(fields[0]) == 32:
            try:
                address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            except ValueError:
                continue
            out.setdefault(fields[5], []).append(address)
    return out


def interface_addresses() -> dict[str, list[str]]:
    """Every interface's addresses (never raises: what cannot be read is left out)."""
    out: dict[str, list[str]] = {}
    try:
        out.update(_ipv4_addresses())
    except OSError as exc:
        log.debug("SIOCGIFCONF failed: %s", exc)
    for name, addresses in _ipv6_addresses().items():
        out.setdefault(name, []).extend(addresses)
    return out


def management_interface(address: str) -> tuple[str, str]:
    name, how = choose_interface(address, interface_addresses())
    if how == HOW_FALLBACK:
        log.warning("no interface holds the management address %s; engines get %s as NCCL_SOCKET_IFNAME and "
                    "GLOO_SOCKET_IFNAME as a last resort (set them in the profile's env if that is wrong)",
                    address or "(unknown)", name)
    return name, how
