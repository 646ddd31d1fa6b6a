"""Whether a node's Register is admitted to the fleet: `admit_register()`, values in, a verdict out.

Until issue 42 these checks were the first 111 lines of `FleetService.handle`, between awaits
and log calls, so a test of one refusal needed a stream. Here they are one pure function of the
message, who the stream is from (its peer address, its certificate's name) and the config
(`AdmitRules`); the fleet service does what the verdict says: it logs the refusal's line, ends
the stream with its reason and message (`StreamRefused`, counted as
`llmgw_fleet_refused_total{reason=...}`), or registers the admitted Register.

The checks, in the order they run (the first that fails refuses):
  too_big      more GPUs, NVLink peers, ports, shards or fabrics than fleet.max_* allow (issue 9);
               GPUs, ports and shards are counted before the message is decoded (`refuse_by_count`)
  bad_node_id  a node id that is no host-name-like word (1-253 of [A-Za-z0-9-_.], alnum first)
  identity     with tls.require_identity, a certificate whose name is not the node id
  address      an advertise_host that is no IP or host name, or (fleet.endpoint_host: peer)
               one other than the address the stream comes from
Shard reports whose ids fail the one pattern (wire/ids.py) are left out of an admitted Register
and returned with their problems: the node itself is fine, those reports are refused.

Time is no parameter: no check depends on it (the fleet service passes its clock to the
refusal log, which bounds how often a refusal is logged).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import msgspec

from llmgw.wire import messages as m
from llmgw.wire.caps import Caps, register_census, register_problem
from llmgw.wire.ids import quote, spec_problems


@dataclass(frozen=True)
class AdmitRules:
    """The config the checks read (server config: fleet.max_*, tls.require_identity,
    fleet.endpoint_host)."""

    caps: Caps = field(default_factory=Caps)
    require_identity: bool = False
    endpoint_host: str = "advertised"  # or "peer"


@dataclass(frozen=True)
class Refusal:
    """Why a Register is refused: `reason` is the stream's refusal code and the metric's label,
    `message` what the agent is told, `log_fmt % log_args` the server's warning line."""

    reason: str
    message: str
    log_fmt: str
    log_args: tuple[object, ...]
    throttled: bool = False  # logged through the RefusalLog: a peer could send these in a loop


@dataclass(frozen=True)
class Admitted:
    """An admitted Register: without the shard reports whose ids fail the pattern (`dropped`:
    each such report's problems, in order), and the host its engines are reached on."""

    register: m.Register
    endpoint_host: str
    dropped: tuple[list[str], ...] = ()


def refuse_by_count(payload: bytes, *, peer: str, rules: AdmitRules) -> Refusal | None:
    """The too_big verdict on a node's first message, from a census of its GPUs, ports and shards
    before it is decoded (wire/caps.py: a Register of 100,000 GPUs is never built); None: decode
    it and ask `admit_register`."""
    census = register_census(payload, rules.caps)
    if census is None:
        return None
    node_id, too_big = census
    return _too_big(peer, node_id, too_big)


def _too_big(peer: str, node_id: str, too_big: str) -> Refusal:
    return Refusal("too_big", too_big, "fleet stream from %s (node %s) refused: %s", (peer, shown(node_id), too_big),
                   throttled=True)


def admit_register(msg: m.Register, *, peer: str, identity: str | None, rules: AdmitRules) -> Admitted | Refusal:
    """The verdict on a node's first message. `peer`: the stream's `host:port`; `identity`: the
    common name of its client certificate (None without TLS)."""
    too_big = register_problem(msg, rules.caps)
    if too_big is not None:
        return _too_big(peer, msg.node_id, too_big)
    node_id = msg.node_id
    if not valid_node_id(node_id):
        return Refusal("bad_node_id", f"invalid node id {shown(node_id)}",
                       "fleet stream from %s: invalid node id %s; closing", (peer, shown(node_id)))
    if rules.require_identity and identity != node_id:
        return Refusal("identity", f"client certificate is for {identity!r} but the agent registered as {node_id!r}",
                       "fleet stream from %s refused: certificate common name %r does not match node id %r",
                       (peer, identity, node_id))
    host, problem = decide_endpoint_host(rules.endpoint_host, msg.advertise_host, peer_host(peer))
    if problem:
        return Refusal("address", problem, "fleet stream from %s (node %s) refused: %s", (peer, node_id, problem))
    good, dropped = split_reports(msg.shards)
    register = msg if not dropped else msgspec.structs.replace(msg, shards=good)
    return Admitted(register, host, tuple(dropped))


def split_reports(reports: list[m.ShardReport]) -> tuple[list[m.ShardReport], list[list[str]]]:
    """The reports whose ids pass the pattern, and the problems of each one that does not."""
    good, dropped = [], []
    for report in reports:
        problems = list(spec_problems(report.spec))
        if problems:
            dropped.append(problems)
        else:
            good.append(report)
    return good, dropped


SHOWN = 300  # characters of a peer's unchecked value a refusal repeats (a node id is at most 253)


def shown(value: str) -> str:
    """A value the peer sent, not yet checked, for a refusal's message and log line: quoted and
    cut at SHOWN characters. A 3.4 MB advertise_host was repeated whole, in the agent's answer and
    a log line each time (51 MB of log for 15 refusals, and 5 MB of RSS each, issue 41)."""
    if len(value) <= SHOWN:
        return quote(value)
    return f"{quote(value[:SHOWN])}… ({len(value):,} characters)"


def peer_host(peer: str) -> str:
    """The address part of a `host:port` peer name (IPv6 without its brackets)."""
    host, sep, _ = peer.rpartition(":")
    return host.strip("[]") if sep else peer


def decide_endpoint_host(mode: str, advertised: str, peer_host: str) -> tuple[str, str]:
    """The host a node's engines are reached on, and why the registration is refused ("" if not).

    "advertised": the agent's `advertise_host` (its peer address when an older agent sends
    none). "peer": the address the stream comes from; a node that advertises another one is
    refused, so that a node can never send the gateway's traffic to a host it does not own.
    """
    advertised = advertised.strip()
    if advertised and not _valid_host(advertised):
        return "", f"advertise_host {shown(advertised)} is not an IP address or host name"
    if mode == "peer":
        if advertised and advertised != peer_host:
            return "", (f"the node advertises {advertised} for its engines but connects from {peer_host}, and "
                        "fleet.endpoint_host is peer: set advertise_host to the address it connects from")
        return peer_host, ""
    return advertised or peer_host, ""


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(
        0 < len(label) <= 63 and label[0].isalnum() and label[-1].isalnum()
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        for label in labels
    )


def valid_node_id(node_id: str) -> bool:
    return (
        0 < len(node_id) <= 253
        and node_id[0].isalnum()
        and all(c.isalnum() or c in "-_." for c in node_id)
    )
