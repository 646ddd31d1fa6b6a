"""What the fabric map keeps across restarts, in an embedded SQLite file (WAL) in the server's
state directory (DESIGN.md, "Sources of truth"): every master change a port reported, and which
fabric every subnet-manager GUID was seen in (so a fabric keeps its name after a failover, and
after a restart).

Bounded: changes older than KEEP_SECONDS are deleted as new ones arrive, and at most MAX_CHANGES
rows are kept (a flapping or lying port cannot grow the file without end). Writes are a few
rows a minute; each is one short transaction on the event loop's thread.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path

from llmgw.fabric.subnet import MasterChange

log = logging.getLogger("llmgw.server.fabric")

KEEP_SECONDS = 7 * 86400
MAX_CHANGES = 100_000
FILE_NAME = "fabric.sqlite"


class FabricStore:
    def __init__(self, state_dir: str | Path) -> None:
        directory = Path(state_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / FILE_NAME
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS master_changes "
                        "(fabric TEXT NOT NULL, at REAL NOT NULL, old TEXT NOT NULL, new TEXT NOT NULL, "
                        "reported_by TEXT NOT NULL)")
        self.db.execute("CREATE INDEX IF NOT EXISTS master_changes_at ON master_changes (fabric, at)")
        self.db.execute("CREATE TABLE IF NOT EXISTS sm_guids (guid TEXT PRIMARY KEY, fabric TEXT NOT NULL)")

    def close(self) -> None:
        self.db.close()

    def known(self) -> dict[str, str]:
        return dict(self.db.execute("SELECT guid, fabric FROM sm_guids").fetchall())

    def remember(self, known: Mapping[str, str]) -> None:
        with self.db:
            self.db.executemany("INSERT OR IGNORE INTO sm_guids (guid, fabric) VALUES (?, ?)", known.items())

    def add_changes(self, changes: Iterable[MasterChange], now: float) -> None:
        rows = [(c.fabric, c.at, c.old, c.new, c.reported_by) for c in changes]
        if not rows:
            return
        with self.db:
            self.db.executemany("INSERT INTO master_changes VALUES (?, ?, ?, ?, ?)", rows)
            self.db.execute("DELETE FROM master_changes WHERE at < ?", (now - KEEP_SECONDS,))
            self.db.execute("DELETE FROM master_changes WHERE rowid NOT IN "
                            "(SELECT rowid FROM master_changes ORDER BY at DESC LIMIT ?)", (MAX_CHANGES,))

    def changes(self, since: float, fabric: str | None = None) -> list[MasterChange]:
        if fabric is None:
            rows = self.db.execute("SELECT fabric, at, old, new, reported_by FROM master_changes WHERE at >= ? "
                                   "ORDER BY at", (since,)).fetchall()
        else:
            rows = self.db.execute("SELECT fabric, at, old, new, reported_by FROM master_changes "
                                   "WHERE fabric = ? AND at >= ? ORDER BY at", (fabric, since)).fetchall()
        return [MasterChange(fabric=f, at=at, old=old, new=new, reported_by=by) for f, at, old, new, by in rows]
