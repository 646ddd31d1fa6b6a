"""The list of planted bugs `tools/mutants.py` runs: `core` (code before the fabric wave) and
`fabric` (the fabric wave and later, from 1 Dec). Data only; the runner is `tools/mutants.py`."""

from __future__ import annotations

from mutantlist.core import CORE
from mutantlist.fabric import FABRIC
from mutantlist.spec import Mutant

MUTANTS: tuple[Mutant, ...] = CORE + FABRIC

__all__ = ["MUTANTS", "Mutant"]
