"""Plant known bugs one at a time and check that the tests catch each (`make mutants`).

A green run of `make test` should mean the code works, wiring included. This is the check that
it does: a fixed list of small, realistic bugs (a rank swapped, a check dropped, a bound off by
one), each applied to a temporary copy of `src/` and `tests/` (never the working tree) and run
against the tests that are meant to catch it. The list (`tools/mutantlist/`) started with the
bugs a mutation check of issue 22 found slipping through and the pure cores (`core.py`); issue
37 added one per rule that decides something in the code of the fabric wave and later
(`fabric.py`: fabric analysis, placement across a spine, spread, weights, drain, doctor, the
doors, `ctl` rendering, the control plane's wiring).

Each mutant runs against its unit tests first, then, only when they miss it, its e2e tests:

- caught: the unit tests failed (pytest exit 1) or hung past the limit.
- caught by e2e only: the unit tests passed, the e2e tests failed. Acceptable for wiring that
  only real processes reach; a unit test would be quicker.
- NOT CAUGHT: every test passed with the bug in place. The tests need work.
- A mutant whose `old` text is not found exactly once, whose mutated file no longer parses, or
  whose run cannot even collect the tests (pytest exit 2-5), is an error of this list: the code
  moved or the mutant is wrong. It fails the run loudly rather than counting as caught.
  `tests/unit/test_tools_mutants.py` runs the same check of the list in `make test` (no test
  run: milliseconds), so a refactoring that moves a mutant's text fails CI with its name.

The unmutated copy is run first against every selected unit test, and against a mutant's e2e
tests before they first run; a failure there stops the run (a test that fails anyway would make
every mutant look caught).

    .venv/bin/python tools/mutants.py            # all; exit 0 only when every mutant is caught
    .venv/bin/python tools/mutants.py --list
    .venv/bin/python tools/mutants.py surplus-ready-before-starting breaker-opens-late
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

from mutantlist import MUTANTS, Mutant  # noqa: E402  (tools/ is not a package)
from mutantlist.core import CORE  # noqa: E402

LIMIT = 300.0  # seconds one mutant's tests may take; past it, the mutant counts as caught (hung)


class ListError(Exception):
    """The mutant list no longer matches the code (or a mutant is broken)."""


def copy_tree(dest: Path) -> None:
    """src/, tests/ and pyproject.toml (pytest's settings) into dest, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".hypothesis", ".pytest_cache")
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The copy's src comes before the editable install's path, in pytest and in every process
    # an e2e test starts; no bytecode, so a file restored within the same second is recompiled.
    env["PYTHONPATH"] = os.pathsep.join([str(copy / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("COVERAGE_PROCESS_START", None)
    return env


def pytest(copy: Path, env: dict[str, str], args: tuple[str, ...], limit: float) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        result = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out
    return result.returncode, result.stdout + result.stderr


def check_list(mutants: tuple[Mutant, ...]) -> None:
    """Every `old` text occurs exactly once in its file, the mutated file still parses and every
    test file a mutant names exists: a list that no longer matches the code says so, by name,
    before anything runs."""
    problems = []
    for mutant in mutants:
        path = ROOT / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.name}: {mutant.file} does not exist")
            continue
        text = path.read_text()
        count = text.count(mutant.old)
        if count != 1:
            where = "is no longer found" if count == 0 else f"occurs {count} times"
            problems.append(f"{mutant.name}: the text to mutate {where} in {mutant.file}: {mutant.old!r}")
        elif mutant.old == mutant.new:
            problems.append(f"{mutant.name}: the mutant changes nothing")
        elif path.suffix == ".py":
            try:
                ast.parse(text.replace(mutant.old, mutant.new, 1))
            except SyntaxError as exc:
                problems.append(f"{mutant.name}: the mutated {mutant.file} does not parse: {exc}")
        if not mutant.unit and not mutant.e2e:
            problems.append(f"{mutant.name}: no tests named")
        for arg in _files(mutant.unit) + _files(mutant.e2e):
            if not (ROOT / arg.split("::")[0]).exists():
                problems.append(f"{mutant.name}: {arg.split('::')[0]} does not exist")
    names = [m.name for m in mutants]
    problems += [f"{n}: the name is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ListError("the mutant list does not match the code (it moved?):\n  " + "\n  ".join(problems))


def _files(args: tuple[str, ...]) -> list[str]:
    """The files and test ids among pytest arguments (a -k expression selects within them)."""
    return [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-k")]


def _baseline(copy: Path, env: dict[str, str], args: tuple[str, ...], limit: float) -> None:
    """The unmutated copy passes these tests, or nothing the mutants show would mean anything."""
    rc, out = pytest(copy, env, args, limit)
    if rc != 0:
        print(out[-6000:])
        raise ListError(f"the tests fail without any mutant (pytest exit {rc}: {' '.join(args)}); fix that first")


def _verdict(rc: int | None, out: str, mutant: Mutant, limit: float) -> str | None:
    """'caught', 'hung' or None (the tests passed); a run that did not even collect raises."""
    if rc == 1:
        return "caught"
    if rc is None:
        return "hung"
    if rc == 0:
        return None
    print(out[-4000:])
    raise ListError(f"{mutant.name}: pytest exit {rc} (not a test failure: the mutant "
                    f"does not import or the tests were not collected); fix the list")


def run(mutants: tuple[Mutant, ...], limit: float) -> int:
    check_list(mutants)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmgw-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        env = environment(copy)
        probe = subprocess.run([sys.executable, "-c", "import llmgw; print(llmgw.__file__)"],
                               env=env, cwd=copy, capture_output=True, text=True, check=True)
        if not probe.stdout.strip().startswith(str(copy / "src")):
            raise ListError(f"the copy is not what Python imports: llmgw comes from {probe.stdout.strip()}")

        selected: list[str] = []  # every unit test file or id the mutants name
        for mutant in mutants:
            selected += [a for a in _files(mutant.unit) if a not in selected]
        started = time.monotonic()
        print(f"baseline: the unmutated copy against {len(selected)} unit test selections ...", flush=True)
        _baseline(copy, env, tuple(selected), limit * 4)
        print(f"baseline: green in {time.monotonic() - started:.0f}s", flush=True)
        green: set[tuple[str, ...]] = set()  # e2e selections run green unmutated (each once, when first needed)

        by_unit: list[str] = []
        by_e2e: list[str] = []
        missed: list[str] = []
        for mutant in mutants:
            path = copy / mutant.file
            original = path.read_text()
            path.write_text(original.replace(mutant.old, mutant.new, 1))
            started = time.monotonic()
            try:
                verdict = None
                if mutant.unit:
                    verdict = _verdict(*pytest(copy, env, mutant.unit, limit), mutant, limit)
                    tests = " ".join(mutant.unit)
                if verdict is not None:
                    by_unit.append(mutant.name)
                elif mutant.e2e:
                    tests = " ".join(mutant.e2e)
                    if mutant.e2e not in green:
                        path.write_text(original)
                        _baseline(copy, env, mutant.e2e, limit)
                        green.add(mutant.e2e)
                        path.write_text(original.replace(mutant.old, mutant.new, 1))
                    verdict = _verdict(*pytest(copy, env, mutant.e2e, limit), mutant, limit)
                    if verdict is not None:
                        verdict = f"e2e only ({verdict})" if verdict != "caught" else "e2e only"
                        by_e2e.append(mutant.name)
            finally:
                path.write_text(original)
            if verdict is None:
                verdict = "NOT CAUGHT"
                missed.append(mutant.name)
            elif verdict == "hung":
                verdict = f"caught (hung past {limit:g}s)"
            print(f"{verdict:<14} {mutant.name:<45} {time.monotonic() - started:5.1f}s  {tests}", flush=True)
    core = sum(1 for m in mutants if m in CORE)
    print()
    print(f"{len(mutants)} mutants ({len(mutants) - core} in code since 1 Dec, {core} before): "
          f"{len(by_unit)} caught by unit tests, {len(by_e2e)} caught by e2e only, {len(missed)} survived, "
          f"in {time.monotonic() - began:.0f}s")
    if missed:
        print(f"NOT CAUGHT: {', '.join(missed)}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these mutants (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--limit", type=float, default=LIMIT, help="seconds per mutant (default %(default)g)")
    opts = parser.parse_args(argv)
    if opts.list:
        for mutant in MUTANTS:
            print(f"{mutant.name:<45} {mutant.file}")
        return 0
    chosen = MUTANTS
    if opts.names:
        unknown = sorted(set(opts.names) - {m.name for m in MUTANTS})
        if unknown:
            print(f"mutants: no mutant named {', '.join(unknown)} (see --list)", file=sys.stderr)
            return 2
        chosen = tuple(m for m in MUTANTS if m.name in opts.names)
    try:
        return run(chosen, opts.limit)
    except ListError as exc:
        print(f"mutants: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
