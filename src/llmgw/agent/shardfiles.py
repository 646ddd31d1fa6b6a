"""What a shard leaves on the node besides its process (its state file, for the next agent to
adopt it from, and its log), and the small checks on paths, secrets and ports the supervisor
makes. The state file's contents (`StateFile`) and what is made of it are in decide.py, which is pure."""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

import msgspec

from llmgw.agent.decide import HEALTHY_OR_NOT, StateFile
from llmgw.agent.shardrun import ShardRun
from llmgw.fsutil import atomic_write, ensure_dir
from llmgw.netaddr import url_host
from llmgw.wire.ids import quote

log = logging.getLogger("llmgw.agent.supervisor")  # its lines read as the supervisor's, as before


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


class ShardFiles:
    """The agent's work dir: one state file (shards/ID.json) and one log (logs/ID.log) per
    shard, and nothing written outside it."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.state_dir = work_dir / "shards"
        self.log_dir = work_dir / "logs"

    def state_files(self) -> list[Path]:
        """The state files left by engines launched before (by this agent or an earlier one)."""
        return sorted(self.state_dir.glob("*.json"))

    def inside(self, path: Path) -> Path:
        """`path` resolved, or PathRefused when it lands outside the work dir (a symlinked
        directory, an id that slipped past the pattern): the agent writes nowhere else."""
        resolved = path.resolve()
        root = self.work_dir.resolve()
        if not resolved.is_relative_to(root):
            raise PathRefused(f"{quote(str(path))} resolves to {quote(str(resolved))}, outside the work dir {root}")
        return resolved

    def make_private(self) -> None:
        """The work dir 0700, state files 0600: a shard's state holds its profile's env (an
        HF_TOKEN, say), and engine logs may echo it. Before issue 9 both were world-readable
        (0755 dirs, 0644 files). A dir or file left wider by an older agent is tightened."""
        for directory in (self.work_dir, self.state_dir, self.log_dir):
            ensure_dir(directory, mode=0o700)
            mode = directory.stat().st_mode & 0o777
            if mode & 0o077:
                os.chmod(directory, 0o700)
                log.warning("%s was open to other users (mode %o); now 0700 (shard state holds engine env)",
                            directory, mode)
        for path in self.state_files():
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)

    def state_path(self, shard_id: str) -> Path:
        return self.inside(self.state_dir / f"{shard_id}.json")

    def log_path(self, shard_id: str) -> Path:
        return self.inside(self.log_dir / f"{shard_id}.log")

    def write(self, run: ShardRun) -> None:
        data = msgspec.json.encode(
            StateFile(
                spec=run.spec,
                pid=run.pid,
                pgid=run.pgid,
                start_ticks=run.start_ticks,
                started_at=run.started_at,
                log_path=run.log_path,
                endpoint=run.endpoint,
                ready=run.state in HEALTHY_OR_NOT,
            )
        )
        try:
            atomic_write(self.state_path(run.spec.shard_id), data, mode=0o600)
        except PathRefused as exc:
            log.error("not writing the state file of shard %s: %s", run.spec.shard_id, exc)

    def remove(self, shard_id: str) -> None:
        try:
            self.state_path(shard_id).unlink()
        except FileNotFoundError:
            pass
        except PathRefused as exc:
            log.error("not removing the state file of shard %s: %s", quote(shard_id), exc)
