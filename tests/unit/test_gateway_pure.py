"""The gateway's policy modules stay pure: importing them pulls in no trio and no I/O stack."""

from __future__ import annotations

import os
import subprocess
import sys

# `make coverage` starts coverage in every interpreter (which imports socket): not in this child.
NO_COVERAGE = {k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_START"}

PURE = ["balance", "breaker", "retry", "admission", "enginemetrics"]


def test_policy_modules_do_not_import_trio() -> None:
    code = (
        "import sys\n"
        + "".join(f"import llmgw.server.gateway.{m}\n" for m in PURE)
        + "bad = sorted(m for m in ('trio', 'httpx', 'h11', 'h2', 'socket') if m in sys.modules)\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=NO_COVERAGE
    ).stdout.strip()
    assert out == "", f"pure modules imported: {out}"
