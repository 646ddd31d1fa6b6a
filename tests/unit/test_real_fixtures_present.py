"""The repository stands alone: the real samples live inside it and each one has its provenance."""

from __future__ import annotations

import os

from tests.realfixtures import REAL, ROOT


def test_real_fixtures_are_read_from_inside_the_repository() -> None:
    if os.environ.get("LLMGW_REAL_FIXTURES"):
        return  # an explicit override is the operator's choice
    assert REAL.resolve().is_relative_to(ROOT.resolve())


def test_every_real_sample_is_named_in_sources() -> None:
    sources = (REAL / "SOURCES.md").read_text()
    unnamed = [
        str(path.relative_to(REAL))
        for path in sorted(REAL.rglob("*"))
        if path.is_file() and path.name != "SOURCES.md" and path.name not in sources
    ]
    assert unnamed == []
