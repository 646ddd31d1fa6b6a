"""Node ids this server has seen, kept in its state directory across restarts.

After a restart the reconciler waits until these nodes have re-registered (or the settle
period passes) before placing anything: their engines are adopted, not placed twice.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from llmgw.fsutil import atomic_write

log = logging.getLogger("llmgw.server")


class KnownNodes:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "known-nodes.json"
        self.ids: set[str] = set()
        try:
            self.ids = set(msgspec.json.decode(self.path.read_bytes(), type=list[str]))
        except FileNotFoundError:
            pass
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("%s cannot be read (%s); starting with no known nodes", self.path, exc)

    def add(self, node_id: str) -> None:
        if node_id in self.ids:
            return
        self.ids.add(node_id)
        self._save()

    def remove(self, node_id: str) -> None:
        """A forgotten node: a restarted server no longer waits for it to re-register."""
        if node_id not in self.ids:
            return
        self.ids.discard(node_id)
        self._save()

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, msgspec.json.encode(sorted(self.ids)))
        except OSError as exc:
            log.warning("cannot save %s: %s", self.path, exc)
