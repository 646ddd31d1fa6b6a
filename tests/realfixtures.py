"""Where the real tool output lives (tests/fixtures/real, see its SOURCES.md), and how to
read its sysfs dumps. One place, so every parser test reads the same files the same way.

The samples are copied into the repository so that a clone with nothing beside it passes
`make test`; they are never edited (fixtures of our own go beside them, marked as ours)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def real_fixtures() -> Path:
    """The fixtures directory; a missing one is an error, not a skip (the tests would
    silently stop testing the parsers on real output)."""
    for candidate in (
        os.environ.get("LLMGW_REAL_FIXTURES", ""),
        ROOT / "tests" / "fixtures" / "real",
    ):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise RuntimeError(
        f"real fixtures not found: expected {ROOT / 'tests' / 'fixtures' / 'real'} "
        "(see its SOURCES.md), or set LLMGW_REAL_FIXTURES"
    )


REAL = real_fixtures()


def load_flat(path: Path) -> dict[str, str]:
    """SOURCES.md's sysfs format: one `path: content` line per file, newlines in content as a
    literal \\n; sysfs ends every value with a newline."""
    files: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, sep, content = line.partition(": ")
        assert sep, f"not a `path: content` line: {line!r}"
        files[name] = content.replace("\\n", "\n") + "\n"
    return files
