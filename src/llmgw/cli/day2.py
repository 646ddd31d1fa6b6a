"""`llmgw ctl events` and `llmgw ctl logs`: what happened, and what an engine says, from one terminal."""

from __future__ import annotations

import json
import sys
import time
from typing import Any
from urllib.parse import urlencode

import click

from llmgw.cli import complete
from llmgw.cli.render import console, make_table, output_option, say, text

WATCH_INTERVAL = 1.0  # seconds between two looks for new events with --watch


def _api(ctx: click.Context) -> Any:
    return ctx.obj["api"]()


def event_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _event_rows(events: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [(event_time(e["time"]), e["kind"], ",".join(e.get("nodes") or []) or e.get("node") or "-",
             e.get("model") or "-", e["message"]) for e in events]


def _print_details(events: list[dict[str, Any]]) -> None:
    out = console()
    for e in events:
        for line in e.get("detail") or []:
            out.print(text(f"    │ {line}", show_removed=True), soft_wrap=True)


def _check_since(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Bad usage is exit 2 here, before the server's 400 (exit 1) would say the same."""
    from llmgw.catalog.units import parse_since

    if value.strip():
        try:
            parse_since(value.strip(), time.time())
        except ValueError as exc:
            raise click.BadParameter(str(exc).removeprefix(f"since={value.strip()!r}: ")) from None
    return value


@click.command()
@output_option
@click.option("--since", default="", callback=_check_since,
              help="How far back: a duration (30m, 2h, 7d) or seconds since the epoch. Default: all kept.")
@click.option("--node", default="", shell_complete=complete.NODES, help="Only events about this node.")
@click.option("--model", default="", shell_complete=complete.MODELS, help="Only events about this model.")
@click.option("-w", "--watch", is_flag=True,
              help="Keep printing new events until Ctrl-C (-o json: one object per line).")
@click.pass_context
def events(ctx: click.Context, output: str, since: str, node: str, model: str, watch: bool) -> None:
    """What happened: node state changes, placements, replica transitions (with the engine's
    last lines on a failure), breakers, refused certificates, reloads, drains.

    \b
    llmgw ctl events --since 12h --node gpu-02
    llmgw ctl events --watch --model llama-3.1-8b-instruct
    """
    client = _api(ctx)
    params = {k: v for k, v in (("since", since), ("node", node), ("model", model)) if v}
    data = client.get("/api/v1/events" + (f"?{urlencode(params)}" if params else ""))
    if output == "json" and not watch:
        from llmgw.cli.render import print_json

        print_json(data)
        return
    _show(data, output, header=True)
    if not watch:
        if not data:
            say("no events" + (" match" if params else " yet"))
        return
    last = data[-1]["id"] if data else 0
    params.pop("since", None)
    try:
        while True:
            time.sleep(WATCH_INTERVAL)  # ok: polling the server for what is new
            new = client.get("/api/v1/events?" + urlencode({**params, "after": last}))
            if new:
                last = new[-1]["id"]
                _show(new, output, header=False)
    except KeyboardInterrupt:
        pass


def _show(data: list[dict[str, Any]], output: str, *, header: bool) -> None:
    if output == "json":
        for e in data:
            sys.stdout.write(json.dumps(e) + "\n")
        sys.stdout.flush()
        return
    if not data:
        return
    table = make_table(["TIME", "KIND", "NODE", "MODEL", "EVENT"], _event_rows(data))
    table.show_header = header
    console().print(table)
    _print_details(data)


@click.command()
@click.argument("name", metavar="MODEL|REPLICA", shell_complete=complete.LOG_TARGETS)
@click.option("--replica", "replica_id", default="", metavar="ID", shell_complete=complete.REPLICAS,
              help="With MODEL: this one of its replicas (default: the first ready).")
@click.option("--rank", "--shard", "shard", type=int, default=None, shell_complete=complete.RANKS,
              help="Only the shard of this rank (a replica on several nodes).")
@click.option("--tail", type=click.IntRange(0, 10_000), default=200, show_default=True,
              help="Lines from the end of the log to start with.")
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing new lines until Ctrl-C; with MODEL, across moves (drain, rollout, restart).")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: the lines as the engine wrote them; json: one object a line ({\"line\", \"rank\"} or "
              "{\"note\"}), notes included, for scripts.")
@click.pass_context
def logs(ctx: click.Context, name: str, replica_id: str, shard: int | None, tail: int, follow: bool,
         output: str) -> None:
    """An engine's log, read on its node and sent over the fleet stream (no SSH).

    MODEL picks one of its replicas: the first ready, or --replica ID; which one is said on
    stderr. With -f a model is followed as `kubectl logs -f deploy/X` follows a deployment:
    when a drain, a rollout or a restart retires the replica, its last lines are read, then
    its successor's log follows (said on stderr). A REPLICA id is that replica alone.

    A replica with several shards prefixes each line with its rank unless --rank is given.
    Adopted engines (running since before the agent restarted) are read the same way.
    Needs a viewer or operator credential when the server has any.

    \b
    llmgw ctl logs -f llama-3.1-8b-instruct
    llmgw ctl logs big --rank 1 --tail 50
    """
    from llmgw.api_client import segment
    from llmgw.safetext import terminal_text

    params: dict[str, Any] = {"tail": tail}
    if replica_id:
        params["replica"] = replica_id
    if shard is not None:
        params["shard"] = shard
    if follow:
        params["follow"] = 1
    out = sys.stdout
    try:
        for raw in _api(ctx).stream_lines(f"/api/v1/logs/{segment(name)}?{urlencode(params)}"):
            if not raw.strip():
                continue
            try:
                item = json.loads(raw)
            except ValueError:
                item = {"line": raw}
            if not isinstance(item, dict):
                continue
            if output == "json":  # as the server sent it: JSON escapes what a terminal must not see
                out.write(json.dumps(item) + "\n")
                out.flush()
                continue
            if "note" in item:
                say(f"-- llmgw: {terminal_text(str(item['note']))}", stderr=True)
                continue
            front = f"[rank {item['rank']}] " if "rank" in item else ""
            # An engine's own output: what was removed is shown (␛[2J), not silently dropped.
            out.write(front + terminal_text(str(item.get("line", "")), show_removed=True) + "\n")
            out.flush()  # a blocked terminal blocks here; the server and the node wait with it
    except KeyboardInterrupt:
        pass
