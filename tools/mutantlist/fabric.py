"""The mutants of the fabric wave and later (code landed since 1 Dec, issue 37): at least one per
rule that decides something. Unit tests first; the e2e tests only where a rule lives in wiring."""

from __future__ import annotations

from mutantlist.spec import Mutant

FABRIC: tuple[Mutant, ...] = (
)
