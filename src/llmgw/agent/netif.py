"""The interface an engine's ranks find each other on: the one holding this node's advertise_host.

One address per node, for everything a multi-node engine bootstraps with (issue 38): the server
takes rank 0's advertise_host (its endpoint host) as the master address every rank dials, and each
rank gets the interface holding its own node's advertise_host as NCCL_SOCKET_IFNAME and
GLOO_SOCKET_IFNAME, and that address as VLLM_HOST_IP / SGLANG_HOST_IP. Left to itself NCCL picks the
first interface that is not `lo` or `docker*`, which on a GPU node is often an IPoIB or a storage
interface the other ranks cannot reach, and the bootstrap hangs; vLLM guesses its IP from the
default route. When no interface holds the address, a multi-node launch is refused with the reason
(launch_env.check_address); there is no fallback interface to guess (eth0 was one, until issue 38).

`choose_interface` (llmgw.netaddr) is pure; `interface_addresses` reads the kernel's lists (SIOCGIFCONF for
IPv4, aliases included; /proc/net/if_inet6 for IPv6); `resolve` asks the resolver for a host name.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import logging
import socket
import struct

from llmgw.netaddr import HOW_ADDRESS, HOW_NONE, holding, is_ip

log = logging.getLogger(__name__)


_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union
_MAX_IFREQ = 1024


def resolve(host: str) -> list[str]:
    """The addresses `host` stands for: itself when it is an IP address (no lookup), else what
    the resolver says (IPv4 first, as getaddrinfo orders them); [] when it cannot say."""
    host = host.strip()
    if not host:
        return []
    if is_ip(host):
        return [host.split("%", 1)[0]]
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    out: list[str] = []
    for _family, _kind, _proto, _name, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in out:
            out.append(address)
    return out


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


def management_interface(host: str) -> tuple[str, str, str]:
    """(interface, address, how) for this node's advertise_host (a name is resolved): the
    interface holding it and the address it holds, or ("", "", "none") with a warning."""
    candidates = resolve(host)
    name, address = holding(candidates, interface_addresses())
    if not name:
        log.warning("no interface of this node holds its advertise_host %s%s; multi-node engines are refused "
                    "here until advertise_host is this node's address on the network the nodes share",
                    host or "(unset)", f" ({', '.join(candidates)})" if candidates and candidates != [host] else "")
        return "", "", HOW_NONE
    return name, address, HOW_ADDRESS
