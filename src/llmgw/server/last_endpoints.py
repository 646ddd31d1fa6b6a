"""The endpoint set the control plane last published after settling, kept in its state directory.

A restarted control plane has rebuilt no replica yet: until it has settled (llmgw.server.settling)
its own gateway, and the gateway workers it starts with it, serve the endpoints this file names
whose nodes have not re-registered yet (a node that has is the authority on its engines), beside
the ones rebuilt so far; the health checks take out those that no longer answer. Without it a
restart was an outage until the agents were back (issue 41: 1,133 × 503 over 11 s).

The file holds the engines' keys, so it is written 0600 like the CA's keys beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import msgspec

from llmgw.fsutil import atomic_write

log = logging.getLogger("llmgw.server")


class Entry(msgspec.Struct, kw_only=True):
    model: str
    node: str
    key: str = ""


class LastEndpoints:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "endpoints.json"
        self.entries: dict[str, Entry] = {}  # endpoint → what served it
        try:
            self.entries = msgspec.json.decode(self.path.read_bytes(), type=dict[str, Entry])
        except FileNotFoundError:
            pass
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("%s cannot be read (%s); a restart serves no endpoint set before settling", self.path, exc)
        self._saved = msgspec.json.encode(self.entries) if self.entries else b""
        self.frozen = False

    def freeze(self) -> None:
        """The server is shutting down: the streams closing on the way empty its ready set, and
        that must not be what the next start serves (a routine SIGTERM restart would be an outage)."""
        self.frozen = True

    def save(self, entries: Mapping[str, Entry]) -> None:
        """The set published now (settled); written only when it changed."""
        if self.frozen:
            return
        data = msgspec.json.encode(dict(sorted(entries.items())))
        self.entries = dict(entries)
        if data == self._saved:
            return
        self._saved = data
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, data, mode=0o600)
        except OSError as exc:
            log.warning("cannot save %s: %s", self.path, exc)

    def unconfirmed(self, returned: set[str]) -> dict[str, Entry]:
        """The last set's endpoints on nodes that have not re-registered since this start."""
        return {ep: e for ep, e in self.entries.items() if e.node not in returned}
