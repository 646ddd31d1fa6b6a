from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Proc


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    """Processes a test starts; all are stopped (and their groups killed) at the end, and so
    are engines that agents left behind (they run in sessions of their own)."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(timeout=5)
        p.kill_group()
    from llmgw.demo import kill_leftover_engines

    kill_leftover_engines(tmp_path, pattern="**/shards/*.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
