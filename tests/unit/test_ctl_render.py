"""What `llmgw ctl` prints of data a peer sent (issue 37): `-o json` keeps the data intact with
every character a terminal would act on written as an escape, and a table shows a cell as the
text it is (brackets as brackets, no control character), never as rich markup."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from llmgw.cli.render import make_table, print_json

# A node id, an engine's output and a reason as a hostile node could send them: ESC (C0), CSI
# as one C1 byte, DEL, a bidi override (CVE-2021-42574), a line separator, rich markup.
HOSTILE = {
    "node": "gpu-01\x1b]0;owned\x07",
    "tail": ["\x9b2J all replicas ready", "ok\x7f", "\u202egnp.exe", "one\u2028two"],
    "reason": "[red]fine[/red] [link=http://evil]x[/link]",
}
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def test_print_json_escapes_every_unsafe_character_and_keeps_the_data(capsys: pytest.CaptureFixture[str]) -> None:
    print_json(HOSTILE)
    out = capsys.readouterr().out
    assert out.endswith("\n")
    assert UNSAFE.findall(out.replace("\n", "")) == []  # newlines only between JSON tokens
    assert json.loads(out) == HOSTILE
    assert "\\u009b" in out and "\\u202e" in out and "\\u2028" in out and "\\u001b" in out


def test_a_table_shows_cells_as_text_never_markup_or_control_characters() -> None:
    table = make_table(["NODE", "REASON"], [[HOSTILE["node"], HOSTILE["reason"]], [HOSTILE["tail"][0], None]])
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None, highlight=False).print(table)
    out = buffer.getvalue()
    assert UNSAFE.findall(out.replace("\n", "")) == []
    assert "[red]fine[/red]" in out and "[link=http://evil]x[/link]" in out  # shown as sent
    assert "gpu-01]0;owned" in out and "2J all replicas ready" in out
