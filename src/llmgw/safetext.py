"""Text a peer supplied, made safe for a terminal: no control characters reach it. Pure.

A node's GPU name, its agent version, an engine's last output lines and a server's error
message all end up in an operator's terminal through `llmgw ctl`. A terminal obeys what it is
sent: ESC sequences set the window title, write the clipboard (OSC 52), hide links (OSC 8),
clear the screen or draw a fake "all replicas ready"; C1 bytes (U+0080-U+009F) are the same
commands for terminals that take 8-bit controls; bidirectional overrides reorder what is shown
(CVE-2021-42574). `terminal_text` removes all of them (C0 but for nothing, DEL, C1, the bidi
controls, line and paragraph separators), so a field stays one line of plain text; with
`show_removed` each removed character becomes a visible placeholder instead (ESC → ␛, other
C0 → its Unicode control picture, DEL → ␡, others → \\x9b or \\u202e), for engine output where
an operator should see that something was there.
"""

from __future__ import annotations

import re

# DEL, C1, bidi embeddings, overrides and isolates, the implicit marks, and the line/paragraph
# separators some terminals break on; with C0 (tab and newline included: a field is one line).
_BEYOND_C0 = "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[\x00-\x1f{_BEYOND_C0}]")
_UNSAFE_IN_JSON = re.compile(f"[{_BEYOND_C0}]")


def _placeholder(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if code < 0x20:
        return chr(0x2400 + code)  # ␀ … ␟ (ESC is ␛)
    if code == 0x7F:
        return "\u2421"  # ␡
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def _removed(match: re.Match[str]) -> str:
    return " " if match.group() in "\t\n\r\v\f\u2028\u2029" else ""


def terminal_text(value: object, *, show_removed: bool = False) -> str:
    """`value` as a string with no character a terminal would act on (see the module text).

    Without `show_removed`, white-space controls (tab, newline, CR, …) become one space and the
    others disappear."""
    text = value if isinstance(value, str) else str(value)
    return _UNSAFE.sub(_placeholder if show_removed else _removed, text)


def json_text(encoded: str) -> str:
    """Encoded JSON with the unsafe characters JSON leaves raw (all but C0) written as \\u escapes:
    they occur only inside strings, where the escape means the same, so the data is intact."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", encoded)
