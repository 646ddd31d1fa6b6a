"""The simulated engine's pure modules import no trio and no network stack (DESIGN.md)."""

from __future__ import annotations

import os
import subprocess
import sys

# `make coverage` starts coverage in every interpreter (which imports socket): not in this child.
NO_COVERAGE = {k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_START"}

PURE = ("llmgw.sim.latency", "llmgw.sim.metrics", "llmgw.sim.openai_api", "llmgw.web.http1")


def test_pure_modules_import_no_io_stack() -> None:
    code = (
        "import sys\n"
        f"for m in {PURE!r}: __import__(m)\n"
        "bad = sorted(m for m in ('trio', 'h11', 'socket', 'httpx', 'asyncio') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=NO_COVERAGE
    ).stdout.strip()
    assert out == "", f"pure sim modules pulled in: {out}"
