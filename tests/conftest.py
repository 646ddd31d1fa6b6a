"""The suite runs on the build it was told to (issue 36: it passed on one build while users ran
another that crashed at start).

`make test` sets LLMGW_EXPECT_INSTALLED to `compiled` or `pure` and runs pytest in a venv that
holds only the wheel it built: then llmgw must come from that venv's site-packages (never from
src/), and its hot path must be compiled or pure as said. Anything else stops the run before
the first test, with one line that says what was imported instead.
"""

from __future__ import annotations

import os

import pytest


def installed_mismatch(expect: str) -> str | None:
    """Why this interpreter's llmgw is not the install `expect` names, or None when it is."""
    import sys
    import sysconfig
    from pathlib import Path

    import llmgw
    from llmgw import hotpath

    if expect not in ("compiled", "pure"):
        return f"LLMGW_EXPECT_INSTALLED={expect!r}: expected 'compiled' or 'pure'"
    where = Path(llmgw.__file__).resolve().parent
    site = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    if where.parent not in site:
        return f"llmgw was imported from {where}, not from this venv's site-packages ({sys.prefix})"
    found = hotpath.compiled()
    if expect == "compiled" and found != list(hotpath.COMPILED):
        return f"the installed hot path is not compiled: {sorted(set(hotpath.COMPILED) - set(found))} pure"
    if expect == "pure" and found:
        return f"the pure install has compiled modules: {found}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    """The processes tests start write to pipes and files, as under cron: pytest-xdist's workers
    set COLUMNS=80 and LINES=24, which the tables of `llmgw ctl` would then be cut to."""
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


def pytest_sessionstart(session: pytest.Session) -> None:
    expect = os.environ.get("LLMGW_EXPECT_INSTALLED")
    if expect:
        why = installed_mismatch(expect)
        if why:
            pytest.exit(f"not the build under test: {why}", returncode=3)


def nvml_unavailable() -> str | None:
    """Why this machine has no real NVML with a GPU behind it, or None when it has one."""
    try:
        import pynvml
    except ImportError:
        return "the nvidia-ml-py package is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound where no driver is installed
        return f"nvmlInit failed: {type(exc).__name__}: {exc}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    return None if count else "NVML lists no GPUs"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need a real NVML (issue 44): skipped where there is none, which is every
    machine `make test` runs on. LLMGW_GPU_TESTS=require (tools/device-check.sh, on a machine
    lent with a GPU) runs them regardless, so that an NVML that fails there fails them, not
    skips them."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu or os.environ.get("LLMGW_GPU_TESTS") == "require":
        return
    why = nvml_unavailable()
    if why:
        skip = pytest.mark.skip(reason=f"needs a real NVML and GPU ({why})")
        for item in gpu:
            item.add_marker(skip)
