"""Cordon and drain marks on disk (drain.MarkStore): kept across a reopen, and a file that is
not a database is moved aside with a warning, never a crash."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llmgw.server.drain import FILE_NAME, Mark, MarkRecord, MarkStore


def test_marks_survive_a_reopen_and_uncordon_removes_them(tmp_path: Path) -> None:
    store = MarkStore(tmp_path)
    store.put("gpu-01", MarkRecord(Mark.CORDONED, 1.0, "alice"))
    store.put("gpu-02", MarkRecord(Mark.DRAINING, 2.0, "bob", force=True))
    store.put("gpu-01", MarkRecord(Mark.DRAINING, 3.0, "alice"))  # a cordon becomes a drain
    store.close()
    again = MarkStore(tmp_path)
    assert again.load() == {"gpu-01": MarkRecord(Mark.DRAINING, 3.0, "alice"),
                            "gpu-02": MarkRecord(Mark.DRAINING, 2.0, "bob", force=True)}
    again.delete("gpu-01")
    assert set(MarkStore(tmp_path).load()) == {"gpu-02"}


def test_a_corrupt_file_is_moved_aside_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / FILE_NAME).write_bytes(b"this is not a database, it is a note" * 100)
    with caplog.at_level(logging.WARNING):
        store = MarkStore(tmp_path)
    assert store.load() == {}
    assert [p.name for p in tmp_path.glob(f"{FILE_NAME}.corrupt-*")]
    assert "moved it aside" in caplog.text and "marks it held are lost" in caplog.text
