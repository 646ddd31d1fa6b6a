"""`llmgw ctl`: the operator's client of the public JSON API, plus local `cert`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from llmgw.catalog.units import format_duration
from llmgw.cli import complete
from llmgw.cli.cert import cert
from llmgw.cli.context import api
from llmgw.cli.day2 import events, logs
from llmgw.cli.doctor import doctor
from llmgw.cli.drain import cordon, drain, restart, uncordon
from llmgw.cli.fabric_test import fabric_test
from llmgw.cli.fabrics import fabrics
from llmgw.cli.progress import LinesUnder, progress_line
from llmgw.cli.render import (
    console,
    list_output_option,
    make_table,
    output_option,
    print_data,
    print_json,
    print_names,
    say,
    styled_state,
    text,
)
from llmgw.cli.rollout import rollout, rollout_cell
from llmgw.cli.watching import watch_options

if TYPE_CHECKING:
    from rich.console import Group, RenderableType

    from llmgw.api_client import ApiClient

DEFAULT_SERVER = "http://127.0.0.1:8080"  # also llmgw.api_client.DEFAULT_SERVER


@click.group()
@click.option("--server", envvar="LLMGW_SERVER", default=DEFAULT_SERVER, show_default=True,
              help="URL of the llmgw server's API: its admin listener when it has one (admin_listen), "
                   "else its public port. [env: LLMGW_SERVER]")
@click.option("--token", envvar="LLMGW_TOKEN", help="Operator or viewer bearer token. [env: LLMGW_TOKEN]")
@click.option("--cert", "cert_file", envvar="LLMGW_CERT", type=click.Path(dir_okay=False),
              help="Operator or viewer client certificate. [env: LLMGW_CERT]")
@click.option("--key", "key_file", envvar="LLMGW_KEY", type=click.Path(dir_okay=False),
              help="Key of the client certificate. [env: LLMGW_KEY]")
@click.option("--ca", "ca_file", envvar="LLMGW_CA", type=click.Path(dir_okay=False),
              help="CA that signed the server's certificate. [env: LLMGW_CA]")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait for the server.")
@click.option("--insecure", is_flag=True,
              help="Send --token or --cert over plain http:// to a server that is not on loopback (warns).")
@click.pass_context
def ctl(ctx: click.Context, server: str, token: str | None, cert_file: str | None, key_file: str | None,
        ca_file: str | None, timeout: float, insecure: bool) -> None:
    """Operator client of the server's API (reads, changes, tests), and the cluster's CA.

    \b
    look    nodes, replicas, models, endpoints, gateways, fabrics, events,
            logs, rollout status, doctor
    change  cordon, uncordon, drain, restart, forget, reload (operator)
    test    fabric-test A B (operator)
    local   cert (the CA's files, no server needed), hash-secret

    \b
    With the bash, zsh or fish completion scripts, TAB completes the names
    the server knows (nodes, replicas and ranks, models, fabrics, gateways)
    and cert names from the CA directory.

    \b
    Exit codes: 0 ok, 1 failed, 2 bad usage, 3 server unreachable.
    doctor and fabric-test are Nagios plugins: 0 ok, 1 warn, 2 crit,
    3 could not run.
    """
    ctx.ensure_object(dict)
    def make_client() -> ApiClient:
        from llmgw.api_client import (
            ApiClient,  # httpx: imported only when a command calls the server
        )

        return ApiClient(server, token=token, cert=cert_file, key=key_file, ca=ca_file, timeout=timeout,
                         insecure=insecure, warn=lambda line: click.echo(f"llmgw: warning: {line}", err=True))

    ctx.obj["api"] = make_client


def _node_note(n: dict) -> str:
    """What an operator should know about a node: why it is not ready, a certificate about to
    expire, why it has no GPUs."""
    notes = [n["reason"]] if n.get("reason") else []
    days = n.get("cert_days_left")
    if days is not None and days < 30:
        notes.append(f"certificate expired {-days:.0f} days ago" if days < 0
                     else f"certificate expires in {days:.0f} days")
    if not n.get("gpus") and n.get("gpu_note"):
        notes.append(n["gpu_note"])
    for fabric in n.get("fabric_status") or []:
        if not fabric.get("usable"):
            notes.append(f"fabric {fabric.get('name')} not usable: "
                         f"{'; '.join(fabric.get('problems') or []) or 'no usable adapter'}")
    down = [f"{p.get('port')} {p.get('state')}" + (f" ({p['phys_state']})" if p.get("phys_state") else "")
            for p in n.get("port_states") or [] if str(p.get("state", "")).upper() != "ACTIVE"]
    if down:
        notes.append("ports not ACTIVE: " + ", ".join(down))
    out = n.get("unplaceable") or {}
    if out:
        notes.append("not placeable: " + ", ".join(why for _, why in sorted(out.items(), key=lambda kv: int(kv[0]))))
    return "; ".join(notes)


def _fabrics(n: dict) -> str:
    """The usable fabrics with their rate (the slowest active link): `ib 400G`."""
    rates = {f.get("name"): f.get("rate_gbps") for f in n.get("fabric_status") or []}
    return ",".join(f"{name} {rates[name]:g}G" if rates.get(name) else str(name)
                    for name in n.get("fabrics") or []) or "-"


@ctl.command()
@click.argument("node_id", required=False, metavar="[NODE]", shell_complete=complete.NODES)
@list_output_option
@watch_options
@click.pass_context
def nodes(ctx: click.Context, node_id: str | None, output: str, watch: bool, interval: float) -> None:
    """Nodes in the fleet: state, last heartbeat, GPUs, fabrics, agent version. With NODE, that
    node alone: its fields, GPUs (latest readings), ports, fabrics, replicas and recent events."""
    if node_id is not None:
        from llmgw.cli import describe

        describe.node(api(ctx), node_id, output)
        return
    _listing(ctx, "/api/v1/nodes", "node", "id", output, watch, interval, _nodes_table,
             volatile=("last_heartbeat_age", "heartbeats", "cert_days_left"))


def _listing(ctx: click.Context, path: str, kind: str, key: str, output: str, watch: bool, interval: float,
             table: Callable[[list[dict], str], RenderableType], volatile: tuple[str, ...] = ()) -> None:
    """A listing's outputs: table, wide, json, yaml, name, and --watch of the table or the json."""
    from llmgw.cli.watching import refuse_output, watch_json, watch_table

    refuse_output(watch, output)
    client = api(ctx)

    def fetch() -> list[dict]:
        got: list[dict] = client.get(path)
        return got

    if watch and output == "json":
        watch_json(fetch, interval, key, volatile)
    elif watch:
        watch_table(lambda: table(fetch(), output), interval)
    else:
        data = fetch()
        if output == "name":
            print_names(kind, [str(d[key]) for d in data])
        elif not print_data(data, output):
            _show(table(data, output), output)


def _nodes_table(data: list[dict], output: str) -> RenderableType:
    wide = output == "wide"
    rows = []
    for n in data:
        age = n.get("last_heartbeat_age")
        gpus = f"{n['gpus']}× {n['gpu_name']}" if n.get("gpus") and n.get("gpu_name") else str(n.get("gpus", 0))
        extra = ((n.get("address") or "-", n.get("identity") or "-", ",".join(n.get("features") or []) or "-")
                 if wide else ())
        rows.append((
            n["id"],
            styled_state(n["state"] + (f",{n['mark']}" if n.get("mark") else "")),
            "-" if age is None else format_duration(age) + " ago",
            gpus,
            _fabrics(n),
            f"{n.get('ports_active', 0)}/{n.get('ports', 0)} up" if n.get("ports") else "-",
            n.get("version", ""),
            *extra,
            _node_note(n),
        ))
    if not rows:
        return text("no nodes have registered yet")
    columns = ["NODE", "STATE", "HEARTBEAT", "GPUS", "FABRICS", "PORTS", "AGENT",
               *(["ADDRESS", "IDENTITY", "FEATURES"] if wide else []), "NOTE"]
    return make_table(columns, rows, cut=_cut())


def _cut() -> bool:
    """At a terminal a listing is drawn at its own width, a row a line: cut at the terminal's
    edge (table), or whole and left to the terminal to wrap (-o wide). A pipe or a file gets
    every cell whole."""
    return console().is_terminal


def _show(listing: RenderableType, output: str) -> None:
    console().print(listing, crop=output != "wide")


def _replica_rows(data: list[dict], wide: bool = False) -> list[tuple]:
    rows = []
    for r in data:
        shards = r.get("shards") or []
        nodes = ",".join(sorted({s["node"] for s in shards})) or "-"
        gpus = ";".join(",".join(str(g) for g in s["gpus"]) for s in shards) or "-"
        reason = r.get("reason", "")
        if r.get("retry_in") is not None:
            reason = f"{reason} (retry in {format_duration(r['retry_in'])})"
        move = r.get("move")
        if move:
            what = (f"moving ({move['kind']}, {move['state']})" + (f" → {move['other']}" if move["other"] else "")
                    if move["role"] == "old" else f"successor of {move['other']} ({move['kind']}, {move['state']})")
            reason = f"{what}: {move['note']}" + (f"; {reason}" if reason else "")
        extra = (";".join(f"{s['rank']}:{s['state']}" for s in shards) or "-", str(r.get("attempt", 0))) if wide else ()
        rows.append((
            r["id"], r["model"], r.get("profile") or "-", styled_state(r["state"]), nodes, gpus,
            r.get("endpoint") or "-", format_duration(r.get("age", 0)), *extra, reason,
        ))
    return rows


def _replicas_view(data: list[dict], tail: int, output: str = "table") -> Group:
    from rich.console import Group
    from rich.text import Text

    parts: list = []
    if not data:
        parts.append(text("no replicas (is a model with replicas > 0 in the catalog?)"))
    else:
        # A download is a line under its replica, not a column (most replicas download nothing):
        # an empty row holds its place in the table, and the line takes it when drawn.
        rows: list[tuple] = []
        lines: list[str] = []
        wide = output == "wide"
        for r, row in zip(data, _replica_rows(data, wide), strict=True):
            rows.append(row)
            if r.get("progress"):
                rows.append(("",) * len(row))
                lines.append("  " + progress_line(r["progress"]))
        columns = ["REPLICA", "MODEL", "PROFILE", "STATE", "NODE", "GPUS", "ENDPOINT", "AGE",
                   *(["RANKS", "ATTEMPT"] if wide else []), "REASON"]
        table = make_table(columns, rows, cut=_cut())
        parts.append(LinesUnder(table, lines) if lines else table)
    for r in data:
        lines = (r.get("tail") or [])[-tail:] if tail else []
        if lines and r["state"] in ("failed", "pending"):
            parts.append(Text(""))
            parts.append(text(f"{r['id']} — last output:", "bold"))
            for line in lines:
                # An engine's own output: what was removed is shown (␛[2J), not silently dropped.
                parts.append(text(f"  │ {line}", show_removed=True))
    return Group(*parts)


@ctl.command()
@click.argument("replica_id", required=False, metavar="[REPLICA]", shell_complete=complete.REPLICAS)
@list_output_option
@click.option("--model", "model_filter", shell_complete=complete.MODELS, help="Only replicas of this model.")
@watch_options
@click.option("--tail", type=int, default=5, show_default=True, help="Output lines shown for failed replicas.")
@click.pass_context
def replicas(ctx: click.Context, replica_id: str | None, output: str, model_filter: str | None, watch: bool,
             interval: float, tail: int) -> None:
    """Replicas: model, profile, state, node, GPUs, endpoint, age, and why when pending or failed.
    With REPLICA, that replica alone: its fields, shards, last output and recent events."""
    from llmgw.cli.watching import refuse_output, watch_json, watch_table

    client = api(ctx)
    if replica_id is not None:
        from llmgw.cli import describe

        describe.replica(client, replica_id, output)
        return

    def fetch() -> list[dict]:
        data = client.get("/api/v1/replicas")
        return [r for r in data if model_filter is None or r["model"] == model_filter]

    refuse_output(watch, output)
    if watch and output == "json":
        watch_json(fetch, interval, "id", ("age",))
    elif watch:
        watch_table(lambda: _replicas_view(fetch(), tail, output), interval)
    else:
        data = fetch()
        if output == "name":
            print_names("replica", [r["id"] for r in data])
        elif not print_data(data, output):
            _show(_replicas_view(data, tail, output), output)


@ctl.command()
@click.argument("name", required=False, metavar="[MODEL]", shell_complete=complete.MODELS)
@list_output_option
@watch_options
@click.pass_context
def models(ctx: click.Context, name: str | None, output: str, watch: bool, interval: float) -> None:
    """Models in the catalog: desired and ready replicas, profiles. With MODEL, that model alone:
    its fields, replicas and recent events."""
    if name is not None:
        from llmgw.cli import describe

        describe.model(api(ctx), name, output)
        return
    _listing(ctx, "/api/v1/models", "model", "name", output, watch, interval, _models_table)


def _models_table(data: list[dict], output: str) -> RenderableType:
    rows = [(d["name"], f"{d['ready']}/{d['replicas']}", ",".join(d["profiles"]) or "-", d["balancer"], d["source"],
             rollout_cell(d.get("rollout"))) for d in data]
    if not rows:
        return text("no models in the catalog")
    return make_table(["MODEL", "READY", "PROFILES", "BALANCER", "SOURCE", "ROLLOUT"], rows, cut=_cut())


@ctl.command()
@list_output_option
@watch_options
@click.pass_context
def endpoints(ctx: click.Context, output: str, watch: bool, interval: float) -> None:
    """Gateway endpoints: in-flight requests, circuit breaker, engine load and violations."""
    _listing(ctx, "/api/v1/endpoints", "endpoint", "endpoint", output, watch, interval, _endpoints_table,
             volatile=("outstanding", "load"))


def _endpoints_table(data: list[dict], output: str) -> RenderableType:
    rows = []
    for e in data:
        load = e.get("load") or {}
        kv = load.get("kv_cache_usage")
        rows.append((
            e["model"], e["endpoint"], str(e["outstanding"]),
            styled_state(e["breaker"]) if e["breaker"] != "closed" else "closed",
            ("up" if e["engine_up"] else "down") if e.get("healthy", True) else "unhealthy",
            f"{load.get('running', '-')}/{load.get('waiting', '-')}", "-" if kv is None else f"{kv:.0%}",
            e.get("health_reason") or ", ".join(e.get("violations") or []) or e.get("breaker_reason", ""),
        ))
    if not rows:
        return text("no endpoints in rotation")
    return make_table(["MODEL", "ENDPOINT", "IN FLIGHT", "BREAKER", "ENGINE", "RUN/WAIT", "KV", "NOTE"], rows,
                      cut=_cut())


@ctl.command()
@list_output_option
@watch_options
@click.pass_context
def gateways(ctx: click.Context, output: str, watch: bool, interval: float) -> None:
    """Gateway workers (gateway.workers) and gateways on other machines that follow the server:
    who, where, since when, when each last reported, how many requests it served, and whether it
    runs the config the server publishes now (CONFIG: current, updating just after a reload,
    behind when it still is not 5 s later; - before its first report)."""
    _listing(ctx, "/api/v1/gateways", "gateway", "name", output, watch, interval, _gateways_table,
             volatile=("last_report", "requests"))


def _gateways_table(data: list[dict], output: str) -> RenderableType:
    if not data:
        return text("no gateway follows this server (gateway.workers: 1 serves the public port itself)")
    now = time.time()
    rows = [(g["name"], g["kind"], g["peer"], str(g["pid"] or "-"), g["version"] or "-",
             f"{format_duration(now - g['since'])} ago",
             f"{format_duration(now - g['last_report'])} ago" if g.get("last_report") else "not yet",
             "-" if g.get("requests") is None else str(g["requests"]), g.get("config") or "-") for g in data]
    return make_table(["NAME", "KIND", "PEER", "PID", "VERSION", "CONNECTED", "LAST REPORT", "REQUESTS", "CONFIG"],
                      rows, cut=_cut())


@ctl.command()
@output_option
@click.pass_context
def reload(ctx: click.Context, output: str) -> None:
    """Make the server re-read its config file (catalog, endpoints, gateway settings),
    its deny list and the certificate files public_tls names (also on its gateway workers).

    Needs an operator credential (--token or an operator certificate).
    """
    result = api(ctx).request("POST", "/api/v1/reload")
    if output == "json":
        print_json(result)
        return
    say(result.get("message", "reloaded"))


@ctl.command()
@click.argument("node_id", shell_complete=complete.NODES)
@output_option
@click.pass_context
def forget(ctx: click.Context, node_id: str, output: str) -> None:
    """Forget a node that is gone for good (it must be disconnected)."""
    from llmgw.api_client import segment

    result = api(ctx).request("DELETE", f"/api/v1/nodes/{segment(node_id)}")
    if output == "json":
        print_json(result if isinstance(result, dict) and result else {"forgot": node_id})
        return
    say(f"forgot node {node_id}")


@ctl.command("hash-secret")
@click.option("--secret", help="The secret (default: read one line from stdin, so it stays out of shell history).")
@output_option
def hash_secret(secret: str | None, output: str) -> None:
    """Print the sha256:<hex> form of an API key or operator token, for the server config.

    \b
    printf %s "$KEY" | llmgw ctl hash-secret     # → gateway.api_keys / api.operator_tokens
    """
    import hashlib
    import sys

    value = secret if secret is not None else sys.stdin.readline().rstrip("\r\n")
    if not value:
        raise click.UsageError("empty secret: pass --secret or one line on stdin")
    digest = "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    if output == "json":
        print_json({"digest": digest})
        return
    click.echo(digest)


ctl.add_command(cert)
ctl.add_command(fabrics)
ctl.add_command(fabric_test)
ctl.add_command(events)
ctl.add_command(logs)
ctl.add_command(cordon)
ctl.add_command(uncordon)
ctl.add_command(drain)
ctl.add_command(restart)
ctl.add_command(doctor)
ctl.add_command(rollout)
