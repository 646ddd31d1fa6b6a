"""The compiled hot path: the suite runs on what it says it runs on, and what ships compiles
against dependencies mypyc could see.

`make test` runs the suite on the wheel it built, installed in a venv of its own, with
LLMGW_EXPECT_INSTALLED=compiled (or =pure for the compiler-less wheel): tests/conftest.py stops
the run when llmgw comes from anywhere else, and the test here says so again as a test.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import llmgw
from llmgw import hotpath
from tests.conftest import installed_mismatch

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_suite_imports_the_build_it_was_told_to() -> None:
    expect = os.environ.get("LLMGW_EXPECT_INSTALLED")
    if expect:
        assert installed_mismatch(expect) is None
    else:  # the editable .venv (`make unit`, `make e2e`): the sources as edited
        found = hotpath.compiled()
        assert found == [], f"compiled modules in a run on the sources: {found} (from {llmgw.__file__})"


def test_a_run_on_the_wrong_build_stops_before_any_test(tmp_path: Path) -> None:
    """The guard itself: the sources (src/ on the path) are not the installed compiled wheel."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LLMGW_EXPECT_INSTALLED": "compiled"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/unit/test_hotpath.py::test_every_compiled_module_has_its_source_in_the_tree"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "not the build under test: llmgw was imported from" in result.stdout + result.stderr


def test_every_compiled_module_has_its_source_in_the_tree() -> None:
    """What setup.py hands mypyc names a file for each module, and only those."""
    root = str(Path(llmgw.__file__).parent.parent)
    files = [arg for arg in hotpath.mypyc_args(root) if not arg.startswith("--")]
    assert len(files) == len(hotpath.COMPILED)
    for name, file in zip(hotpath.COMPILED, files, strict=True):
        path = Path(file)
        assert path.is_file(), f"{name}: no {path}"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_closure(modules: tuple[str, ...], src: Path) -> dict[str, set[str]]:
    """Third-party top-level names reached from `modules` through llmgw's own imports (those
    mypyc reads for types), each with the llmgw modules that import it."""
    third: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        base = src / name.replace(".", "/")
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            continue  # `from llmgw.x import name`: a name, not a module
        for imported in _imports(path):
            top = imported.split(".")[0]
            if top == "llmgw":
                parts = imported.split(".")
                todo.extend(".".join(parts[:i]) for i in range(2, len(parts) + 1))
            elif top not in sys.stdlib_module_names:
                third.setdefault(top, set()).add(name)
    return third


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _requirement_names(requirements: list[str]) -> dict[str, str]:
    return {_normal(re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0]): req for req in requirements}


def test_what_the_compiled_modules_reach_is_known_to_mypyc_in_an_isolated_build() -> None:
    """pip's isolated build has only build-system.requires: each typed dependency the compiled
    modules reach must be there, with the runtime specifier; the untyped ones must be named in
    [tool.mypy] (mypyc then knows them for unknown, and no compiled module may import one)."""
    src = Path(llmgw.__file__).resolve().parent.parent
    closure = import_closure(hotpath.COMPILED, src)
    build = _requirement_names(PYPROJECT["build-system"]["requires"])
    runtime = _requirement_names(PYPROJECT["project"]["dependencies"])
    untyped = {module for override in PYPROJECT["tool"]["mypy"]["overrides"]
               for module in override["module"] if override.get("ignore_missing_imports")}
    dists = importlib.metadata.packages_distributions()
    assert "prometheus_client" in closure and "trio" in closure, closure  # the scan sees them
    for top, users in sorted(closure.items()):
        if top in untyped:
            assert not users & set(hotpath.COMPILED), f"compiled {sorted(users)} import untyped {top}"
            continue
        dist = _normal(dists[top][0])
        assert dist in build, f"{top} (reached from {sorted(users)}) is not a build requirement"
        assert build[dist] == runtime[dist], f"{dist}: build {build[dist]!r}, runtime {runtime[dist]!r}"


def test_mypyc_is_not_told_to_guess() -> None:
    """An import mypyc cannot find fails the build rather than compiling against `Any`."""
    assert "--ignore-missing-imports" not in hotpath.MYPYC_FLAGS


def test_version_says_how_the_hot_path_runs() -> None:
    """An SRE learns whether this install is the compiled one (the start-up log says the same)."""
    out = subprocess.run([sys.executable, "-m", "llmgw", "--version"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    n = len(hotpath.compiled())
    if n:
        assert f"hot path compiled ({n} of {len(hotpath.COMPILED)} modules)" in out
    else:
        assert "hot path pure Python" in out
