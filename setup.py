"""A regular install compiles the gateway's hot path (llmgw.hotpath.COMPILED) with mypyc.

Everything else about the package is in pyproject.toml. Left pure, with a warning that says
so: an editable install (its sources are edited; a compiled module beside its .py would be run
in its place), LLMGW_PURE=1, and a machine where mypyc or the C compiler fails. Pure is slower,
never different: the same modules run as Python.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PURE_HINT = "the gateway's hot path stays pure Python (about half its compiled throughput)"


def _warn(why: str) -> None:
    print(f"llmgw setup: {why}: {PURE_HINT}", file=sys.stderr)


class _BuildExtOrPure(build_ext):
    """A compiler that fails leaves the install pure rather than failing it."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # CompileError, a missing gcc or Python headers: all alike here
            _warn(f"compiling failed ({str(exc)[:120]}…; pip install -v shows all)")
            for path in self.get_outputs():
                Path(path).unlink(missing_ok=True)
            self.extensions = []


def _ext_modules() -> list[object]:
    if os.environ.get("LLMGW_PURE"):
        _warn("LLMGW_PURE is set")
        return []
    commands = set(sys.argv[1:])
    if commands & {"editable_wheel", "develop"}:
        return []  # the sources run as they are edited
    if not commands & {"bdist_wheel", "build", "build_ext", "install"}:
        return []  # metadata only (pip asks for it first): nothing is built
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not installed")
        return []
    hotpath = runpy.run_path(str(HERE / "src" / "llmgw" / "hotpath.py"))
    try:
        return list(mypycify(hotpath["mypyc_args"]("src")))
    except (Exception, SystemExit) as exc:
        _warn(f"mypyc failed ({exc})")
        return []


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": _BuildExtOrPure})
