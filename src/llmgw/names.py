"""The one pattern for ids and model names, and quoting for logs. Pure; imports nothing of llmgw.

Below both the catalog (which checks a model's name and a profile's id when it loads) and the
fleet protocol (wire/ids.py checks every id a fleet message carries against these): here rather
than in wire/ so that the catalog does not import the protocol it is carried by (issue 42).
wire/ids.py says why the patterns are what they are.
"""

from __future__ import annotations

import re

ID_MAX = 128
MODEL_MAX = 256
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def id_problem(value: str, what: str = "id") -> str | None:
    """Why `value` is not a valid id, or None when it is."""
    if not value:
        return f"empty {what}"
    if len(value) > ID_MAX:
        return f"{what} longer than {ID_MAX} characters"
    if not _ID.fullmatch(value) or ".." in value:
        return f"invalid {what} {quote(value)}: use letters, digits, '.', '_' and '-', starting with a letter or digit"
    return None


def model_problem(value: str, what: str = "model name") -> str | None:
    """Why `value` is not a valid model name, or None when it is."""
    if not value:
        return f"empty {what}"
    if len(value) > MODEL_MAX:
        return f"{what} longer than {MODEL_MAX} characters"
    if not _MODEL.fullmatch(value) or any(part in ("", ".", "..") for part in value.split("/")):
        return (f"invalid {what} {quote(value)}: use letters, digits and '.', '_', '-', ':', '@', '+', '/' "
                "(no empty, '.' or '..' segment), starting with a letter or digit")
    return None


def valid_id(value: str) -> bool:
    return id_problem(value) is None


def quote(value: object) -> str:
    """A peer-supplied value for a log line: quoted, control characters escaped, so a newline
    in a version or a reason can never start a forged line of its own."""
    return repr(str(value))


def printable(text: str) -> str:
    """`text` with control characters (C0, DEL, C1) escaped as \\xNN: for lines that embed a
    peer's free text (an engine's exit reason) without quoting the whole line."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
