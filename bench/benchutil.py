"""What every benchmark needs: a free port, and a process's CPU time from /proc."""

from __future__ import annotations

import socket

from llmgw.agent.procs import cpu_seconds

__all__ = ["cpu_seconds", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
