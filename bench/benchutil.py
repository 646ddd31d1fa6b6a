"""What every benchmark needs: a free port, a process's CPU time from /proc, and what the machine
charges for keeping both its cores busy."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import llmgw
from llmgw import hotpath
from llmgw.agent.procs import cpu_seconds

__all__ = ["cpu_seconds", "cpu_tree", "free_port"]


def descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (alive now), from /proc/PID/task/*/children."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def cpu_tree(pid: int) -> float:
    """CPU seconds of a process and every descendant alive now (nginx's worker under its master,
    llmgw's gateway workers under the server)."""
    total = cpu_seconds(pid)
    for child in descendants(pid):
        try:
            total += cpu_seconds(child)
        except ProcessLookupError:
            pass
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build() -> str:
    """Which llmgw the bench's processes run (they inherit this interpreter's path): `make
    bench-*` measures the compiled build a regular install runs."""
    return f"llmgw from {Path(llmgw.__file__).parent.parent}, {hotpath.summary()}"
