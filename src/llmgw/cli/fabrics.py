"""`llmgw ctl fabrics`: the fabric map — subnet managers, problems, degraded cables, rail violations.

Against the server: `ctl fabrics` lists the fabrics it knows (GET /api/v1/fabrics), `ctl fabrics
FABRIC` shows one (GET /api/v1/fabrics/{id} and its /topology) with the same tables as `--file`.

With `--file` it analyses a saved `ibnetdiscover` (or `ibnetdiscover -p`) dump offline, with no
server, so an SRE can check a dump from any cluster; `--sm` adds a saved `saquery SMIR` or
`sminfo` output. Parsing and analysis are the server's own (llmgw.fabric), so the offline answer
and the server's agree.
"""

from __future__ import annotations

import os
from typing import Any

import click
import msgspec

from llmgw.cli import complete
from llmgw.cli.context import api
from llmgw.cli.render import console, make_table, output_option, print_json, say
from llmgw.errors import UsageError

MAX_FILE = 256 * 1024 * 1024  # the largest real dump is 1 MB; a 4,000-node fabric is 12 MB


def read_text(path: str, what: str) -> str:
    """A saved tool output as text: one clear line when it cannot be read, bytes that are not
    UTF-8 replaced (a dump copied through a Windows share is still worth reading)."""
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE:
            raise UsageError(f"{what} {path}: {size:,} bytes is more than any fabric dump ({MAX_FILE:,})")
        with open(path, "rb") as fh:
            data = fh.read()
    except IsADirectoryError:
        raise UsageError(f"{what} {path} is a directory, not a saved tool output") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if b"\0" in data[:4096]:
        raise UsageError(f"{what} {path} is a binary file, not text a tool printed")
    return data.decode("utf-8", errors="replace")


def offline(path: str, sm_path: str | None) -> dict[str, Any]:
    """The JSON document `--file` prints: the FabricMap's fields plus where it came from."""
    from llmgw.fabric.analysis import analyse
    from llmgw.fabric.ibnetdiscover import parse_topology
    from llmgw.fabric.subnet import PortView, group_fabrics, parse_sm_text

    text = read_text(path, "--file")
    topo = parse_topology(text)
    if not topo.nodes:
        first = f"; line {topo.problems[0].line}: {topo.problems[0].text}" if topo.problems else ""
        raise UsageError(f"--file {path}: no ibnetdiscover topology in it "
                         f"({len(topo.problems)} unreadable lines{first})")
    fabric_map = analyse(topo)
    doc: dict[str, Any] = {"source": path}
    doc.update(msgspec.to_builtins(fabric_map))
    if sm_path is not None:
        parsed = parse_sm_text(read_text(sm_path, "--sm"))
        if not parsed.records:
            raise UsageError(f"--sm {sm_path}: no `saquery SMIR` record or `sminfo` line in it")
        report = group_fabrics([PortView(node="file", port=os.path.basename(sm_path), records=tuple(parsed.records))])
        doc["subnet_managers"] = msgspec.to_builtins(report.fabrics)
        for fabric in report.fabrics:
            doc["problems"].extend({"kind": p.kind.value, "message": f"fabric {fabric.id}: {p.message}"}
                                   for p in fabric.problems)
        doc["problems"].extend({"kind": "unreadable_line", "line": p.line,
                                "message": f"--sm line {p.line}: {p.reason}: {p.text}"} for p in parsed.problems)
    return doc


EMPTY_SUMMARY = {"switches": 0, "tiers": {}, "adapters": 0, "aggregation_nodes": 0, "links": 0, "degraded_links": 0,
                 "rail_optimised": False}


def server_doc(detail: dict[str, Any], topology: dict[str, Any] | None) -> dict[str, Any]:
    """One fabric as the server knows it, in the shape `render` and `--file -o json` share."""
    doc: dict[str, Any] = {"id": detail["id"], "format": "server", "summary": EMPTY_SUMMARY, "switches": [],
                           "adapters": [], "links": [], "rails": [], "rail_violations": []}
    if topology is not None:
        doc.update(topology)
    doc["problems"] = detail.get("problems") or []
    doc["subnet_managers"] = [{"id": detail["id"], "master": detail.get("master"),
                               "subnet_managers": detail.get("subnet_manager_list") or []}]
    doc["master_changes"] = detail.get("master_changes") or []
    return doc


def render_list(fabrics: list[dict[str, Any]]) -> None:
    if not fabrics:
        say("no fabrics known yet (agents with the discover feature find them; see `ctl nodes`)")
        return
    rows = []
    for f in fabrics:
        topo = f.get("topology") or {}
        master = f.get("master") or {}
        rows.append((f["id"], master.get("guid", "-"), master.get("priority", "-"), len(f.get("standbys") or []),
                     topo.get("switches", "-"), topo.get("adapters", "-"), topo.get("degraded_links", "-"),
                     "; ".join(p["message"] for p in f.get("problems") or []) or "-"))
    console().print(make_table(["FABRIC", "MASTER SM", "PRIORITY", "STANDBYS", "SWITCHES", "ADAPTERS", "DEGRADED",
                                "PROBLEMS"], rows))


def render_changes(changes: list[dict[str, Any]]) -> None:
    if not changes:
        return
    import time

    rows = [(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c["at"])), c["old"] or "-", c["new"], c["reported_by"])
            for c in changes]
    console().print(make_table(["WHEN", "OLD MASTER", "NEW MASTER", "REPORTED BY"], rows,
                               title="master changes (last day)"))


def render(doc: dict[str, Any]) -> None:
    out = console()
    rows: list[tuple[Any, ...]]
    summary = doc["summary"]
    tiers = ", ".join(f"{count} {tier}" for tier, count in summary["tiers"].items())
    say(f"{doc.get('source') or doc.get('id', '')}: {doc['format']}, {summary['switches']} switches ({tiers}), "
        f"{summary['adapters']} adapters, {summary['aggregation_nodes']} aggregation nodes, {summary['links']} links, "
        f"{summary['degraded_links']} degraded, rail-optimised: {'yes' if summary['rail_optimised'] else 'no'}")
    for fabric in doc.get("subnet_managers") or []:
        master = (fabric.get("master") or {}).get("guid", "")
        rows = [(sm["guid"], sm["lid"], sm["priority"], sm["state"] + (" ★" if sm["guid"] == master else ""),
                 sm["act_count"]) for sm in fabric["subnet_managers"]]
        out.print(make_table(["GUID", "LID", "PRIORITY", "STATE", "ACTIVITY"], rows,
                             title=f"subnet managers of fabric {fabric['id']}"))
    other = [p for p in doc["problems"] if p["kind"] not in ("degraded_link", "rail_violation")]
    if other:
        out.print(make_table(["KIND", "PROBLEM"], [(p["kind"], p["message"]) for p in other], title="problems"))
    degraded = [link for link in doc["links"] if link["degraded"]]
    if degraded:
        rows = [(f"{link['a']['name']} [{link['a']['port']}]", f"{link['b']['name']} [{link['b']['port']}]",
                 f"{link['width']}{link['speed']}", link.get("reason", "")) for link in degraded]
        out.print(make_table(["END A", "END B", "RATE", "WHY"], rows, title="degraded cables"))
    if doc["rail_violations"]:
        rows = [(v["node"], v["adapter"], f"{v['leaf_description']} ({v['leaf']})",
                 f"{v['rail_leaf_description']} ({v['rail_leaf']})" if v["rail_leaf"] else "-")
                for v in doc["rail_violations"]]
        out.print(make_table(["NODE", "ADAPTER", "REACHES", "RAIL'S LEAF"], rows, title="rail violations"))
    if doc["rails"] and len(doc["rails"]) <= 64:
        names = {sw["guid"]: sw["description"] for sw in doc["switches"]}
        rows = [(r["group"], r["rail"], ", ".join(f"{names.get(g, '')} ({g})" for g in r["leaves"]), r["adapters"])
                for r in doc["rails"]]
        out.print(make_table(["GROUP", "RAIL", "LEAVES", "ADAPTERS"], rows, title="rails"))
    elif doc["rails"]:
        groups = len({r["group"] for r in doc["rails"]})
        say(f"{len(doc['rails'])} rails in {groups} groups (-o json lists them)")
    if doc.get("rails_apart"):
        # Not judged for rails: their adapters are counted or named unlike most nodes' (a UFM
        # host's HCA-1, a box of another shape), so a rail violation there would mean nothing.
        say(f"not judged for rails (adapters counted or named unlike most nodes'): {', '.join(doc['rails_apart'])}")
    if not other and not degraded and not doc["rail_violations"]:
        say("no problems found")


@click.command()
@click.argument("fabric", required=False, shell_complete=complete.FABRICS)
@click.option("--file", "topology_file", type=click.Path(dir_okay=True),
              help="Analyse a saved `ibnetdiscover` (or `ibnetdiscover -p`) output offline, with no server.")
@click.option("--sm", "sm_file", type=click.Path(dir_okay=True),
              help="With --file: a saved `saquery SMIR` or `sminfo` output, for the subnet managers.")
@output_option
@click.pass_context
def fabrics(ctx: click.Context, fabric: str | None, topology_file: str | None, sm_file: str | None,
            output: str) -> None:
    """Fabrics: subnet managers, problems, degraded cables, rail violations.

    \b
    llmgw ctl fabrics                                 # the fabrics the server knows
    llmgw ctl fabrics 0x0c42a166615984d5              # one of them, with its tables
    llmgw ctl fabrics --file topology.txt             # a saved ibnetdiscover dump, no server
    llmgw ctl fabrics --file topology.txt -o json     # switches, adapters, links, rails, problems
    """
    if topology_file is None:
        if sm_file is not None:
            raise click.UsageError("--sm goes with --file")
        client = api(ctx)
        if fabric is None:
            listed = client.get("/api/v1/fabrics")
            if output == "json":
                print_json(listed)
            else:
                render_list(listed)
            return
        from urllib.parse import quote

        detail = client.get(f"/api/v1/fabrics/{quote(fabric, safe='')}")
        doc = server_doc(detail, client.get(f"/api/v1/fabrics/{quote(fabric, safe='')}/topology")
                         if detail.get("topology") else None)
        if output == "json":
            print_json(doc)
        else:
            render(doc)
            render_changes(detail.get("master_changes") or [])
        return
    if fabric is not None:
        raise click.UsageError("FABRIC names a fabric the server knows; with --file there is only the file's")
    doc = offline(topology_file, sm_file)
    if output == "json":
        print_json(doc)
        return
    render(doc)
