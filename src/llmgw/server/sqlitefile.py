"""The server's small SQLite files (events.db, nodes.sqlite): opened the same way, checked the same way.

WAL, a quick_check before anything is trusted, the schema created if missing; a file that is not
a database is moved aside (`<name>.corrupt-<time>`, with its -wal and -shm removed) so that a new
one can start: a corrupt file costs what it held, never the server.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path


def connect_checked(path: Path, schema: str, *, synchronous: str = "NORMAL") -> sqlite3.Connection:
    """An autocommit connection usable from a worker thread; raises sqlite3.DatabaseError for a file
    that is not a sound database."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        check = db.execute("PRAGMA quick_check").fetchone()
        if check is None or check[0] != "ok":
            raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
        db.executescript(schema)
    except BaseException:
        db.close()
        raise
    return db


def move_aside(path: Path) -> Path:
    """Rename a bad database out of the way; where it went."""
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    path.rename(aside)
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return aside
