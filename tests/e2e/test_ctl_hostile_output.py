"""`llmgw ctl` against a server whose every string is hostile: nothing reaches the terminal but text.

A real `llmgw ctl` process reads a real HTTP server (tests/e2e/hostile_api.py) that serves the
/api/v1 shapes with ESC sequences, OSC 52 / OSC 8, C1 controls, bidi overrides and Rich markup
in every string field. Tables must print them as inert text (no crash on `0.1.0[/x]`), engine
tails must show placeholders for what was removed, and `-o json` must still return the data.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import hostile_api
from tests.e2e.harness import ctl, one_error_line, wait_until

# What must never reach the terminal: C0 but newline, DEL, C1, bidi controls.
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.fixture
def hostile_server(tmp_path: Path) -> Iterator[str]:
    portfile = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, hostile_api.__file__, str(portfile)])
    try:
        port = wait_until(lambda: portfile.exists() and portfile.read_text().strip().isdigit() and portfile.read_text(),
                          "the hostile server's port")
        yield f"http://127.0.0.1:{port.strip()}"
    finally:
        proc.kill()
        proc.wait()


def wide_ctl(server: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`ctl` with a table wide enough that no cell is cut (the hostile strings are long)."""
    return ctl(server, *args, env={"COLUMNS": "4000"})


def _clean(result: subprocess.CompletedProcess[str]) -> None:
    for name, stream in (("stdout", result.stdout), ("stderr", result.stderr)):
        found = UNSAFE.search(stream)
        assert found is None, f"{name} carries {found.group()!r}: {stream!r}"
        assert "Traceback" not in stream


@pytest.mark.parametrize("command", ["nodes", "replicas", "models", "endpoints"])
def test_tables_print_hostile_strings_as_inert_text(hostile_server: str, command: str) -> None:
    result = wide_ctl(hostile_server, command)
    assert result.returncode == 0, result.stderr
    _clean(result)
    # Markup is printed as the brackets it is, not interpreted (nor a crash).
    assert "[/x][bold red]0.1.0[/x][link=https://evil.example]" in result.stdout
    assert "pwned" in result.stdout  # the window title's text stays, as harmless text


def test_engine_tails_show_what_was_removed(hostile_server: str) -> None:
    result = wide_ctl(hostile_server, "replicas", "--tail", "5")
    assert result.returncode == 0, result.stderr
    _clean(result)
    tails = [line for line in result.stdout.splitlines() if "│" in line]
    assert len(tails) == 2, result.stdout  # r-1 (failed); r-2's state is not a state
    assert all("␛[2J␛[H␛]0;pwned␇" in line and "\\x9b31m" in line and "\\u202e" in line for line in tails)
    assert any("all replicas ready" in line for line in tails)


@pytest.mark.parametrize("command", ["nodes", "replicas", "models", "endpoints"])
def test_json_output_keeps_the_data_escaped(hostile_server: str, command: str) -> None:
    result = ctl(hostile_server, command, "-o", "json")
    assert result.returncode == 0, result.stderr
    _clean(result)  # JSON's \u escapes: the bytes are inert, the data intact
    assert json.loads(result.stdout) == hostile_api.ROUTES[f"/api/v1/{command}"]


def test_server_messages_and_refusals_are_plain_lines(hostile_server: str) -> None:
    reload = wide_ctl(hostile_server, "reload")
    assert reload.returncode == 0, reload.stderr
    _clean(reload)
    assert reload.stdout.startswith("reloaded") and "[/x]" in reload.stdout
    for args in (("restart", "r-1"), ("forget", "gpu-01")):
        refused = ctl(hostile_server, *args)
        assert refused.returncode == 1
        _clean(refused)
        assert "[/x][bold red]0.1.0" in one_error_line(refused)


@pytest.mark.parametrize(("args", "code"), [
    (("doctor",), 1), (("doctor", "--quiet"), 1), (("events",), 0), (("models",), 0),
    (("fabric-test", "gpu-01", "gpu-02"), 2),
    # Their one error line carries the server's words (a halted rollout's note, why a drain is stuck).
    (("rollout", "status", "plain"), 1), (("drain", "gpu-01"), 1),
])
def test_the_day2_and_diagnosis_commands_print_hostile_strings_as_inert_text(
        hostile_server: str, args: tuple[str, ...], code: int) -> None:
    result = wide_ctl(hostile_server, *args)
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    _clean(result)
    assert "[/x][bold red]0.1.0" in result.stdout + result.stderr  # the data is there, as text
    if code == 1 and args[0] in ("rollout", "drain"):
        one_error_line(result)  # a newline in the server's words starts no line of its own


@pytest.mark.parametrize("args", [("doctor", "-o", "json"), ("events", "-o", "json"), ("drain", "gpu-01", "-o", "json"),
                                  ("fabric-test", "gpu-01", "gpu-02", "-o", "json")])
def test_day2_json_output_is_escaped(hostile_server: str, args: tuple[str, ...]) -> None:
    result = ctl(hostile_server, *args)
    _clean(result)
    assert "pwned" in result.stdout
