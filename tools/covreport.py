"""Coverage with the e2e processes counted (`make coverage`).

Most of the server's wiring (server/app.py, api.py, control.py, agent/run.py) runs only in the
processes the e2e tests start, so a coverage run of pytest alone reads it as 0 %. `make coverage`
therefore measures every Python process of the run:

- `hook`: writes a .pth file into the virtual environment's site-packages that starts coverage
  in each interpreter when COVERAGE_PROCESS_START names a config (coverage.process_startup);
  without that variable it does nothing, so `make test` is not slowed or changed.
- the Makefile then runs pytest (unit and e2e) with COVERAGE_PROCESS_START and an absolute
  COVERAGE_FILE, so the server, agents and engines write their data beside pytest's own,
  whatever directory they run in;
- `report`: combines the data files and prints one line per package, then the wiring files
  alone with the target they must meet (exit 1 below it).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PTH_NAME = "llmgw-coverage.pth"
# `import` lines of a .pth file are executed at start-up; os is already imported by then.
PTH_LINE = (
    "import os; exec('import coverage; coverage.process_startup()') "
    "if os.environ.get('COVERAGE_PROCESS_START') else None\n"
)
WIRING = ("server/app.py", "server/api.py", "server/control.py", "agent/run.py")
WIRING_TARGET = 80.0  # percent, issue 22: the wiring is what only e2e tests reach


def hook() -> int:
    site_packages = Path(sysconfig.get_paths()["purelib"])
    target = site_packages / PTH_NAME
    if not target.exists() or target.read_text() != PTH_LINE:
        target.write_text(PTH_LINE)
    print(f"coverage start-up hook: {target}")
    return 0


def report(data_file: Path) -> int:
    import coverage

    cov = coverage.Coverage(data_file=str(data_file), config_file=str(ROOT / "pyproject.toml"))
    cov.combine(keep=False)
    cov.save()
    cov.load()
    src = ROOT / "src" / "llmgw"
    packages: dict[str, list[int]] = {}
    files: dict[str, tuple[int, int]] = {}
    for measured in sorted(cov.get_data().measured_files()):
        path = Path(measured)
        try:
            rel = path.resolve().relative_to(src)
        except ValueError:
            continue  # not ours (a test file, a tool)
        _, statements, _, missing, _ = cov.analysis2(measured)
        package = "llmgw" + "".join(f".{p}" for p in rel.parent.parts)
        totals = packages.setdefault(package, [0, 0])
        totals[0] += len(statements)
        totals[1] += len(missing)
        files[rel.as_posix()] = (len(statements), len(missing))
    # Modules no process imported count too, as 0 %.
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel.as_posix() in files:
            continue
        statements = cov.analysis2(str(path))[1]
        package = "llmgw" + "".join(f".{p}" for p in rel.parent.parts)
        totals = packages.setdefault(package, [0, 0])
        totals[0] += len(statements)
        totals[1] += len(statements)
        files[rel.as_posix()] = (len(statements), len(statements))

    def pct(statements: int, missing: int) -> float:
        return 100.0 * (statements - missing) / statements if statements else 100.0

    print(f"{'package':<28} {'stmts':>6} {'miss':>6} {'cover':>6}")
    all_statements = all_missing = 0
    for package, (statements, missing) in sorted(packages.items()):
        all_statements += statements
        all_missing += missing
        print(f"{package:<28} {statements:>6} {missing:>6} {pct(statements, missing):>5.0f}%")
    print(f"{'total':<28} {all_statements:>6} {all_missing:>6} {pct(all_statements, all_missing):>5.0f}%")
    print()
    print(f"the wiring (reached only through e2e processes), target {WIRING_TARGET:g} %:")
    below = []
    wiring_statements = wiring_missing = 0
    for name in WIRING:
        statements, missing = files.get(name, (0, 0))
        wiring_statements += statements
        wiring_missing += missing
        figure = pct(statements, missing)
        if figure < WIRING_TARGET:
            below.append(name)
        print(f"  {'llmgw/' + name:<26} {statements:>6} {missing:>6} "
              f"{figure:>5.0f}%{'  BELOW TARGET' if figure < WIRING_TARGET else ''}")
    print(f"  {'together':<26} {wiring_statements:>6} {wiring_missing:>6} "
          f"{pct(wiring_statements, wiring_missing):>5.0f}%")
    if below:
        print(f"coverage: below {WIRING_TARGET:g} %: {', '.join(below)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="coverage with the e2e processes counted")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("hook", help="install the start-up hook into this virtual environment")
    rep = sub.add_parser("report", help="combine the data files and report per package")
    rep.add_argument("--data-file", type=Path, default=ROOT / ".coverage")
    opts = parser.parse_args(argv)
    if opts.command == "hook":
        return hook()
    return report(opts.data_file)


if __name__ == "__main__":
    sys.exit(main())
