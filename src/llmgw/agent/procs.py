"""Process facts from /proc and signals to process groups (Linux).

A pid alone does not identify a process across an agent restart: pids are reused. The pid
together with its start time (field 22 of /proc/<pid>/stat, in clock ticks since boot) does.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 on (state), or None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return text.rsplit(")", 1)[1].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if it is gone or a zombie."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used (benchmarks read it before and after)."""
    fields = _stat(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int, ticks: int) -> bool:
    return pid > 0 and start_ticks(pid) == ticks


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group (the engine and its workers). False if none is left.

    Never 0 or below: os.killpg(0, …) would signal the agent's own group.
    """
    if pgid <= 0:
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    return signal_group(pgid, 0)


def signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exited (exit status unknown: it was not this agent's child)"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exited with code {code}"


def tail_lines(path: str, lines: int = 200, max_bytes: int = 256 * 1024) -> list[str]:
    """The last `lines` lines of a log file (reads at most `max_bytes` from its end)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace")
    out = text.splitlines()
    if size > max_bytes and out:
        out = out[1:]  # the first line is probably cut
    return out[-lines:]


def session_members(sid: int) -> list[int]:
    """Every process in session `sid` (field 6 of /proc/<pid>/stat), zombies left out: what a
    process started with start_new_session=True and its descendants are, even those that moved
    to a process group of their own (setpgid keeps the session; only setsid leaves it)."""
    if sid <= 0:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


def signal_session(sid: int, sig: int) -> int:
    """Signal every process of a session; how many were signalled (0: none is left)."""
    count = 0
    for pid in session_members(sid):
        try:
            os.kill(pid, sig)
            count += 1
        except (ProcessLookupError, PermissionError):
            pass
    return count
