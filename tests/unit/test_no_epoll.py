"""llmgw imports, and its relay hub stands aside, on a platform whose select module has no epoll
(macOS, the BSDs): simulated in a fresh interpreter by removing select's epoll names before any
llmgw module is imported. (trio is imported first, as it picks its own I/O backend then; on such
a platform it picks kqueue.) The streams themselves take the portable path: see
test_gateway_relay_paths and test_web_relay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import llmgw

NO_EPOLL = """
import importlib, pkgutil, select, sys
import trio
for name in [n for n in dir(select) if n.lower().startswith("epoll")]:
    delattr(select, name)
import llmgw
failed = []
for module in pkgutil.walk_packages(llmgw.__path__, "llmgw."):
    if module.name == "llmgw.__main__":
        continue
    try:
        importlib.import_module(module.name)
    except Exception as exc:
        failed.append(f"{module.name}: {type(exc).__name__}: {exc}")
from llmgw.web.relay import RelayHub
hub = RelayHub()
print("splices", hub.splices)
print("\\n".join(failed) or "all imported")
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_where_select_has_no_epoll() -> None:
    src = str(Path(llmgw.__file__).resolve().parent.parent)
    result = subprocess.run([sys.executable, "-c", NO_EPOLL], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["splices False", "all imported"], result.stdout + result.stderr
