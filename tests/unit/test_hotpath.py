"""The compiled hot path: the suite runs on what it says it runs on, and what ships compiles.

`make test` runs the suite on the compiled copy tools/compile.py builds, with
LLMGW_EXPECT_COMPILED=1: then every module of llmgw.hotpath.COMPILED must come from an
extension, or a broken build would pass the suite on the pure sources without anyone knowing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import llmgw
from llmgw import hotpath

ROOT = Path(__file__).resolve().parents[2]


def test_the_suite_imports_the_build_it_was_told_to() -> None:
    found = hotpath.compiled()
    if os.environ.get("LLMGW_EXPECT_COMPILED") == "1":
        assert found == list(hotpath.COMPILED), f"not compiled: {set(hotpath.COMPILED) - set(found)}"
    else:
        assert found == [], f"compiled modules in a pure run: {found} (from {llmgw.__file__})"


def test_every_compiled_module_has_its_source_in_the_tree() -> None:
    """What setup.py and tools/compile.py hand mypyc names a file for each module, and only those."""
    root = str(Path(llmgw.__file__).parent.parent)
    files = [arg for arg in hotpath.mypyc_args(root) if not arg.startswith("--")]
    assert len(files) == len(hotpath.COMPILED)
    for name, file in zip(hotpath.COMPILED, files, strict=True):
        path = Path(file)
        assert path.is_file(), f"{name}: no {path}"


def test_version_says_how_the_hot_path_runs() -> None:
    """An SRE learns whether this install is the compiled one (the start-up log says the same)."""
    out = subprocess.run([sys.executable, "-m", "llmgw", "--version"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    n = len(hotpath.compiled())
    if n:
        assert f"hot path compiled ({n} of {len(hotpath.COMPILED)} modules)" in out
    else:
        assert "hot path pure Python" in out
