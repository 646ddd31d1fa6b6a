"""`llmgw ctl`: the operator's client of the public JSON API, plus local `cert`."""

from __future__ import annotations

import click

from llmgw.api_client import DEFAULT_SERVER, ApiClient
from llmgw.catalog.units import format_duration
from llmgw.cli.cert import cert
from llmgw.cli.render import console, make_table, output_option, print_json, styled_state


@click.group()
@click.option("--server", envvar="LLMGW_SERVER", default=DEFAULT_SERVER, show_default=True,
              help="Public URL of the llmgw server. [env: LLMGW_SERVER]")
@click.option("--token", envvar="LLMGW_TOKEN", help="Operator bearer token. [env: LLMGW_TOKEN]")
@click.option("--cert", "cert_file", envvar="LLMGW_CERT", type=click.Path(dir_okay=False),
              help="Operator client certificate. [env: LLMGW_CERT]")
@click.option("--key", "key_file", envvar="LLMGW_KEY", type=click.Path(dir_okay=False),
              help="Key of the operator certificate. [env: LLMGW_KEY]")
@click.option("--ca", "ca_file", envvar="LLMGW_CA", type=click.Path(dir_okay=False),
              help="CA that signed the server's certificate. [env: LLMGW_CA]")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds to wait for the server.")
@click.pass_context
def ctl(ctx: click.Context, server: str, token: str | None, cert_file: str | None, key_file: str | None,
        ca_file: str | None, timeout: float) -> None:
    """Operator client: nodes, replicas, cert.

    Exit codes: 0 ok, 1 failed, 2 bad usage, 3 server unreachable.
    """
    ctx.ensure_object(dict)
    ctx.obj["api"] = lambda: ApiClient(server, token=token, cert=cert_file, key=key_file, ca=ca_file, timeout=timeout)


def api(ctx: click.Context) -> ApiClient:
    return ctx.obj["api"]()


@ctl.command()
@output_option
@click.pass_context
def nodes(ctx: click.Context, output: str) -> None:
    """Nodes in the fleet: state, last heartbeat, GPUs, fabrics, agent version."""
    data = api(ctx).get("/api/v1/nodes")
    if output == "json":
        print_json(data)
        return
    rows = []
    for n in data:
        age = n.get("last_heartbeat_age")
        gpus = f"{n['gpus']}× {n['gpu_name']}" if n.get("gpus") and n.get("gpu_name") else str(n.get("gpus", 0))
        rows.append((
            n["id"],
            styled_state(n["state"]),
            "-" if age is None else format_duration(age) + " ago",
            gpus,
            ",".join(n.get("fabrics") or []) or (f"{n.get('ports_active', 0)}/{n.get('ports', 0)} ports up" if n.get("ports") else "-"),
            n.get("version", ""),
            n.get("reason", ""),
        ))
    out = console()
    if not rows:
        out.print("no nodes have registered yet")
        return
    out.print(make_table(["NODE", "STATE", "HEARTBEAT", "GPUS", "FABRICS", "AGENT", "REASON"], rows))


ctl.add_command(cert)
