"""The small checks on paths, secrets and ports the supervisor makes. The state file a shard
leaves for the next agent (`StateFile`) and what is made of it are in decide.py, which is pure."""

from __future__ import annotations

import errno
import socket

from llmgw.netaddr import url_host


class PathRefused(Exception):
    """A path that would leave the agent's work dir."""


def redact(text: str, secret: str) -> str:
    """`text` with `secret` (a shard's engine API key) replaced: what reaches a log, the
    server or a terminal never carries it (SGLang prints its server args, key included)."""
    return text.replace(secret, "<engine api key>") if secret else text


def connect_host(host: str) -> str:
    """Where the agent reaches an engine bound to `host`, ready for a URL (IPv6 in brackets)."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else url_host("::1" if host == "::" else host)


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Like the engine will: connections of a previous engine in TIME_WAIT must not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host or "0.0.0.0", port))
        except OSError as exc:
            return exc.errno not in (errno.EADDRINUSE, errno.EACCES)
    return True
