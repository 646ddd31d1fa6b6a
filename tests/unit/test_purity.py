"""The pure cores stay pure: no trio, no sockets, no filesystem, no clock (DESIGN.md, "Layout").

Every module listed here is bytes or values in, values out, with time passed in as a number. Two
checks, because each misses what the other sees: the module's own source (an `import os` or an
`open(...)` anywhere in it, even in a branch no test runs), and what importing it really loads
(a pure-looking import of an impure llmgw module). A new pure module belongs in PURE; a module
that gains I/O fails here and should move its I/O to an edge (fleet, server, agent, cli).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import llmgw

PURE = [
    "llmgw.errors",
    "llmgw.names",
    "llmgw.units",
    "llmgw.gwsettings",
    "llmgw.netaddr",
    "llmgw.verdict",
    "llmgw.doctor",
    "llmgw.doctor.facts",
    "llmgw.doctor.node",
    "llmgw.doctor.cluster",
    "llmgw.doctor.gpu",
    "llmgw.doctor.xid",
    "llmgw.doctor.catalog",
    "llmgw.doctor.versions",
    "llmgw.doctor.hwcounters",
    "llmgw.wire",
    "llmgw.wire.envelope",
    "llmgw.wire.caps",
    "llmgw.wire.ids",
    "llmgw.wire.messages",
    "llmgw.wire.gateway",
    "llmgw.wire.shardstate",
    "llmgw.catalog",
    "llmgw.catalog.load",
    "llmgw.catalog.redirects",
    "llmgw.catalog.schema",
    "llmgw.catalog.sources",
    "llmgw.catalog.units",
    "llmgw.fabric",
    "llmgw.fabric.sysfs",
    "llmgw.fabric.declared",
    "llmgw.fabric.hca",
    "llmgw.fabric.gputopo",
    "llmgw.agent.launch_env",
    "llmgw.agent.xid_log",
    "llmgw.agent.decide",
    "llmgw.sim.profiles",
    "llmgw.sim.identity",
    "llmgw.fabric.topology",
    "llmgw.fabric.locality",
    "llmgw.fabric.ibnetdiscover",
    "llmgw.fabric.analysis",
    "llmgw.fabric.crosscheck",
    "llmgw.fabric.subnet",
    "llmgw.fabric.perftest",
    "llmgw.fabric.linkrate",
    "llmgw.fabric.railtest",
    "llmgw.fabric.qpretry",
    "llmgw.placement",
    "llmgw.placement.gpus",
    "llmgw.placement.single",
    "llmgw.placement.multi",
    "llmgw.placement.spread",
    "llmgw.agent.engines.multinode",
    "llmgw.server.admit",
    "llmgw.server.links",
    "llmgw.server.observe",
    "llmgw.server.moves",
    "llmgw.server.lost",
    "llmgw.server.remedy",
    "llmgw.server.restart",
    "llmgw.server.rollout",
    "llmgw.server.reconcile",
    "llmgw.server.replicas",
    "llmgw.server.states",
    "llmgw.server.registry",
    "llmgw.server.gateway.admission",
    "llmgw.server.gateway.balance",
    "llmgw.server.gateway.breaker",
    "llmgw.server.gateway.enginemetrics",
    "llmgw.server.gateway.openai_api",
    "llmgw.server.gateway.retry",
    "llmgw.server.gateway.attempt",
    "llmgw.server.gateway.phases",
    "llmgw.web.http1",
    "llmgw.web.assets",
    "llmgw.server.admin.traffic",
    "llmgw.server.forgery",
    "llmgw.sim.latency",
    "llmgw.sim.metrics",
    "llmgw.sim.openai_api",
    "llmgw.sim.embeddings",
    "llmgw.cli.candidates",
]

# Top-level modules a pure module must not import: event loop, network, processes, files, clock.
FORBIDDEN_IMPORTS = {
    "trio", "anyio", "asyncio", "socket", "ssl", "select", "selectors", "subprocess", "threading",
    "multiprocessing", "os", "pathlib", "shutil", "tempfile", "glob", "io", "fcntl", "mmap", "time",
    "datetime", "h2", "h11", "httpx", "urllib", "http.client", "sqlite3", "logging",
}
FORBIDDEN_CALLS = {"open", "print", "input", "breakpoint"}
# Methods that reach the file system whatever their object (a Path, a resources Traversable):
# I/O a pure module would otherwise do through an object handed in, with no import to show it.
FORBIDDEN_METHODS = {
    "read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "rglob", "unlink", "mkdir", "rmdir",
    "touch", "symlink_to", "chmod", "is_file", "is_dir", "exists", "stat", "lstat", "samefile",
}
# What importing a pure module must not load, checked in a fresh interpreter.
FORBIDDEN_LOADED = ("trio", "socket", "ssl", "selectors", "subprocess", "asyncio", "h2", "httpx")

# The few edges a pure package keeps, each named with its reason. Nothing else is allowed.
ALLOWED = {
    # load_config reads the one file named on the command line, then hands the text to the
    # pure parse_config; every error it raises names that file.
    ("llmgw.catalog.load", "open"),
}

# The tree the suite imports llmgw from: src/, or the installed wheel `make test` builds, which
# keeps every .py beside the extension built from it.
SRC = Path(llmgw.__file__).resolve().parents[1]
PURE_PACKAGES = ("wire", "catalog", "fabric", "placement", "doctor")  # every module in these is pure


def _source(module: str) -> tuple[Path, ast.Module]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} not found"
    path = Path(spec.origin)
    if path.suffix == ".so":  # compiled: its source is beside it
        path = path.with_name(path.name.split(".")[0] + ".py")
    return path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _type_only(tree: ast.Module) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`: imports there are for annotations and load nothing."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return skip


def _impurities(module: str) -> list[str]:
    path, tree = _source(module)
    found = []
    type_only = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in FORBIDDEN_IMPORTS or name in FORBIDDEN_IMPORTS:
                found.append(f"{path.name}:{node.lineno} imports {name}")
            elif top == "llmgw" and name not in PURE:
                found.append(f"{path.name}:{node.lineno} imports {name}, which is not in the pure list")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in FORBIDDEN_CALLS
            and (module, node.func.id) not in ALLOWED
        ):
            found.append(f"{path.name}:{node.lineno} calls {node.func.id}()")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FORBIDDEN_METHODS:
            found.append(f"{path.name}:{node.lineno} calls .{node.func.attr}()")
    return found


def test_io_through_a_method_call_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure module handed a Path reads no import to betray it: web/assets.py read its files so."""
    (tmp_path / "sneaky_pure.py").write_text("def load(root):\n    return {p.name: p.read_bytes() for p in "
                                             "root.iterdir()}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = _impurities("sneaky_pure")
    assert any("calls .read_bytes()" in f for f in found) and any("calls .iterdir()" in f for f in found), found


def test_every_pure_module_exists_under_src() -> None:
    for module in PURE:
        path, _ = _source(module)
        assert SRC in path.parents, f"{module} resolves to {path}, not under {SRC}"


def test_every_module_of_a_pure_package_is_listed() -> None:
    for package in PURE_PACKAGES:
        for path in sorted((SRC / "llmgw" / package).glob("*.py")):
            name = f"llmgw.{package}" if path.stem == "__init__" else f"llmgw.{package}.{path.stem}"
            assert name in PURE, f"{path} is in a pure package: list it in PURE"


@pytest.mark.parametrize("module", PURE)
def test_a_pure_module_imports_no_io_and_calls_no_io(module: str) -> None:
    assert _impurities(module) == []


def test_importing_the_pure_modules_loads_no_event_loop_or_socket() -> None:
    """Each module in its own fresh interpreter, all at once: sys.modules after importing just it."""
    check = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); "
        f"print(','.join(m for m in {FORBIDDEN_LOADED!r} if m in sys.modules))"
    )
    procs = {
        module: subprocess.Popen([sys.executable, "-c", check, module], stdout=subprocess.PIPE, text=True)
        for module in PURE
    }
    loaded = {}
    for module, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"importing {module} failed"
        if out.strip():
            loaded[module] = out.strip()
    assert loaded == {}


def test_the_check_catches_what_it_is_for() -> None:
    """The AST check fails on an impure module (so a green run means something)."""
    assert any("imports trio" in line for line in _impurities("llmgw.sim.engine"))
    assert any("calls open()" in line or "imports os" in line for line in _impurities("llmgw.fsutil"))
