"""Build a copy of the package with the gateway's hot path compiled by mypyc, beside the sources.

    python tools/compile.py build/compiled

The copy (every file of src/llmgw, plus an extension module for each of llmgw.hotpath.COMPILED)
is what `make test` runs the suite on and what the benches measure: what a regular install runs.
Built apart from src/ because a compiled module sitting beside its .py is imported in its place,
and an edit to the source would silently not run. Built in a temporary directory and renamed over
the old copy, so an interrupted build leaves the last good one (or none), never half of one.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/compile.py DEST", file=sys.stderr)
        return 2
    dest = Path(argv[0]).resolve()
    hotpath = runpy.run_path(str(SRC / "llmgw" / "hotpath.py"))
    modules = hotpath["COMPILED"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
        work = Path(tmp) / "tree"
        shutil.copytree(SRC / "llmgw", work / "llmgw", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        # mypyc builds in place: the extensions land beside their sources in the copy, its
        # intermediate C files under build/ (removed: only the tree is kept)
        result = subprocess.run([sys.executable, "-m", "mypyc", *hotpath["mypyc_args"](".")], cwd=work,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "MYPY_FORCE_COLOR": "0"})
        if result.returncode != 0:
            print(result.stdout[-4000:], file=sys.stderr)
            print(f"compile.py: mypyc failed on {', '.join(modules)} (its output above)", file=sys.stderr)
            return 1
        shutil.rmtree(work / "build", ignore_errors=True)
        old = Path(tmp) / "old"
        if dest.exists():
            dest.rename(old)
        work.rename(dest)
    built = sorted(p.name for p in dest.rglob("*.so"))
    print(f"compiled {len(modules)} modules into {dest} in {time.monotonic() - started:.0f} s ({len(built)} extension files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
