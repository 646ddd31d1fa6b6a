"""Parse `ibnetdiscover` output — the default topology format and `-p` (ports) — into a `Topology`.

Pure: text in, values out. The formats are the printf calls in rdma-core's
infiniband-diags/ibnetdiscover.c (read at linux-rdma/rdma-core 691953d8d):

- `out_switch` / `out_ca`: `vendid=0x%x`, `devid=0x%x`, `sysimgguid=0x%x`, `switchguid=0x%x(%x)` or
  `caguid=0x%x`, then `Switch\\t%d "S-%016x"\\t\\t# "%s" base|enhanced port 0 lid %d lmc %d` or
  `Ca\\t%d "H-%016x"\\t\\t# "%s"` (`Rt`/`R-` for routers);
- `out_switch_port`: `[%d][ext %d]\\t"S-%016x"[%d](%x) \\t\\t# "%s" lid %d %s%s` — the `(port guid)`
  only when the peer is not a switch, `[ext N]` only with `-g`;
- `out_ca_port`: `[%d](%x) \\t"S-%016x"[%d]\\t\\t# lid %d lmc %d "%s" lid %d %s%s`;
- width `1x 2x 4x 8x 12x` (`??`) and speed `SDR DDR QDR FDR10 FDR EDR HDR NDR XDR` (`???`) printed
  together (`4xEDR`); `-p` (`dump_ports_report`): `"%2s %5d %2d 0x%016x %s %s"` then
  ` - %2s %5d %2d 0x%016x ( '%s' - '%s' )` or padding and `'%s'` for an unconnected port.

What the real samples add (tests/fixtures/real/SOURCES.md): tabs turned into spaces, CRLF, a
UTF-8 BOM, a shell prompt or a stderr warning line, `#` inside quoted descriptions (so the quoted
strings are parsed, never split on `#`), self-loop cables, SHARP aggregation nodes (CAs on a
switch's last port), ibdiagnet's `[1](1)` front-panel label after a switch port, redacted GUIDs,
and files cut short, whose blocks refer to nodes whose own blocks are missing (those nodes are
kept, marked `seen=False`). A line that fits none of this is reported with its number and left
out of the map; nothing aborts the parse.

Every link is printed from both ends; the two reports become one `Link`. When they disagree on
width or speed (the man page's example does), the lower one is kept: a port that trained short
is what an operator needs to see.
"""

from __future__ import annotations

import re

from llmgw.fabric.topology import (
    SPEED_RANK,
    End,
    LineProblem,
    Link,
    Node,
    NodeKind,
    Topology,
    clip,
    lanes,
    node_key,
    normalise_guid,
)

KINDS = {"S": NodeKind.SWITCH, "H": NodeKind.CA, "R": NodeKind.ROUTER}
NODE_WORDS = {"Switch": NodeKind.SWITCH, "Ca": NodeKind.CA, "Rt": NodeKind.ROUTER}
PORTS_KINDS = {"SW": NodeKind.SWITCH, "CA": NodeKind.CA, "RT": NodeKind.ROUTER}

# Numbers are capped at 9 digits: int() of a few thousand digits raises, and no port, LID or
# port count needs more. re.ASCII: `\d` and `\s` mean what the C printf wrote.
_NODE = re.compile(
    r'(Switch|Ca|Rt)\s+(\d{1,9})\s+"([SHR])-([^"]*)"\s*(?:#\s*"(.*)"(.*))?$', re.ASCII
)
_SWITCH_TAIL = re.compile(r"\s*(?:base|enhanced)\s+port\s+0\s+lid\s+(\d{1,9})\s+lmc\s+\d{1,9}", re.ASCII)
_PORT = re.compile(
    r"\[(\d{1,9})\](?:\[ext\s*\d{1,9}\])?(?:\(([^)]*)\))?(?:\(([^)]*)\))?\s*"  # local port, [ext], (guid | label)x2
    r'"([SHR])-([^"]*)"\[(\d{1,9})\](?:\[ext\s*\d{1,9}\])?'  # the peer
    r"(?:\s*\(([^)]*)\))?\s*#\s*(.*)$",  # the peer's port guid, then the comment
    re.ASCII,
)
# The same with the comment read in the same match: one regex call per port line.
_PORT_FULL = re.compile(
    _PORT.pattern[: -len("(.*)$")]
    + r'(?:lid\s+(\d{1,9})\s+lmc\s+\d{1,9}\s+)?"(.*)"\s+lid\s*(-?\d{1,9})?'
    + r'(?:\s+(\d{1,2}x|\?\?)([A-Z0-9]+|\?\?\?))?',
    re.ASCII,
)
_ID_NAMES = frozenset(("vendid", "devid", "sysimgguid", "switchguid", "caguid", "rtguid"))
_INITIATED = re.compile(r"#\s*Initiated from node\s+([0-9a-fA-F]{1,16})", re.ASCII)
_PORTS_LINE = re.compile(
    r"(SW|CA|RT)\s+(\d{1,9})\s+(\d{1,9})\s+0x([0-9a-fA-F]{1,16})\s+(\d{1,2}x|\?\?)\s*([A-Z0-9]+|\?\?\?)"
    r"(?:\s+-\s+(SW|CA|RT)\s+(\d{1,9})\s+(\d{1,9})\s+0x([0-9a-fA-F]{1,16})\s+\(\s*'(.*?)'\s+-\s+'(.*)'\s*\)"
    r"|\s+'(.*)'|\s+(\S.*?))?\s*$",
    re.ASCII,
)
_PORTS_SNIFF = re.compile(r"\s*(SW|CA|RT)\s+\d+\s+\d+\s+0x[0-9a-fA-F]", re.ASCII)
# Lines ibnetdiscover -g prints around chassis; they carry nothing the map needs.
_IGNORED_PREFIXES = ("Non-Chassis Nodes", "Chassis ", "Hostname:")


def parse_topology(text: str) -> Topology:
    """Either format, told apart by the first lines that look like output."""
    for line in _head(text, 60):
        if _PORTS_SNIFF.match(line):
            return parse_ports(text)
    return parse_ibnetdiscover(text)


def _head(text: str, count: int) -> list[str]:
    out: list[str] = []
    for line in text[:20000].splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line)
            if len(out) >= count:
                break
    return out


def _lines(text: str) -> list[str]:
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.splitlines()  # \r\n, \r and \n alike


class _Builder:
    """Nodes and links as the lines arrive, both ends of a link folded into one.

    The hot path (a port line) costs one regex match and a few dict lookups: the largest real
    sample has 16,400 lines and `make bench-fabric` holds parse + analysis to 20× a bare
    whitespace split of the same text.
    """

    def __init__(self, fmt: str) -> None:
        self.topo = Topology(format=fmt, nodes={}, links=[], problems=[])
        self.links: dict[tuple[str, int, str, int], Link] = {}
        self.keys: dict[str, str] = {}  # raw GUID token → key, for GUIDs (redacted ones excluded)
        self.guids: dict[str, str] = {}  # raw GUID token → `0x…` ("" if not a GUID)

    def guid(self, token: str) -> str:
        """normalise_guid, remembered: a port GUID is printed from both ends of its cable."""
        found = self.guids.get(token)
        if found is None:
            found = self.guids[token] = normalise_guid(token) or ""
        return found

    def problem(self, number: int, line: str, reason: str) -> None:
        self.topo.problems.append(LineProblem(line=number, text=clip(line.strip()), reason=reason))

    def key(self, token: str, description: str) -> str:
        key = self.keys.get(token)
        if key is not None:
            return key
        key, redacted = node_key(token, description)
        if redacted:
            self.topo.redacted = True
        else:
            self.keys[token] = key
        return key

    def node(self, kind: NodeKind, token: str, description: str, number: int, *, seen: bool) -> Node | None:
        key = self.key(token, description)
        node = self.topo.nodes.get(key)
        if node is None:
            node = Node(key=key, kind=kind, description=description, seen=seen, line=number)
            self.topo.nodes[key] = node
            return node
        if node.kind is not kind:
            return None
        if seen and not node.seen:
            node.seen, node.line = True, number
            node.description = description or node.description
        return node

    def link(self, a_key: str, a_port: int, b_key: str, b_port: int, width: str, speed: str, number: int,
             a_guid: str, b_guid: str) -> None:
        if (a_key, a_port) > (b_key, b_port):
            a_key, a_port, b_key, b_port, a_guid, b_guid = b_key, b_port, a_key, a_port, b_guid, a_guid
        key = (a_key, a_port, b_key, b_port)
        old = self.links.get(key)
        if old is None:
            self.links[key] = Link(a=End(a_key, a_port), b=End(b_key, b_port), width=width, speed=speed,
                                   line=number, a_port_guid=a_guid, b_port_guid=b_guid)
            return
        if width != old.width and lanes(width) and (not lanes(old.width) or lanes(width) < lanes(old.width)):
            old.width = width
        if speed != old.speed and speed in SPEED_RANK and (
            old.speed not in SPEED_RANK or SPEED_RANK[speed] < SPEED_RANK[old.speed]
        ):
            old.speed = speed
        if a_guid and not old.a_port_guid:
            old.a_port_guid = a_guid
        if b_guid and not old.b_port_guid:
            old.b_port_guid = b_guid

    def done(self) -> Topology:
        self.topo.links = list(self.links.values())
        return self.topo


def parse_ibnetdiscover(text: str) -> Topology:
    """The default format (and ibdiagnet's `ibdiagnet2.ibnetdiscover` variant)."""
    build = _Builder("ibnetdiscover")
    topo = build.topo
    ids: dict[str, str] = {}
    current: Node | None = None
    port_match = _PORT_FULL.match
    for number, line in enumerate(_lines(text), 1):
        if not line:
            continue
        first = line[0]
        if first == " " or first == "\t":
            line = line.strip()
            if not line:
                continue
            first = line[0]
        if first == "[":
            match = port_match(line)
            if match is not None and current is not None:
                _port_line(build, current, match, number)
            else:
                _port_problem(build, current, line, number)
            continue
        if first == "#":
            if "generated by IBDIAG" in line:
                topo.format = "ibdiagnet"
            elif line.startswith("# Initiated from node"):
                found = _INITIATED.match(line)
                if found:
                    topo.initiated_from = normalise_guid(found[1]) or ""
            continue
        name, eq, value = line.partition("=")
        if eq and name in _ID_NAMES:
            ids[name] = value
            continue
        match = _NODE.match(line)
        if match:
            current = _node_line(build, match, ids, line, number)
            ids = {}
            continue
        if line.startswith(_IGNORED_PREFIXES):
            continue
        build.problem(number, line, "not ibnetdiscover output (a warning, a prompt or a cut line?)")
    return build.done()


def _node_line(build: _Builder, match: re.Match[str], ids: dict[str, str], raw: str, number: int) -> Node | None:
    word, ports, prefix, token, description, tail = match.groups()
    kind = NODE_WORDS[word]
    if KINDS[prefix] is not kind:
        build.problem(number, raw, f"a {word} line names a {KINDS[prefix].value} ({prefix}-)")
        return None
    description = description or ""
    node = build.node(kind, token, description, number, seen=True)
    if node is None:
        build.problem(number, raw, "the GUID was seen before as another kind of node")
        return None
    node.ports = int(ports)
    devid = ids.get("devid")
    if devid is not None:
        node.devid = devid.strip().lower()
    sysimg = ids.get("sysimgguid")
    if sysimg is not None:
        node.sysimgguid = sysimg.strip().lower()  # as printed; nothing compares it
    if kind is NodeKind.SWITCH and tail:
        lid = _SWITCH_TAIL.match(tail)
        if lid:
            node.lid = int(lid[1])
    return node


def _port_problem(build: _Builder, current: Node | None, line: str, number: int) -> None:
    if current is None and _PORT.match(line) is not None:
        reason = "a port line outside any node block"
    elif _PORT.match(line) is None:
        reason = "neither a port line (`[port] \"X-guid\"[port] # ...`) nor ibnetdiscover output"
    else:
        reason = "a port line without `\"description\" lid N <width><speed>`"
    build.problem(number, line, reason)


def _port_line(build: _Builder, current: Node, match: re.Match[str], number: int) -> None:
    (port, local_paren, second_paren, prefix, token, peer_port, peer_guid,
     own_lid, description, peer_lid, width, speed) = match.groups()
    # Old OFED (no `<width><speed>`): the cable is kept, its rate unknown. ibdiagnet's invalid
    # LIDs (`lid  4xHDR`, `lid -1`) read as 0.
    width, speed = width or "??", speed or "???"
    lid = int(peer_lid) if peer_lid and not peer_lid.startswith("-") else 0
    if second_paren and not (local_paren and normalise_guid(local_paren)):
        local_paren = second_paren  # ibdiagnet: `[1](label)(guid)` or `[1](guid)(label)`
    kind = KINDS[prefix]
    key = build.keys.get(token) or build.key(token, description)
    peer = build.topo.nodes.get(key)
    if peer is None or peer.kind is not kind:
        peer = build.node(kind, token, description, number, seen=False)
        if peer is None:
            build.problem(number, match.string, "the peer GUID was seen before as another kind of node")
            return
        if not peer.lid:
            peer.lid = lid
    local_guid = ""
    if current.kind is not NodeKind.SWITCH:
        local_guid = build.guid(local_paren) if local_paren else ""
        if own_lid and not current.lid:
            current.lid = int(own_lid)
    build.link(current.key, int(port), peer.key, int(peer_port), width, speed, number,
               local_guid, build.guid(peer_guid) if peer_guid else "")


def parse_ports(text: str) -> Topology:
    """`ibnetdiscover -p`: one line per port, `SW  1719 10 0x... 4x EDR - CA   134  1 0x... ( 'a' - 'b' )`.

    Only port GUIDs are printed, so a CA's key is its port GUID (a switch's ports all carry the
    switch's GUID). Descriptions lose the blanks at their ends (`' 5FB0406-spine-IB02 '`); an
    unquoted one (a hand-edited fixture) is taken as it stands.
    """
    build = _Builder("ibnetdiscover-ports")
    for number, raw in enumerate(_lines(text), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _PORTS_LINE.match(line)
        if match is None:
            build.problem(number, raw, "not an `ibnetdiscover -p` port line")
            continue
        (kind, lid, port, guid, width, speed, peer_kind, peer_lid, peer_port, peer_guid,
         local_desc, peer_desc, lone_quoted, lone_bare) = match.groups()
        description = (local_desc if local_desc is not None else lone_quoted if lone_quoted is not None
                       else lone_bare or "").strip()
        node = _ports_node(build, PORTS_KINDS[kind], guid, description, int(lid), number)
        if node is None:
            build.problem(number, raw, "the GUID was seen before as another kind of node")
            continue
        if peer_kind is None:
            continue
        peer = _ports_node(build, PORTS_KINDS[peer_kind], peer_guid, (peer_desc or "").strip(), int(peer_lid),
                           number, seen=False)
        if peer is None:
            build.problem(number, raw, "the peer GUID was seen before as another kind of node")
            continue
        build.link(node.key, int(port), peer.key, int(peer_port), width, speed, number,
                   node.key if node.kind is not NodeKind.SWITCH else "",
                   peer.key if peer.kind is not NodeKind.SWITCH else "")
    return build.done()


def _ports_node(build: _Builder, kind: NodeKind, guid: str, description: str, lid: int, number: int,
                *, seen: bool = True) -> Node | None:
    node = build.node(kind, guid, description, number, seen=seen)
    if node is None:
        return None
    node.lid = node.lid or lid
    if seen and not node.description:
        node.description = description
    return node
