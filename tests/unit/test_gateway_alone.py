"""`llmgw gateway` stands alone: it imports what a gateway needs and not the control plane (issue 42).

A gateway on another machine follows the control plane over the fleet port; it needs the wire
types, the fleet transport, the proxy and its listeners, never the reconciler or its driver. Before
issue 42 `run_gateway` took its port binding from server/app.py, the server's composition root,
and so loaded the whole control plane (control.py, reconcile.py and all they import) on the first
call. Two checks: a fresh interpreter importing the entry modules (what really loads), and the
import graph from the source with imports inside functions counted too (what a call would load).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit.test_imports import import_graph

ENTRY = ("llmgw.cli.gateway", "llmgw.server.gateway.run")
# The reconciler, its driver, the composition root, and the node registry (GatewayMetrics left
# server/metrics.py for server/gateway/metrics.py so that a gateway loads none of it), and the
# control plane's credential checks (the client door left server/auth.py for
# server/gateway/apikeys.py: a worker built a whole Auth to get it).
CONTROL_PLANE = ("llmgw.server.control", "llmgw.server.reconcile", "llmgw.server.app", "llmgw.server.registry",
                 "llmgw.server.auth")
# The gateway's own modules load no catalog either: it is told its models and settings on the feed,
# whose types (llmgw.gwsettings, wire) sit below the catalog. (`llmgw`'s click group still loads
# every command module, the agent's config among them, so the whole command is held to
# CONTROL_PLANE only.)
NOT_A_GATEWAY = (*CONTROL_PLANE, "llmgw.catalog.schema")


@pytest.mark.parametrize("entry", ENTRY)
def test_importing_the_gateway_loads_no_control_plane(entry: str) -> None:
    code = (f"import {entry}, sys; loaded = [m for m in {NOT_A_GATEWAY!r} if m in sys.modules]; "
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_llmgw_gateway_runs_without_the_control_plane() -> None:
    """The command itself, through `llmgw`'s own main, into run_gateway: `--worker 0` without
    --feed-socket is refused inside it, after its imports ran (a subprocess: a fresh interpreter)."""
    code = ("import sys\nfrom llmgw.cli.main import main\n"
            "try:\n    main(['gateway', '--worker', '0'])\nexcept SystemExit as exc:\n    code = exc.code\n"
            f"loaded = [m for m in {CONTROL_PLANE!r} if m in sys.modules]\n"
            "assert code == 2, code\nassert 'llmgw.server.gateway.run' in sys.modules\nassert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--worker needs --feed-socket" in done.stderr


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from `start`, each with the module that first imports it."""
    via = {start: ""}
    todo = [start]
    while todo:
        module = todo.pop()
        for target in sorted(graph.get(module, ())):
            if target not in via:
                via[target] = module
                todo.append(target)
    return via


def _path(via: dict[str, str], module: str) -> str:
    chain = [module]
    while via[chain[-1]]:
        chain.append(via[chain[-1]])
    return " -> ".join(reversed(chain))


def test_no_call_in_the_gateway_imports_the_control_plane() -> None:
    top, lazy = import_graph(), import_graph(in_functions=True)
    graph = {m: top[m] | lazy[m] for m in top}
    via = _reach(graph, "llmgw.server.gateway.run")
    wrong = [_path(via, m) for m in NOT_A_GATEWAY if m in via]
    assert not wrong, "the gateway reaches the control plane:\n" + "\n".join(wrong)
