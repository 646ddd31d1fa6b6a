"""Files that must never be half-written: temp name in the same directory, fsync, rename.

One implementation for the whole project (CA keys, state files, simulated nodes)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from llmgw.errors import LlmgwError


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes, *, mode: int = 0o644, replace: bool = False) -> None:
    """Write to a temporary name in the same directory, fsync, then rename into place.

    Without `replace`, the final step is a hard link, which fails if `path` exists, so a file
    that appeared meanwhile is never clobbered (LlmgwError names it). Readers see either no
    file or the whole file, and a key never exists with a wider mode than `mode`.
    """
    target = Path(path)
    directory = target.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except FileNotFoundError:
        raise LlmgwError(f"cannot write {target}: directory {directory} does not exist")
    except PermissionError:
        raise LlmgwError(f"cannot write {target}: permission denied in {directory}")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise LlmgwError(f"{target} already exists; pass --force to replace it")
            except OSError:
                # A file system without hard links: check, then rename (a small race, no link).
                if target.exists():
                    raise LlmgwError(f"{target} already exists; pass --force to replace it")
                os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(directory)


def publish(tmp: str | Path, target: str | Path) -> None:
    """Rename a finished file (written and fsynced by the caller) to its final name, and make
    the rename durable: a download too large for write_atomic's one buffer ends here."""
    os.replace(tmp, target)
    _fsync_dir(Path(target).parent)


def ensure_dir(path: str | Path, mode: int = 0o700) -> Path:
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise LlmgwError(f"{directory} exists and is not a directory")
    try:
        directory.mkdir(mode=mode, parents=True, exist_ok=True)
    except PermissionError:
        raise LlmgwError(f"cannot create directory {directory}: permission denied")
    return directory


def atomic_write(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data`: readers see the old file or the new one, never a mix."""
    write_atomic(path, data, mode=mode, replace=True)
