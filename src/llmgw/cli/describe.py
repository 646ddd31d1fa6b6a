"""One object at a time: `ctl nodes NODE`, `ctl replicas ID`, `ctl models NAME` (issue 46).

What kubectl's `describe` gives a user coming from it: the object's fields, then what belongs to
it (a node's GPUs with their latest readings, its ports, fabrics, replicas and recent events; a
replica's shards and last output; a model's replicas). `-o json` / `-o yaml` print the object the
API returns, `-o name` its kind/name. Rendering only: the data comes from the API as is.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from rich.console import Group
from rich.text import Text

from llmgw.api_client import ApiClient
from llmgw.catalog.units import format_duration
from llmgw.cli.render import console, make_table, print_data, print_names, styled_state, text
from llmgw.errors import LlmgwError

RECENT_EVENTS = 10


def _fields(rows: list[tuple[str, Any]]) -> Any:
    table = make_table(["", ""], [(text(k, "bold"), v if isinstance(v, Text) else text("-" if v in (None, "") else v))
                                  for k, v in rows])
    table.show_header = False
    return table


def _section(title: str, columns: list[str], rows: list[tuple[Any, ...]], empty: str) -> list[Any]:
    heading = text(title, "bold")
    if not rows:
        return [Text(""), heading, text(f"  {empty}")]
    return [Text(""), heading, make_table(columns, rows)]


def _events(client: ApiClient, **query: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = client.get("/api/v1/events?" + urlencode({**query, "since": "24h"}))
    return events[-RECENT_EVENTS:]


def _event_rows(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    from llmgw.cli.day2 import event_time

    return [(event_time(e["time"]), e["kind"], e["message"]) for e in events]


def node(client: ApiClient, node_id: str, output: str) -> None:
    n: dict[str, Any] = client.get(f"/api/v1/nodes/{quote(node_id, safe='')}")
    if output == "name":
        print_names("node", [n["id"]])
        return
    if print_data(n, output):
        return
    age = n.get("last_heartbeat_age")
    days = n.get("cert_days_left")
    parts: list[Any] = [_fields([
        ("Node", n["id"]),
        ("State", styled_state(n["state"] + (f",{n['mark']}" if n.get("mark") else ""))),
        ("Reason", n.get("reason")),
        ("Address", n.get("address")),
        ("Agent", n.get("version")),
        ("Identity", n.get("identity")),
        ("Certificate", None if days is None else f"expires in {days:g} days"),
        ("Heartbeat", None if age is None
         else f"{format_duration(age)} ago ({n.get('heartbeats', 0)} since the server started)"),
        ("GPUs from", str(n.get("gpu_source") or "-") + (f" ({n['gpu_note']})" if n.get("gpu_note") else "")),
        ("Versions", _versions(n.get("inventory") or {})),
        ("Features", ", ".join(n.get("features") or [])),
        ("Mgmt interface", n.get("mgmt_interface")),
    ])]
    health = {h["index"]: h for h in n.get("gpu_health") or []}
    unplaceable = n.get("unplaceable") or {}  # GPU index (as text) → why placement skips it (issue 43)
    gpus = []
    for g in (n.get("inventory") or {}).get("gpus") or []:
        h = health.get(g["index"], {})
        peers = ", ".join(f"{peer}×{links}"
                          for peer, links in sorted((g.get("nvlink") or {}).items(), key=lambda kv: int(kv[0])))
        gpus.append((str(g["index"]), g.get("name") or "-",
                     f"{h.get('memory_used_mib', 0)}/{g.get('memory_mib', 0)} MiB",
                     f"{h.get('utilization_pct', 0)}%", f"{h.get('temperature_c', 0)} °C",
                     "-" if h.get("power_w") is None else f"{h['power_w']:g} W", _maybe(h.get("ecc_uncorrected")),
                     _maybe(h.get("xid")), peers or "-", _maybe(h.get("nvlink_down")), g.get("pci_bus_id") or "-",
                     f"no: {unplaceable[str(g['index'])]}" if str(g["index"]) in unplaceable else "yes"))
    parts += _section("GPUs (latest heartbeat)", ["GPU", "NAME", "MEMORY", "UTIL", "TEMP", "POWER", "ECC", "XID",
                                                  "NVLINK PEERS", "LINKS DOWN", "PCI", "PLACEABLE"], gpus, "none")
    ports = [(p["port"], styled_state(p["state"]), p.get("phys_state") or "-", f"{p.get('rate_gbps', 0):g} Gb/s")
             for p in n.get("port_states") or []]
    parts += _section("Ports", ["PORT", "STATE", "PHYS", "RATE"], ports, "no RDMA ports")
    fabrics = [(f["name"], "yes" if f.get("usable") else "no", f"{f.get('rate_gbps', 0):g} Gb/s",
                ",".join(f.get("ports") or []) or "-", "; ".join(f.get("problems") or []) or "-")
               for f in n.get("fabric_status") or []]
    parts += _section("Fabrics", ["FABRIC", "USABLE", "RATE", "PORTS", "PROBLEMS"], fabrics, "none declared or found")
    replicas = [(r["id"], r["model"], str(s["rank"]), styled_state(s["state"]),
                 ",".join(str(i) for i in s["gpus"]) or "-", r.get("endpoint") or "-")
                for r in client.get("/api/v1/replicas") for s in r.get("shards") or [] if s["node"] == n["id"]]
    parts += _section("Replicas", ["REPLICA", "MODEL", "RANK", "SHARD", "GPUS", "ENDPOINT"], replicas,
                      "none on this node")
    parts += _section(f"Events (last {RECENT_EVENTS}, 24 h)", ["TIME", "KIND", "EVENT"],
                      _event_rows(_events(client, node=n["id"])), "none")
    console().print(Group(*parts))


def replica(client: ApiClient, replica_id: str, output: str) -> None:
    r: dict[str, Any] = client.get(f"/api/v1/replicas/{quote(replica_id, safe='')}")
    if output == "name":
        print_names("replica", [r["id"]])
        return
    if print_data(r, output):
        return
    move = r.get("move")
    parts: list[Any] = [_fields([
        ("Replica", r["id"]),
        ("Model", r["model"]),
        ("Profile", r.get("profile")),
        ("State", styled_state(r["state"])),
        ("Reason", r.get("reason")),
        ("Endpoint", r.get("endpoint")),
        ("Age", format_duration(r.get("age", 0))),
        ("Attempt", f"{r.get('attempt', 0)} ({r.get('failures', 0)} failed)"),
        ("Adopted", "yes" if r.get("adopted") else "no"),
        ("Move", None if not move else (f"{move['kind']} {move['state']} ({move['role']}, "
                                        f"other {move.get('other') or '-'}): {move.get('note')}")),
    ])]
    shards = [(str(s["rank"]), s["node"], ",".join(str(g) for g in s["gpus"]) or "-", styled_state(s["state"]),
               str(s.get("port") or "-"), s["shard_id"]) for s in r.get("shards") or []]
    parts += _section("Shards", ["RANK", "NODE", "GPUS", "STATE", "PORT", "SHARD"], shards, "none placed")
    tail = r.get("tail") or []
    if tail:
        parts += [Text(""), text("Last output", "bold"), *(text(f"  │ {line}", show_removed=True) for line in tail)]
    parts += _section(f"Events (last {RECENT_EVENTS}, 24 h)", ["TIME", "KIND", "EVENT"],
                      _event_rows([e for e in _events(client, model=r["model"]) if r["id"] in e["message"]]), "none")
    console().print(Group(*parts))


def model(client: ApiClient, name: str, output: str) -> None:
    found = [m for m in client.get("/api/v1/models") if m["name"] == name]
    if not found:
        raise LlmgwError(f"no model {name!r} in the catalog (`llmgw ctl models` lists them)")
    m = found[0]
    if output == "name":
        print_names("model", [m["name"]])
        return
    if print_data(m, output):
        return
    from llmgw.cli.rollout import rollout_cell

    parts: list[Any] = [_fields([
        ("Model", m["name"]),
        ("Replicas", f"{m['ready']} ready of {m['replicas']}"),
        ("Profiles", ", ".join(m.get("profiles") or [])),
        ("Balancer", m.get("balancer")),
        ("Source", m.get("source")),
        ("Rollout", rollout_cell(m.get("rollout"))),
    ])]
    replicas = [(r["id"], r.get("profile") or "-", styled_state(r["state"]),
                 ",".join(sorted({s["node"] for s in r.get("shards") or []})) or "-", r.get("endpoint") or "-",
                 format_duration(r.get("age", 0)), r.get("reason") or "")
                for r in client.get("/api/v1/replicas") if r["model"] == name]
    parts += _section("Replicas", ["REPLICA", "PROFILE", "STATE", "NODE", "ENDPOINT", "AGE", "REASON"], replicas,
                      "none")
    parts += _section(f"Events (last {RECENT_EVENTS}, 24 h)", ["TIME", "KIND", "EVENT"],
                      _event_rows(_events(client, model=name)), "none")
    console().print(Group(*parts))


def _versions(inv: dict[str, Any]) -> str:
    """What doctor's driver-versions check compares: `driver 550.54.15, CUDA 12.4, MLNX_OFED 24.10-1.1.4`."""
    said = (("driver ", inv.get("gpu_driver")), ("CUDA ", inv.get("cuda_driver")), ("", inv.get("rdma_stack")))
    return ", ".join(f"{label}{value}" for label, value in said if value)


def _maybe(value: object) -> str:
    return "-" if value is None else str(value)
