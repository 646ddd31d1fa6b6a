"""terminal_text / json_text: whatever a peer sends, nothing a terminal acts on comes out."""

from __future__ import annotations

import json
import re

from hypothesis import given
from hypothesis import strategies as st

from llmgw.safetext import json_text, terminal_text

UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


@given(st.text())
def test_no_control_character_survives(text: str) -> None:
    assert not UNSAFE.search(terminal_text(text))
    assert not UNSAFE.search(terminal_text(text, show_removed=True))


@given(st.text())
def test_json_stays_the_same_data(text: str) -> None:
    encoded = json_text(json.dumps({"k": text}, ensure_ascii=False))
    assert not UNSAFE.search(encoded.replace("\n", ""))
    assert json.loads(encoded) == {"k": text}


def test_placeholders_and_stripping() -> None:
    hostile = "v\x1b]52;c;aGk=\x07\x9b2J\u202e\tx\ny"
    assert terminal_text(hostile) == "v]52;c;aGk=2J x y"
    assert terminal_text(hostile, show_removed=True) == "v␛]52;c;aGk=␇\\x9b2J\\u202e␉x␊y"
    assert terminal_text(3) == "3"
