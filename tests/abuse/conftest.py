"""Abuse suites: real processes through the doors production uses (see tests/e2e)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import procs  # noqa: F401  (the fixture that stops what a test started)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/abuse/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.slow)
