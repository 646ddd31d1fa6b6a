"""Output for people (rich tables, colour only on a TTY, NO_COLOR honoured) and machines (JSON)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.table import Table

from llmgw.catalog.units import enc_hook

OUTPUT_CHOICE = click.Choice(["table", "json"])


def output_option(func):
    return click.option(
        "-o",
        "--output",
        type=OUTPUT_CHOICE,
        default="table",
        show_default=True,
        help="table for people, json for scripts.",
    )(func)


def console(stderr: bool = False) -> Console:
    """A console that colours only a terminal and never when NO_COLOR is set."""
    stream = sys.stderr if stderr else sys.stdout
    no_color = "NO_COLOR" in os.environ and os.environ["NO_COLOR"] != ""
    width = None
    if not stream.isatty() and not os.environ.get("COLUMNS"):
        width = 250  # a pipe or a file: do not cut table rows at 80 columns
    return Console(
        file=stream,
        width=width,
        no_color=no_color,
        color_system=None if no_color else "auto",
        highlight=False,
        soft_wrap=False,
    )


def print_json(data: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(data, enc_hook=enc_hook), indent=2).decode())
    sys.stdout.write("\n")
    sys.stdout.flush()


def make_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> Table:
    table = Table(title=title, box=None, header_style="bold", pad_edge=False, show_edge=False)
    for i, name in enumerate(columns):
        # Identifiers never wrap; the last column (free text: a reason, a note) wraps instead
        # of a long reason squeezing the id and state columns out of the table.
        table.add_column(name, no_wrap=i < len(columns) - 1, overflow="fold")
    for row in rows:
        table.add_row(*("" if cell is None else str(cell) if not hasattr(cell, "__rich__") else cell for cell in row))
    return table


STATE_STYLES = {
    "ready": "green",
    "starting": "yellow",
    "pending": "yellow",
    "unreachable": "yellow",
    "stopping": "cyan",
    "failed": "red",
    "lost": "red",
}


def styled_state(state: str) -> str:
    style = STATE_STYLES.get(state)
    return f"[{style}]{state}[/{style}]" if style else state
