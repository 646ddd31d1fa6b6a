"""No import circles in src/llmgw and no import back up a floor (issue 42).

A circle means neither module can be read, tested or moved without the other, and which one runs
first at start-up decides whether a name exists yet: issue 42 found four (web/server <-> fastserve,
server/api <-> logs, cli/ctl <-> doctor/fabrics, sim/fabric <-> sim/node) after two weeks of speed
work, where the structure issue before it had left none. The graph is built from the source (the
AST), not by importing, so a circle fails here with its modules named, even in a module no test
loads.

What counts: module-level imports, the ones that run when the module is imported (inside `try`
and plain `if` blocks too). Two kinds are left out, on purpose: imports under
`if TYPE_CHECKING:` (read by mypy only, never run) and imports inside a function or method (run on
the call, after every module has loaded: the usual way to load something heavy lazily, such as
rich in a command that may not print). A function-level import that closes a circle is still a
circle a reader has to hold in their head, so `test_function_level_circles_are_listed` prints
those too, as a softer listing that fails nothing (none are left since issue 42; `pytest -s`
shows it). An arrow goes to the module named (`from llmgw.a import b` to llmgw.a.b when b is a
module, else to llmgw.a); the package __init__ files an import also runs are not arrows of it.

The floors (DESIGN.md, "Layout"): the pure packages wire, catalog, fabric, placement and doctor are
read by the edges and never read them back, so none of them imports server, agent, cli or web;
and the catalog (the config schema) and the fleet protocol (wire) do not import each other: what
both need lives below both, in llmgw/names.py (id and model-name patterns), llmgw/units.py
(durations, sizes) and llmgw/gwsettings.py (the gateway's settings, which the config declares and
the gateway feed carries). Issue 42 found the arrow one way (catalog -> wire, for the id patterns)
and then the other (wire/gateway.py -> catalog.schema and catalog.units).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import llmgw

SRC = Path(llmgw.__file__).resolve().parent
PURE_FLOORS = ("wire", "catalog", "fabric", "placement", "doctor")
EDGES = ("server", "agent", "cli", "web")
# (importer floor, imported floor): an arrow back up, beyond the pure-floor/edge rule.
BACK_ARROWS = (("catalog", "wire"), ("wire", "catalog"))


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, *, in_functions: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The module's import statements: run at import time, or (in_functions) inside functions."""

    def walk(nodes: list[ast.stmt], in_function: bool) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if in_function == in_functions:
                    yield node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, True)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.orelse, in_function)
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        stmts = [c for c in children if isinstance(c, ast.stmt)]
                        for child in children:
                            if isinstance(child, (ast.ExceptHandler, ast.match_case)):
                                stmts.extend(child.body)
                        yield from walk(stmts, in_function)

    yield from walk(tree.body, False)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The llmgw modules an import statement loads (its package's __init__ aside)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([base] if base else [])])
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("llmgw") and name != module:
            out.add(name)
    return out


def import_graph(*, in_functions: bool = False) -> dict[str, set[str]]:
    """module -> the llmgw modules it imports (module level; or only inside functions)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(tree, in_functions=in_functions):
            edges |= _targets(module, is_package, node, known)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    arrows = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"circle of {len(component)}: " + "; ".join(arrows)


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_sees_relative_and_from_imports() -> None:
    graph, lazy = import_graph(), import_graph(in_functions=True)
    assert "llmgw.wire.envelope" in graph["llmgw.wire"]  # `from llmgw.wire.envelope import ...`
    assert "llmgw.cli.logs" in graph["llmgw.cli.gateway"]
    assert "llmgw.server.gateway.run" in lazy["llmgw.cli.gateway"]  # inside the command
    assert "llmgw.server.gateway.run" not in graph["llmgw.cli.gateway"]


def test_circles_are_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert _describe(["a", "b", "c"], graph) == "circle of 3: a -> b; b -> c; c -> a"


def test_no_import_circles() -> None:
    graph = import_graph()
    found = [_describe(c, graph) for c in circles(graph)]
    assert not found, "import circles (move the shared piece down into the module it belongs to):\n" + "\n".join(found)


def test_no_import_back_up_a_floor() -> None:
    wrong = []
    for module, imported in sorted(import_graph().items()):
        floor = _floor(module)
        for target in sorted(imported):
            up = _floor(target)
            if (floor in PURE_FLOORS and up in EDGES) or (floor, up) in BACK_ARROWS:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports back up a floor:\n" + "\n".join(wrong)


def test_no_wire_module_imports_the_catalog() -> None:
    """At import or on a call: the fleet protocol and the gateway feed are read by agents, servers
    and gateways of other versions and stand on nothing above them (wire/gateway.py took the
    gateway's settings and the duration hooks from the catalog before issue 42)."""
    top, lazy = import_graph(), import_graph(in_functions=True)
    wrong = sorted(f"{module} -> {target}" for module in top for target in top[module] | lazy[module]
                   if _floor(module) == "wire" and _floor(target) == "catalog")
    assert not wrong, "wire imports the catalog:\n" + "\n".join(wrong)


def test_function_level_circles_are_listed() -> None:
    """Softer: circles closed by imports inside functions. Printed (pytest -s), never failed."""
    graph = import_graph()
    lazy = import_graph(in_functions=True)
    both = {m: graph[m] | lazy[m] for m in graph}
    found = [_describe(c, both) for c in circles(both)]
    print("\n".join(["function-level import circles:", *found]) if found else "no function-level circles")


def _private_imports(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("llmgw"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.lineno, node.module or "", alias.name


def test_no_module_imports_another_modules_private_names() -> None:
    """A leading underscore says "mine": the fast lane took `_peek`, `_request_id` and `_Attempt`
    from proxy.py and `_Conn` from web/client.py (issue 42), so neither could change alone."""
    found = [f"{path.relative_to(SRC.parent)}:{line} imports {name} from {module}"
             for module_name, path in _modules().items()
             for line, module, name in _private_imports(ast.parse(path.read_text(encoding="utf-8")))
             if module != module_name]
    assert not found, "\n".join(found)


def test_a_private_import_is_found() -> None:
    tree = ast.parse("from llmgw.web.client import Upstream, _Conn\nfrom llmgw.x import __version__\n")
    assert list(_private_imports(tree)) == [(1, "llmgw.web.client", "_Conn")]
