"""One planted bug: the text it replaces, and the tests meant to catch it (unit first)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # exact text; must occur exactly once in the file
    new: str
    unit: tuple[str, ...]  # pytest arguments (files, node ids, -k expressions) of the unit tests
    e2e: tuple[str, ...] = ()  # run only when the unit tests miss it: "caught by e2e only"
