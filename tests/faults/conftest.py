"""Fault suite fixtures: every process a test starts is stopped at the end, and the test fails
if anything of it is still running after that (an engine an agent left behind, say)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Proc, wait_until
from tests.faults.fleet import strays


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        p.stop(timeout=10)
    try:
        wait_until(lambda: not strays(tmp_path), "no process of the test left running", deadline=15)
    except AssertionError:
        pass  # named below
    finally:
        left = strays(tmp_path)
        for line in left:
            try:
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in started:
            p.kill_group()
    assert not left, f"left running after the test: {left}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
