"""The fabric map's values: nodes (switches, adapters, routers), links, and the lines a parser
could not read. Pure data, shared by the ibnetdiscover parsers and the analysis.

GUIDs are kept as text, `0x` and 16 lower-case hex digits (`0x0002c9030002847c`), the way
sminfo, saquery and sysfs-derived values are compared everywhere else. A GUID the source
redacted (`9c05<redacted>`) cannot be told apart from another redacted one, so such a node's key
is the raw token plus its description (see `node_key`).
"""

from __future__ import annotations

import enum
import re

import msgspec


class NodeKind(enum.StrEnum):
    SWITCH = "switch"
    CA = "ca"
    ROUTER = "router"


# Speeds in the order they were introduced; a lower index is slower per lane. FDR10 (10.3125
# Gb/s per lane, 64/66 encoding) sits between QDR (10, 8b/10b) and FDR (14.0625).
SPEEDS: tuple[str, ...] = ("SDR", "DDR", "QDR", "FDR10", "FDR", "EDR", "HDR", "NDR", "XDR")
SPEED_RANK = {name: i for i, name in enumerate(SPEEDS)}
LANE_GBPS = {"SDR": 2.5, "DDR": 5.0, "QDR": 10.0, "FDR10": 10.0, "FDR": 14.0, "EDR": 25.0,
             "HDR": 50.0, "NDR": 100.0, "XDR": 200.0}
# Widths ibnetdiscover prints (dump_linkwidth_compat): 1x 2x 4x 8x 12x; `??` when unknown.
WIDTHS: tuple[str, ...] = ("1x", "2x", "4x", "8x", "12x")


def lanes(width: str) -> int:
    """`4x` → 4; 0 when unknown (`??`)."""
    head = width[:-1]
    return int(head) if width.endswith("x") and head.isascii() and head.isdigit() and len(head) < 4 else 0


def link_gbps(width: str, speed: str) -> float:
    return lanes(width) * LANE_GBPS.get(speed, 0.0)


class Node(msgspec.Struct, kw_only=True, gc=False):
    key: str  # the GUID (`0x…`), or raw token + description when the GUID was redacted
    kind: NodeKind
    description: str = ""
    ports: int = 0  # port count the node line gave; 0 when the node was only referred to
    lid: int = 0  # a switch's port-0 LID, a CA's LID from its own port line
    devid: str = ""  # `0x1017`, from `devid=` before the block (empty in `-p` format)
    sysimgguid: str = ""
    seen: bool = True  # False: only other blocks refer to it (a truncated file)
    line: int = 0  # where its block starts (1-based); where it was first referred to if not seen


class End(msgspec.Struct, frozen=True, gc=False):
    key: str  # node key
    port: int


class Link(msgspec.Struct, kw_only=True, gc=False):
    a: End
    b: End
    width: str  # "4x"; "??" unknown
    speed: str  # "EDR"; "???" unknown
    line: int = 0  # the first line that described it
    a_port_guid: str = ""
    b_port_guid: str = ""

    @property
    def self_loop(self) -> bool:
        return self.a.key == self.b.key


class LineProblem(msgspec.Struct, frozen=True, gc=False):
    line: int  # 1-based
    text: str  # the line, cut to 120 characters
    reason: str


class Topology(msgspec.Struct, kw_only=True, gc=False):
    format: str  # "ibnetdiscover", "ibnetdiscover-ports" (-p), "ibdiagnet"
    nodes: dict[str, Node] = {}
    links: list[Link] = []
    problems: list[LineProblem] = []
    initiated_from: str = ""  # the node GUID the dump was taken from, when the header says
    redacted: bool = False  # GUIDs were redacted: nodes told apart by their descriptions

    def count(self, kind: NodeKind) -> int:
        return sum(1 for n in self.nodes.values() if n.kind is kind)


_GUID = re.compile(r"(?:0[xX])?([0-9a-fA-F]{1,16})")


def normalise_guid(token: str) -> str | None:
    """`8f10403960559`, `0x0008F10403960559` → `0x0008f10403960559`; None if not a GUID."""
    match = _GUID.fullmatch(token.strip())
    return "0x" + match[1].lower().rjust(16, "0") if match else None


def node_key(token: str, description: str) -> tuple[str, bool]:
    """The key of a node named `token` (the text after `S-`/`H-`/`R-`); the flag says it was
    redacted (`b83f<redacted>`): then the description is part of the key, since every node
    whose GUID starts the same would otherwise become one."""
    guid = normalise_guid(token)
    if guid is not None:
        return guid, False
    return f"{token.strip()}|{description}", True


def clip(line: str, limit: int = 120) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"
