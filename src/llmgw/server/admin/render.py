"""The admin pages as HTML: read models in, text out. Pure (no I/O, time passed in).

Everything a peer sent reaches the page through `esc` (html.escape, quotes included): node ids,
GPU names, switch and adapter descriptions (ibnetdiscover prints whatever a host or an attacker
wrote into its node description), reasons, engine log lines, event messages. Nothing is ever put
into a `<script>`, a `style` or an event attribute; the pages' JavaScript is in static files
(`static/`), and the Content-Security-Policy the handler sends allows no inline script, so a
string that slipped past `esc` still would not run. No secret is rendered: no token, no engine
key, no environment value the agent derived (only their names), no userinfo or query of a URL.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

if TYPE_CHECKING:  # types only: importing them would load trio and the server
    from llmgw.server.events import Event
    from llmgw.server.views import NodeDetail, NodeView, ReplicaView
    from llmgw.wire import messages as m

Url = Callable[[str], str]  # a static file's plain name → its content-hashed URL


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def path_part(value: str) -> str:
    """One URL path segment (a node or fabric id), percent-encoded, then escaped."""
    return esc(quote(value, safe=""))


def public_url(url: str) -> str:
    """A URL as a page may show it: no userinfo, no query, no fragment (where secrets go)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unreadable URL)"
    if not parts.scheme:
        return url.split("?", 1)[0]
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f}s ago"
    if s < 5400:
        return f"{s / 60:.0f}m ago"
    if s < 172800:
        return f"{s / 3600:.1f}h ago"
    return f"{s / 86400:.0f}d ago"


def clock(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(wall)) + "Z"


def size(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


STATE_CLASS = {
    "ready": "ok", "connected": "ok", "active": "ok", "ok": "ok", "master": "ok",
    "starting": "warn", "pending": "warn", "placing": "warn", "unreachable": "warn", "draining": "warn",
    "init": "warn", "stopping": "warn", "cordoned": "warn",
    "failed": "crit", "lost": "crit", "down": "crit", "crit": "crit",
}


def badge(state: str, title: str = "") -> str:
    cls = STATE_CLASS.get(state.lower(), "unknown")
    tip = f' title="{esc(title)}"' if title else ""
    return f'<span class="badge {cls}"{tip}>{esc(state)}</span>'


def table(head: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str, cls: str = "") -> str:
    """Cells are HTML already (escaped by their makers); head cells are plain text."""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="empty">{esc(empty)}</p>'
    heads = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f'<table class="{esc(cls)}"><thead><tr>{heads}</tr></thead><tbody>{body}</tbody></table>'


def layout(title: str, body: str, url: Url, *, page: str, fabrics: Sequence[str] = (), extra_script: str = "",
           data: dict[str, str] | None = None, refresh: bool = True) -> str:
    nav = "".join(f'<a href="/admin/fabrics/{path_part(f)}">fabric {esc(f)}</a>' for f in fabrics)
    attrs = "".join(f' data-{esc(k)}="{esc(v)}"' for k, v in (data or {}).items())
    script = f'<script src="{esc(url(extra_script))}" defer></script>' if extra_script else ""
    live = ' data-refresh="15"' if refresh else ""
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · llmgw admin</title>"
        '<link rel="icon" href="data:,">'
        f'<link rel="stylesheet" href="{esc(url("admin.css"))}">'
        f'<script src="{esc(url("admin.js"))}" defer></script>{script}'
        f'</head><body data-page="{esc(page)}"{attrs}>'
        f'<header><a class="brand" href="/admin/">llmgw</a><nav><a href="/admin/">cluster</a>{nav}</nav>'
        '<span id="updated" class="muted"></span></header>'
        f'<main id="main"{live}>{body}</main></body></html>'
    )


# -- the cluster page ---------------------------------------------------------------------------------


def node_problems(n: NodeView) -> list[str]:
    out = []
    if n.reason and n.state != "ready":
        out.append(n.reason)
    if n.gpu_note:
        out.append(n.gpu_note)
    for status in n.fabric_status:
        out.extend(f"{status.name}: {p}" for p in status.problems)
    down = [p.port for p in n.port_states if p.state.upper() != "ACTIVE"]
    if down:
        out.append(f"ports not active: {', '.join(down[:8])}" + (f" and {len(down) - 8} more" if len(down) > 8 else ""))
    return out


def problem_list(items: Sequence[str]) -> str:
    if not items:
        return '<span class="muted">none</span>'
    return '<ul class="problems">' + "".join(f"<li>{esc(p)}</li>" for p in items) + "</ul>"


def node_link(node_id: str) -> str:
    return f'<a href="/admin/nodes/{path_part(node_id)}">{esc(node_id)}</a>'


def nodes_table(nodes: Sequence[NodeView]) -> str:
    rows = (
        [node_link(n.id), badge(n.state, n.reason), esc(f"{n.gpus}× {n.gpu_name}" if n.gpus else "none"),
         esc(", ".join(n.fabrics) or "—"), esc(f"{n.ports_active}/{n.ports}"), esc(ago(n.last_heartbeat_age)),
         problem_list(node_problems(n))]
        for n in nodes
    )
    return table(["node", "state", "GPUs", "fabrics", "ports up", "heartbeat", "problems"], rows,
                 empty="No node has registered yet.", cls="nodes")


def progress_cell(r: ReplicaView) -> str:
    p = r.progress
    if p is None:
        return '<span class="muted">—</span>'
    name = public_url(p.source).rstrip("/").rsplit("/", 1)[-1] or "weights"
    if p.total:
        pct = min(100.0, 100.0 * p.bytes / p.total)
        return (f'<progress max="100" value="{pct:.0f}"></progress> {esc(name)} '
                f"{esc(size(p.bytes))} / {esc(size(p.total))} ({pct:.0f} %), {esc(size(p.rate))}/s")
    return f"{esc(name)} {esc(size(p.bytes))} so far, {esc(size(p.rate))}/s"


def placement_cell(r: ReplicaView) -> str:
    parts = [f"{node_link(sh.node)} GPUs {esc(','.join(map(str, sh.gpus)) or '—')}"
             + (f" (rank {sh.rank})" if len(r.shards) > 1 else "") for sh in sorted(r.shards, key=lambda s: s.rank)]
    return "<br>".join(parts) or '<span class="muted">not placed</span>'


def replicas_table(replicas: Sequence[ReplicaView]) -> str:
    rows = (
        [esc(r.id), esc(r.model), esc(r.profile), badge(r.state, r.reason), placement_cell(r), progress_cell(r),
         esc(r.reason) if r.reason else '<span class="muted">—</span>']
        for r in replicas
    )
    return table(["replica", "model", "profile", "state", "placement", "download", "reason"], rows,
                 empty="No replica: the catalog has no models, or none is placed yet.", cls="replicas")


def sm_cell(sm: dict[str, Any] | None) -> str:
    if not sm:
        return '<span class="crit">none</span>'
    return f'<code>{esc(sm.get("guid", ""))}</code> priority {esc(sm.get("priority", 0))}'


def sm_table(fabrics: Sequence[dict[str, Any]], now_wall: float) -> str:
    rows = []
    for f in fabrics:
        changes = f.get("master_changes") or []
        last = "<br>".join(f"{esc(ago(now_wall - c['at']))}: <code>{esc(c['old'] or '—')}</code> → "
                           f"<code>{esc(c['new'])}</code>" for c in changes[-3:]) or '<span class="muted">none</span>'
        standbys = [s for s in f.get("subnet_manager_list", []) if s.get("guid") in set(f.get("standbys") or [])]
        standby_cell = "<br>".join(sm_cell(s) for s in standbys) or '<span class="warn">none</span>'
        topo = f.get("topology") or {}
        shape = (f"{topo.get('switches', 0)} switches, {topo.get('adapters', 0)} adapters" if topo
                 else "not discovered yet")
        rows.append([f'<a href="/admin/fabrics/{path_part(f["id"])}">{esc(f["id"])}</a><br>'
                     f'<span class="muted">{esc(shape)}</span>', sm_cell(f.get("master")), standby_cell,
                     problem_list([p["message"] for p in f.get("problems", [])]), last])
    return table(["fabric", "master SM", "standbys", "problems", "last master changes"], rows,
                 empty="No fabric found yet: agents with InfiniBand ports and saquery report them.", cls="sms")


def events_table(events: Sequence[Event], now_wall: float) -> str:
    rows = (
        [f'<span title="{esc(clock(e.time))}">{esc(ago(now_wall - e.time))}</span>', esc(e.kind),
         node_link(e.node) if e.node else "", esc(e.message)]
        for e in reversed(events)
    )
    return table(["when", "kind", "node", "what"], rows, empty="Nothing has happened yet.", cls="events")


def cluster_page(nodes: Sequence[NodeView], replicas: Sequence[ReplicaView], fabrics: Sequence[dict[str, Any]],
                 events: Sequence[Event], now_wall: float, url: Url) -> str:
    ready_nodes = sum(1 for n in nodes if n.state == "ready")
    ready = sum(1 for r in replicas if r.state == "ready")
    body = (
        f'<h1>Cluster</h1><p class="summary">{ready_nodes} of {len(nodes)} nodes ready · {ready} of {len(replicas)} '
        f"replicas ready · {len(fabrics)} fabric{'' if len(fabrics) == 1 else 's'}</p>"
        f'<section><h2>Nodes</h2>{nodes_table(nodes)}</section>'
        f'<section><h2>Replicas</h2>{replicas_table(replicas)}</section>'
        f'<section><h2>Subnet managers</h2>{sm_table(fabrics, now_wall)}</section>'
        f'<section><h2>Recent events</h2>{events_table(events, now_wall)}</section>'
    )
    return layout("Cluster", body, url, page="cluster", fabrics=[f["id"] for f in fabrics])


# -- login and refusals -------------------------------------------------------------------------------


def login_page(url: Url, *, error: str = "", next_path: str = "/admin/") -> str:
    problem = f'<p class="crit" role="alert">{esc(error)}</p>' if error else ""
    body = (
        '<h1>Sign in</h1><p>These pages need a viewer or operator credential: paste a token whose sha256 is in '
        "<code>api.viewer_tokens</code> or <code>api.operator_tokens</code> (or open them with a viewer or operator "
        "client certificate).</p>"
        f'{problem}<form method="post" action="/admin/login" class="login">'
        f'<input type="hidden" name="next" value="{esc(next_path)}">'
        '<label>Token <input type="password" name="token" autocomplete="current-password" required autofocus></label>'
        '<button type="submit">Sign in</button></form>'
    )
    return layout("Sign in", body, url, page="login", refresh=False)


def refusal_page(url: Url, status: int, message: str) -> str:
    body = f'<h1>{status}</h1><p class="crit">{esc(message)}</p>'
    return layout("Refused" if status in (401, 403) else "Not found", body, url, page="error", refresh=False)


# -- a node's page --------------------------------------------------------------------------------------

# Counters that count traffic, not trouble: every other counter that is not zero is shown.
TRAFFIC = ("_data", "_packets", "_data_64", "_packets_64")
NOT_ERRORS = frozenset({"port_xmit_wait"})


def error_counters(reading: m.PortCounters | None) -> list[tuple[str, int]]:
    if reading is None:
        return []
    found = {"symbol_error": reading.symbol_error, "link_downed": reading.link_downed,
             "port_rcv_errors": reading.port_rcv_errors, **reading.counters}
    return sorted((name, value) for name, value in found.items()
                  if value and not name.endswith(TRAFFIC) and name not in NOT_ERRORS)


def gpus_table(node: NodeDetail) -> str:
    gpus = node.inventory.gpus if node.inventory else []
    rows = (
        [esc(g.index), esc(g.name), esc(f"{g.memory_mib / 1024:.0f} GiB" if g.memory_mib else "—"), badge(g.health),
         esc(", ".join(f"GPU {peer} ×{links}" for peer, links in sorted(g.nvlink.items())) or "none"),
         f"<code>{esc(g.pci_bus_id)}</code>" if g.pci_bus_id else ""]
        for g in gpus
    )
    return table(["GPU", "name", "memory", "health", "NVLink peers", "PCI"], rows,
                 empty=node.gpu_note or "No GPU reported.", cls="gpus")


def ports_table(node: NodeDetail) -> str:
    ports = node.inventory.ports if node.inventory else []
    readings = {(r.device, r.port): r for r in node.port_readings}
    carries: dict[str, list[str]] = {}
    for status in node.fabric_status:
        for name in status.ports:
            carries.setdefault(name, []).append(status.name)
    rows = []
    for p in ports:
        reading = readings.get((p.device, p.port))
        state = reading.state if reading and reading.state else p.state
        phys = reading.phys_state if reading and reading.phys_state else p.phys_state
        rate = reading.rate_gbps if reading and reading.rate_gbps else p.rate_gbps
        errors = error_counters(reading)
        error_cell = ("<br>".join(f'<span class="crit">{esc(n)} {esc(v)}</span>' for n, v in errors)
                      if errors else '<span class="muted">none</span>')
        roce = p.link_layer.lower() == "ethernet"
        rows.append([f"<code>{esc(p.device)}/{esc(p.port)}</code>", esc("RoCE" if roce else "InfiniBand"),
                     badge(state or "unknown"), esc(phys), esc(f"{rate:g} Gb/s {p.width} {p.speed}".strip()),
                     esc(", ".join(carries.get(f"{p.device}:{p.port}", [])) or "—"),
                     esc(p.netdev or "—"), f"<code>{esc(p.node_guid)}</code>", error_cell])
    return table(["port", "link layer", "state", "physical", "rate", "fabric", "netdev", "node GUID",
                  "error counters (not zero)"], rows, empty="No RDMA port.", cls="ports")


def shards_table(node_id: str, replicas: Sequence[ReplicaView]) -> str:
    blocks = []
    for r in replicas:
        for sh in r.shards:
            if sh.node != node_id:
                continue
            tail = "\n".join(r.tail[-20:])
            log = (f'<details><summary>log tail ({len(r.tail)} lines)</summary><pre class="log">{esc(tail)}</pre>'
                   "</details>" if r.tail else '<span class="muted">no output kept</span>')
            env = ", ".join(e.name for e in sh.launch_env)
            blocks.append([f"<code>{esc(sh.shard_id)}</code>", esc(r.model), esc(sh.rank),
                           esc(",".join(map(str, sh.gpus))), badge(sh.state, sh.reason), esc(sh.pid or "—"),
                           esc(sh.reason or ""), esc(env or "—"), log])
    return table(["shard", "model", "rank", "GPUs", "state", "pid", "reason", "launch env (names)", "output"],
                 blocks, empty="No shard runs on this node.", cls="shards")


def node_page(node: NodeDetail, replicas: Sequence[ReplicaView], fabrics: Sequence[str], url: Url) -> str:
    inv = node.inventory
    facts = [
        ("state", badge(node.state, node.reason) + (f" {esc(node.reason)}" if node.reason else "")),
        ("address", esc(node.address or "—")), ("agent", esc(node.version)),
        ("heartbeat", esc(ago(node.last_heartbeat_age))),
        ("identity", esc(node.identity or "none (no client certificate)")),
        ("host", esc(f"{inv.hostname}, {inv.cpus} CPUs, {inv.memory_mib / 1024:.0f} GiB" if inv else "—")),
        ("management", esc(f"{inv.mgmt_ip} on {node.mgmt_interface}" if inv and inv.mgmt_ip else "—")),
        ("features", esc(", ".join(node.features) or "none")),
    ]
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in facts)
    body = (
        f'<h1>Node {esc(node.id)}</h1><dl class="facts">{dl}</dl>'
        f'<section><h2>Problems</h2>{problem_list(node_problems(node))}</section>'
        f'<section><h2>GPUs</h2>{gpus_table(node)}</section>'
        f'<section><h2>RDMA ports</h2>{ports_table(node)}</section>'
        f'<section><h2>Shards</h2>{shards_table(node.id, replicas)}</section>'
    )
    return layout(f"Node {node.id}", body, url, page="node", fabrics=fabrics, data={"node": node.id})


# -- a fabric's page ----------------------------------------------------------------------------------


def fabric_page(fabric_id: str, fabrics: Sequence[str], url: Url) -> str:
    body = (
        f'<div class="fabric-head"><h1>Fabric <code>{esc(fabric_id)}</code></h1>'
        '<span id="fabric-counts" class="muted"></span>'
        '<input id="fabric-search" type="search" placeholder="find a node, device or switch" autocomplete="off">'
        '<label><input id="fabric-rails" type="checkbox"> colour by rail</label>'
        '<button id="fabric-fit" type="button">fit</button></div>'
        '<div id="fabric-stage"><canvas id="fabric-canvas"></canvas>'
        '<div id="fabric-legend"></div>'
        '<aside id="fabric-panel" hidden><button id="fabric-panel-close" type="button" aria-label="close">×</button>'
        '<div id="fabric-panel-body"></div></aside>'
        '<p id="fabric-message" class="muted">loading the topology …</p></div>'
    )
    return layout(f"Fabric {fabric_id}", body, url, page="fabric", fabrics=fabrics, extra_script="fabric.js",
                  data={"fabric": fabric_id}, refresh=False)
