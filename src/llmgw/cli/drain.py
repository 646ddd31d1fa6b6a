"""`llmgw ctl cordon`, `uncordon`, `drain` and `restart`: a node out for maintenance, a replica
replaced, traffic flowing throughout."""

from __future__ import annotations

import time
from typing import Any

import click

from llmgw.cli import complete
from llmgw.cli.render import output_option, print_json, say
from llmgw.errors import LlmgwError
from llmgw.safetext import terminal_text

POLL_INTERVAL = 0.5  # seconds between two looks at a drain's progress


def _api(ctx: click.Context) -> Any:
    return ctx.obj["api"]()


def _mark(ctx: click.Context, node_id: str, action: str, output: str) -> bool:
    """POST the mark; with -o json print the server's answer and say nothing else."""
    from llmgw.api_client import segment

    answer = _api(ctx).request("POST", f"/api/v1/nodes/{segment(node_id)}/{action}")
    if output == "json":
        print_json(answer)  # escapes control characters a hostile server could send
        return False
    return True


@click.command()
@click.argument("node_id", shell_complete=complete.NODES)
@output_option
@click.pass_context
def cordon(ctx: click.Context, node_id: str, output: str) -> None:
    """No new placements on NODE_ID; what runs there stays. Kept across server restarts."""
    if _mark(ctx, node_id, "cordon", output):
        say(f"node {node_id} cordoned: no new placements; what runs there stays (llmgw ctl uncordon {node_id} to undo)")


@click.command()
@click.argument("node_id", shell_complete=complete.NODES)
@output_option
@click.pass_context
def uncordon(ctx: click.Context, node_id: str, output: str) -> None:
    """Allow placements on NODE_ID again (ends a cordon or a drain)."""
    if _mark(ctx, node_id, "uncordon", output):
        say(f"node {node_id} uncordoned: placements allowed again")


class DrainIncomplete(LlmgwError):
    exit_code = 1


def _item_line(item: dict[str, Any]) -> str:
    move = f" [{item['move']}]" if item.get("move") else ""
    succ = f" → {item['successor']}" if item.get("successor") else ""
    return f"{item['replica']} ({item['model']}, {item['state']}){succ}{move}: {item.get('note') or '-'}"


@click.command()
@click.argument("node_id", shell_complete=complete.NODES)
@click.option("--timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds to wait for the node to run nothing; the drain goes on server-side after.")
@click.option("--force", is_flag=True,
              help="Stop replicas even where no replacement fits (they are down until room frees; each is named).")
@output_option
@click.pass_context
def drain(ctx: click.Context, node_id: str, timeout: float, force: bool, output: str) -> None:
    """Cordon NODE_ID, then move its replicas elsewhere one at a time: each replacement is placed
    and ready before the old one leaves rotation, is sent Drain, and finishes its in-flight
    requests within its profile's stop_grace.

    Exit 0 when the node runs nothing; 1 with the reason otherwise (a replica with nowhere to go
    stays and serves unless --force; the timeout passed). -o json prints the last state.

    \b
    llmgw ctl drain gpu-03 && systemctl reboot   # on gpu-03, after
    llmgw ctl uncordon gpu-03
    """
    from llmgw.api_client import segment

    client = _api(ctx)
    where = f"/api/v1/nodes/{segment(node_id)}/drain"
    view = client.request("POST", where + ("?force=1" if force else ""))
    human = output != "json"
    if human:
        say(f"draining {node_id}{' (--force)' if force else ''}: cordoned; {len(view['items'])} replica(s) on it")
    shown: dict[str, str] = {}
    said: set[str] = set()
    deadline = time.monotonic() + timeout
    while True:
        if human:
            for item in view["items"]:
                line = _item_line(item)
                if shown.get(item["replica"]) != line:
                    shown[item["replica"]] = line
                    say(f"  {line}")
            for line in view.get("down") or []:
                if line not in said:
                    said.add(line)
                    say(f"  DOWN (--force): {line}")
        if view["done"]:
            break
        if not view["in_progress"]:
            _finish(view, output)
            raise DrainIncomplete(f"drain of {node_id} incomplete: " +
                                  terminal_text("; ".join(view["failed"] or ["replicas remain"])) +
                                  (" (--force stops them anyway)" if not force else ""))
        if time.monotonic() > deadline:
            _finish(view, output)
            left = terminal_text(", ".join(i["replica"] for i in view["items"] if i["state"] not in ("gone",)) or "?")
            raise DrainIncomplete(f"drain of {node_id}: timed out after {timeout:g}s; still there: {left}; "
                                  f"the drain goes on (llmgw ctl drain {node_id} to follow it again)")
        time.sleep(POLL_INTERVAL)  # ok: polling the server for progress
        view = client.get(where)
    _finish(view, output)
    if human:
        say(f"node {node_id} drained: it runs nothing"
            + (f"; {len(view['down'])} replica(s) down" if view["down"] else "")
            + f" (llmgw ctl uncordon {node_id} when it is back)")


def _finish(view: dict[str, Any], output: str) -> None:
    if output == "json":
        print_json(view)  # escapes control characters a hostile server could send


class RestartIncomplete(LlmgwError):
    exit_code = 1


@click.command()
@click.argument("replica_id", shell_complete=complete.REPLICAS)
@click.option("--force", is_flag=True,
              help="Where no node has room for a successor, stop the replica first (its model is one short until "
                   "the new one is ready).")
@click.option("--timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds to wait for the successor to serve; the restart goes on server-side after.")
@output_option
@click.pass_context
def restart(ctx: click.Context, replica_id: str, force: bool, timeout: float, output: str) -> None:
    """Replace REPLICA_ID with a fresh one, the successor first: it is placed and ready before the
    old one leaves rotation and finishes its requests (as drain and rollout do), so a model with
    one replica keeps answering. Where no node has room for both at once nothing is stopped: exit 1
    with the reason (--force then stops it first). A replica that serves nothing (pending,
    starting, failed) is stopped at once and placed anew.

    Exit 0 once the successor serves; 1 with the reason otherwise. -o json prints the last state.

    \b
    llmgw ctl restart llama-3.1-8b-instruct-wh57w
    """
    from llmgw.api_client import segment

    client = _api(ctx)
    answer = client.request("POST", f"/api/v1/replicas/{segment(replica_id)}/restart" + ("?force=1" if force else ""))
    human = output != "json"
    move = answer.get("move")
    if human:
        say(terminal_text(answer.get("message") or f"restarting {replica_id}"))
    if not move:
        if not human:
            print_json(answer)
        return
    deadline = time.monotonic() + timeout
    shown = ""
    while True:
        line = f"  {move['state']}: {move.get('note') or '-'}"
        if human and line != shown:
            shown = line
            say(terminal_text(line))
        if move["state"] in ("done", "failed"):
            break
        if time.monotonic() > deadline:
            if not human:
                print_json(move)
            raise RestartIncomplete(f"restart of {replica_id}: timed out after {timeout:g}s ({move['state']}); "
                                    "it goes on (llmgw ctl replicas to follow it)")
        time.sleep(POLL_INTERVAL)  # ok: polling the server for progress
        move = client.get(f"/api/v1/moves/{move['id']}")
    if not human:
        print_json(move)
    if move["state"] == "failed":
        note = terminal_text(move.get("note") or "the successor did not become ready")
        hint = "; llmgw ctl restart --force stops it first (one replica short until the new one is ready)" \
            if "no room" in note and not force else ""
        raise RestartIncomplete(f"restart of {replica_id} not done: {note}{hint}")
    if human:
        successor = move.get("successor") or "?"
        state = move.get("successor_state") or "gone"
        say(f"restarted {replica_id}: " + (f"{successor} serves instead" if state == "ready"
                                          else f"{successor} is {state} and serves once ready"))
