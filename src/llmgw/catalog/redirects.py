"""Where a weights download may be redirected (issue 40, finding 4). Pure: the agent resolves
the addresses and passes them in.

A source's server may send the fetcher elsewhere (a CDN, a presigned object-store URL), and
whoever controls the source URL or that server could send it anywhere the node can reach: a
302 to `127.0.0.1:…/latest/meta-data/iam` was fetched, saved as model.safetensors, and the
replica went ready. So a redirect is followed only

- to the source's own host (the same host and port, or the default port of the target's
  scheme: an http → https upgrade), or to a host the catalog lists in `allow_redirect_hosts`
  (`cdn.example`, `cdn.example:8443`, or `*.example` for any name under example);
- for at most MAX_REDIRECTS hops (curl's --max-redirs and browsers allow more, but a weights
  store answers with one or two: the Hub's resolve → CDN, a mirror → its object store);
- never to an address that is loopback (or unspecified: 0.0.0.0 connects to the node itself),
  link-local (169.254.0.0/16, fe80::/10: where cloud metadata services answer) or a known
  metadata address, unless the source's own host resolves to that kind of address (a mirror on
  the node itself, a test on loopback): an allowed name can still be pointed at them by DNS.

Hosts say where bytes may come from, not what they are: a sha256 in the catalog pins content.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

from llmgw.catalog.sources import Url

MAX_REDIRECTS = 5
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
DEFAULT_PORTS = {"http": 80, "https": 443}

# The Hugging Face Hub answers /resolve/ of an LFS or Xet file with a redirect to its CDN or
# storage bridge, all under hf.co (cdn-lfs.hf.co, cdn-lfs-us-1.hf.co, cas-bridge.xethub.hf.co,
# us.aws.cdn.hf.co) or, for older files, huggingface.co (cdn-lfs.huggingface.co): the host list
# in huggingface/hub-docs, docs/hub/models-downloading.md ("downloading behind a proxy or
# firewall", PR #2628). A source on the Hub may go there without a catalog entry.
HUB_HOSTS = ("huggingface.co", "hf.co")
HUB_REDIRECT_HOSTS = ("*.hf.co", "*.huggingface.co", "huggingface.co", "hf.co")

# Cloud metadata services outside the link-local ranges: AWS's IPv6 IMDS, Alibaba Cloud's.
METADATA_ADDRESSES = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})

_PATTERN = re.compile(r"(\*\.)?([A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(:\d{1,5})?")


def allowed_host_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be an allow_redirect_hosts entry, or None."""
    if _PATTERN.fullmatch(pattern):
        return None
    return (f"allow_redirect_hosts entry {pattern!r} is not a host, host:port or *.domain "
            "(no scheme, path or user info)")


def _name(host: str) -> str:
    return host.lower().rstrip(".")


def port_of(url: Url) -> int:
    rest = url.authority[len(url.host):]
    if rest.startswith(":") and rest[1:].isdigit():
        return int(rest[1:])
    return DEFAULT_PORTS.get(url.scheme, 0)


def _matches(pattern: str, url: Url) -> bool:
    host, port = _name(url.host), port_of(url)
    name, want_port = pattern.lower(), ""
    if "]" in name:  # [v6]:port
        name, _, rest = name.partition("]")
        name, want_port = name + "]", rest.lstrip(":")
    else:
        name, _, want_port = name.partition(":")
    if want_port and int(want_port) != port:
        return False
    if name.startswith("*."):
        return host.endswith(name[1:]) and len(host) > len(name) - 1
    return host == _name(name)


def allowed_hosts(source: Url, configured: Sequence[str]) -> list[str]:
    """The catalog's list, plus the Hub's own CDN hosts for a source on the Hub."""
    hosts = list(configured)
    if _name(source.host) in HUB_HOSTS or any(_name(source.host).endswith("." + h) for h in HUB_HOSTS):
        hosts += [h for h in HUB_REDIRECT_HOSTS if h not in hosts]
    return hosts


def host_problem(source: Url, target: Url, configured: Sequence[str]) -> str | None:
    """Why the fetcher may not follow a redirect from `source` to `target` by host, or None."""
    if target.scheme not in DEFAULT_PORTS:
        return f"scheme {target.scheme!r} is not http or https"
    if _name(target.host) == _name(source.host) and (
            port_of(target) == port_of(source) or port_of(target) == DEFAULT_PORTS[target.scheme]):
        return None
    if any(_matches(p, target) for p in allowed_hosts(source, configured)):
        return None
    return (f"{target.authority} is not the source's host ({source.authority}) nor in the catalog's "
            "allow_redirect_hosts")


def address_kind(address: str) -> str | None:
    """"loopback", "link-local" or "metadata" for an address a redirect may not reach, else None."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip in METADATA_ADDRESSES or str(ip) == "169.254.169.254":
        return "metadata"
    if ip.is_loopback or ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK):
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    return None


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def address_problem(target: Url, target_addresses: Iterable[str], source_addresses: Iterable[str]) -> str | None:
    """Why `target`'s addresses may not be fetched from, or None: a loopback, link-local or
    metadata address, unless the source's own host resolved to one of that kind."""
    allowed = {address_kind(a) for a in source_addresses} - {None}
    for address in target_addresses:
        kind = address_kind(address)
        if kind is not None and kind not in allowed:
            return f"{target.host} resolves to {address}, a {kind} address (the source's host does not)"
    return None
