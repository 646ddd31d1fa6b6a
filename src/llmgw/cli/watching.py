"""`--watch` on every listing (issue 46): a table refreshed in place, or with `-o json` an object a
line each time one appears or changes, and `{"<key>": …, "deleted": true}` when it is gone — what
`kubectl get -w -o json` prints. Polling the server's read API; nothing here is a stream."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import click
from rich.console import RenderableType

from llmgw.cli.render import console


def watch_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
                        help="Seconds between refreshes with --watch.")(func)
    return click.option("-w", "--watch", is_flag=True, help="Refresh in place until Ctrl-C; with -o json, one "
                        "object a line each time one appears or changes.")(func)


def refuse_output(watch: bool, output: str) -> None:
    if watch and output in ("yaml", "name"):
        raise click.UsageError(f"--watch prints a table or, with -o json, one object a line; not -o {output}")


def changes(previous: dict[str, str], current: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], str],
            volatile: Collection[str], key_field: str = "id") -> tuple[dict[str, str], list[dict[str, Any]]]:
    """What to print after a poll: the objects new or changed since `previous` (fields in
    `volatile`, an age or a heartbeat count, left out of the comparison), then one line for each
    that is gone. Returns the state for the next poll with the lines."""
    seen: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for item in current:
        k = key(item)
        stamp = json.dumps({f: v for f, v in item.items() if f not in volatile}, sort_keys=True)
        seen[k] = stamp
        if previous.get(k) != stamp:
            out.append(item)
    out += [{key_field: gone, "deleted": True} for gone in sorted(previous.keys() - seen.keys())]
    return seen, out


def watch_json(fetch: Callable[[], list[dict[str, Any]]], interval: float, key_field: str,
               volatile: Collection[str] = ()) -> None:
    state: dict[str, str] = {}
    try:
        while True:
            state, lines = changes(state, fetch(), lambda item: str(item[key_field]), volatile, key_field)
            for item in lines:
                sys.stdout.write(json.dumps(item) + "\n")
            sys.stdout.flush()
            time.sleep(interval)  # ok: polling the server for what is new
    except KeyboardInterrupt:
        pass


def watch_table(view: Callable[[], RenderableType], interval: float) -> None:
    from rich.live import Live

    with Live(view(), console=console(), auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(interval)  # ok: polling the server for what is new
                live.update(view(), refresh=True)
        except KeyboardInterrupt:
            pass
