"""Output for people (rich tables, colour only on a TTY, NO_COLOR honoured) and machines (JSON).

Everything printed here is text, never Rich markup: a string a server, a node or a certificate
supplied goes through `terminal_text` (no control characters) and into a `rich.text.Text`, so
`0.1.0[/x]` is printed as is instead of crashing the table, and an ESC sequence never reaches
the terminal. Styling is applied by the code (`styled_state`), never parsed from data.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from llmgw.catalog.units import enc_hook
from llmgw.safetext import json_text, terminal_text

OUTPUT_CHOICE = click.Choice(["table", "json"])
# What a listing prints (`ctl nodes`, `replicas`, `models`, ...), as kubectl's -o: `wide` adds
# columns and cuts no cell, `name` prints kind/name a line for xargs and for loops.
LIST_CHOICE = click.Choice(["table", "wide", "json", "yaml", "name"])


def output_option(func):
    return click.option(
        "-o",
        "--output",
        type=OUTPUT_CHOICE,
        default="table",
        show_default=True,
        help="table for people, json for scripts.",
    )(func)


def list_output_option(func):
    return click.option(
        "-o",
        "--output",
        type=LIST_CHOICE,
        default="table",
        show_default=True,
        help="table for people (long cells cut at a terminal's width), wide (more columns, nothing cut), "
        "json or yaml for scripts, name (kind/name, one a line).",
    )(func)


def print_data(data: Any, output: str) -> bool:
    """Print `data` as json or yaml when that is the output asked for; False for a table's turn."""
    if output == "json":
        print_json(data)
    elif output == "yaml":
        print_yaml(data)
    else:
        return False
    return True


def print_yaml(data: Any) -> None:
    """The JSON document as YAML (block style, keys in the order JSON has them); PyYAML escapes
    what is not printable, as json_text does for JSON."""
    import yaml

    plain = msgspec.json.decode(msgspec.json.encode(data, enc_hook=enc_hook))
    sys.stdout.write(yaml.safe_dump(plain, sort_keys=False, allow_unicode=False, default_flow_style=False))
    sys.stdout.flush()


def print_names(kind: str, names: Iterable[str]) -> None:
    """`-o name`: kind/name a line (kubectl's form), control characters removed."""
    for name in names:
        sys.stdout.write(f"{kind}/{terminal_text(name)}\n")
    sys.stdout.flush()


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


class NagiosCommand(click.Command):
    """A command that exits as a Nagios plugin (doctor, fabric-test): a mistyped option is UNKNOWN
    (3), as the plugin guidelines have it, not 2, which a check reads as CRITICAL."""

    usage_exit_code = 3


def print_json(data: Any) -> None:
    encoded = msgspec.json.format(msgspec.json.encode(data, enc_hook=enc_hook), indent=2).decode()
    sys.stdout.write(json_text(encoded))
    sys.stdout.write("\n")
    sys.stdout.flush()


def text(value: object, style: str = "", *, show_removed: bool = False) -> Text:
    """Data as a printable `Text`: control characters removed (or shown, see `terminal_text`),
    brackets printed as brackets."""
    return Text(terminal_text(value, show_removed=show_removed), style=style)


def say(value: object, *, stderr: bool = False) -> None:
    """Print one line of text that may hold data from a peer (a server message, a node id)."""
    console(stderr=stderr).print(text(value), soft_wrap=True)


def make_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None, *,
               cut: bool = False) -> Table:
    """`cut` (a listing at a terminal): every row one line, cut at the terminal's edge."""
    table = Table(title=text(title) if title is not None else None, box=None, header_style="bold", pad_edge=False,
                  show_edge=False)
    for i, name in enumerate(columns):
        # Identifiers never wrap; the last column (free text: a reason, a note) wraps instead
        # of a long reason squeezing the id and state columns out of the table. A heading may
        # hold data too (`ADAPTER <node>`): text, never markup.
        table.add_column(text(name), no_wrap=i < len(columns) - 1 or cut, overflow="fold")
    cells = [[_cell(cell) for cell in row] for row in rows]
    for row in cells:
        table.add_row(*row)
    if cut:
        # Drawn at its own width and cropped by the console at the terminal's edge: left to fit
        # no-wrap columns in 80 columns itself, Rich squeezes the first ones out of the table.
        widths = [len(name) for name in columns]
        for row in cells:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], cell.cell_len if isinstance(cell, Text) else 0)
        table.width = sum(widths) + 2 * (len(widths) - 1)
    return table


def _cell(cell: Any) -> Any:
    if cell is None:
        return ""
    if isinstance(cell, Text) or hasattr(cell, "__rich__") or hasattr(cell, "__rich_console__"):
        return cell  # built by our code (a styled state), not parsed
    return text(cell)


STATE_STYLES = {
    "ready": "green",
    "starting": "yellow",
    "pending": "yellow",
    "unreachable": "yellow",
    "stopping": "cyan",
    "draining": "cyan",
    "cordoned": "yellow",
    "failed": "red",
    "lost": "red",
}


def styled_state(state: object) -> Text:
    """A state cell; "ready,cordoned" takes the style of its mark (an SRE looks for those)."""
    key = str(state).split(" (")[0].rpartition(",")[2]  # "ready,cordoned (auto: gpu 3 Xid 79)"
    return text(state, STATE_STYLES.get(key, ""))
