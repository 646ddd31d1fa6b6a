"""Plant known bugs one at a time and check that the tests catch each (`make mutants`).

A green run of `make test` should mean the code works, wiring included. This is the check that
it does: a fixed list of small, realistic bugs (a rank swapped, a check dropped, a bound off by
one), each applied to a temporary copy of `src/` and `tests/` (never the working tree) and run
against the tests that are meant to catch it. Every one must be caught; the list started with
the bugs a mutation check of issue 22 found slipping through (surplus priority, the node-id and
certificate checks, the gateway's outcome reporting, the CL+TE refusal, the key-permission test
that skipped as root) and covers the pure cores (envelope, HTTP/1.1 framing, breaker, retry
budget, placement, reconciler).

- caught: the tests failed (pytest exit 1) or hung past the limit.
- NOT CAUGHT: the tests passed with the bug in place. The tests need work.
- A mutant whose `old` text is not found exactly once, or whose run cannot even collect the
  tests (pytest exit 2-5, e.g. the new text does not import), is an error of this list: the
  code moved or the mutant is wrong. It fails the run loudly rather than counting as caught.

The unmutated copy is run first against every selected test; a failure there stops the run
(a test that fails anyway would make every mutant look caught).

    .venv/bin/python tools/mutants.py            # all; exit 0 only when every mutant is caught
    .venv/bin/python tools/mutants.py --list
    .venv/bin/python tools/mutants.py surplus-ready-before-starting breaker-opens-late
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 300.0  # seconds one mutant's tests may take; past it, the mutant counts as caught (hung)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # exact text; must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions


RECONCILE = ("tests/unit/test_reconcile.py",)
FLEET_REGISTER = ("tests/unit/test_fleet_register.py",)
ENVELOPE = ("tests/unit/test_envelope.py",)
HTTP1 = ("tests/unit/test_http1.py",)
BREAKER = ("tests/unit/test_gateway_breaker.py",)
RETRY = ("tests/unit/test_gateway_retry.py",)
PLACEMENT = ("tests/unit/test_placement.py",)

MUTANTS: tuple[Mutant, ...] = (
    # -- the planted bugs of issue 22 ---------------------------------------------------------
    Mutant(
        "surplus-ready-before-starting",
        "src/llmgw/server/reconcile.py",
        '"starting": 2, "ready": 3,',
        '"starting": 3, "ready": 2,',
        RECONCILE,
    ),
    Mutant(
        "register-node-id-unchecked",
        "src/llmgw/server/fleet_service.py",
        "if not _valid_node_id(node_id):",
        "if False:",
        FLEET_REGISTER,
    ),
    Mutant(
        "register-certificate-name-unchecked",
        "src/llmgw/server/fleet_service.py",
        "if self.require_identity and identity != node_id:",
        "if False:",
        FLEET_REGISTER,
    ),
    Mutant(
        "gateway-outcome-always-success",
        "src/llmgw/server/gateway/proxy.py",
        "balancer.release(pick, trio.current_time(), ok=outcome,",
        "balancer.release(pick, trio.current_time(), ok=True,",
        ("tests/e2e/test_gateway.py::test_engine_killed_mid_run_loses_no_request",),
    ),
    Mutant(
        "http1-content-length-with-transfer-encoding",
        "src/llmgw/web/http1.py",
        "if msg.chunked and content_length is not None:",
        "if False:",
        ("tests/unit/test_web_server.py", "-k", "malformed"),
    ),
    Mutant(
        "tls-unreadable-key-not-explained",
        "src/llmgw/tls/context.py",
        "    except PermissionError:\n",
        "    except NotADirectoryError:\n",
        ("tests/unit/test_tls_context.py::test_unreadable_key",),
    ),
    # -- the reconciler ---------------------------------------------------------------------
    Mutant(
        "surplus-oldest-first",
        "src/llmgw/server/reconcile.py",
        "-r.seen_at, r.id",
        "r.seen_at, r.id",
        RECONCILE,
    ),
    Mutant(
        "surplus-failed-before-pending",
        "src/llmgw/server/reconcile.py",
        '{"pending": 0, "failed": 1,',
        '{"pending": 1, "failed": 0,',
        RECONCILE,
    ),
    Mutant(
        "unreachable-node-loses-its-replicas",
        "src/llmgw/server/reconcile.py",
        'if state != "lost":\n            return  # unreachable',
        'if state not in ("lost", "unreachable"):\n            return  # unreachable',
        RECONCILE,
    ),
    Mutant(
        "backoff-not-exponential",
        "src/llmgw/server/reconcile.py",
        "self.settings.backoff_initial * 2 ** (replica.failures - 1)",
        "self.settings.backoff_initial * replica.failures",
        RECONCILE,
    ),
    Mutant(
        "stop-not-resent-after-reconnect",
        "src/llmgw/server/reconcile.py",
        "shard.stop_sent = False  # the Stop may have been lost",
        "shard.stop_sent = True  # the Stop may have been lost",
        RECONCILE,
    ),
    # -- the wire envelope ------------------------------------------------------------------
    Mutant(
        "envelope-limit-off-by-one",
        "src/llmgw/wire/envelope.py",
        "if length > self.max_message:",
        "if length > self.max_message + 1:",
        ENVELOPE,
    ),
    Mutant(
        "envelope-compressed-accepted",
        "src/llmgw/wire/envelope.py",
        "if flags & FLAG_COMPRESSED:",
        "if False:",
        ENVELOPE,
    ),
    Mutant(
        "envelope-unknown-flags-accepted",
        "src/llmgw/wire/envelope.py",
        "if flags & ~(FLAG_COMPRESSED | FLAG_END_STREAM):",
        "if flags & ~(0xFF):",
        ENVELOPE,
    ),
    # -- HTTP/1.1 framing -------------------------------------------------------------------
    Mutant(
        "http1-conflicting-content-lengths",
        "src/llmgw/web/http1.py",
        "if content_length is not None and content_length != n:",
        "if False:",
        HTTP1,
    ),
    Mutant(
        "http1-bad-header-name",
        "src/llmgw/web/http1.py",
        "if not sep or not name or name.translate(None, _TOKEN_BYTES):",
        "if not sep or not name:",
        HTTP1,
    ),
    Mutant(
        "http1-signed-content-length",
        "src/llmgw/web/http1.py",
        "if not value.isdigit() or len(value) > 18:",
        "if not value.lstrip(b'+-').isdigit() or len(value) > 18:",
        HTTP1,
    ),
    # -- the circuit breaker ----------------------------------------------------------------
    Mutant(
        "breaker-opens-late",
        "src/llmgw/server/gateway/breaker.py",
        "if self.consecutive_failures >= self.failures:",
        "if self.consecutive_failures > self.failures:",
        BREAKER,
    ),
    Mutant(
        "breaker-stale-failure-counts",
        "src/llmgw/server/gateway/breaker.py",
        'def failure(self, now: float, token: int, reason: str = "") -> None:\n        if token != self._gen:\n            return\n',
        'def failure(self, now: float, token: int, reason: str = "") -> None:\n',
        BREAKER,
    ),
    Mutant(
        "breaker-probe-failure-no-backoff",
        "src/llmgw/server/gateway/breaker.py",
        "self._cooldown = min(self._cooldown * self.backoff, self.max_cooldown)\n            self._open(now, f\"probe failed",
        "self._cooldown = min(self._cooldown, self.max_cooldown)\n            self._open(now, f\"probe failed",
        BREAKER,
    ),
    Mutant(
        "breaker-health-probe-failure-no-backoff",
        "src/llmgw/server/gateway/breaker.py",
        "self._cooldown = min(self._cooldown * self.backoff, self.max_cooldown)\n            self._open(now, f\"health probe failed",
        "self._cooldown = min(self._cooldown, self.max_cooldown)\n            self._open(now, f\"health probe failed",
        BREAKER,
    ),
    # -- retries and their budget -----------------------------------------------------------
    Mutant(
        "retry-budget-one-over",
        "src/llmgw/server/gateway/retry.py",
        "if sum(self._retries) + 1 > self.allowance(now):",
        "if sum(self._retries) > self.allowance(now):",
        RETRY,
    ),
    Mutant(
        "retry-after-bytes-sent",
        "src/llmgw/server/gateway/retry.py",
        "if sent_to_client:",
        "if False:",
        RETRY,
    ),
    Mutant(
        "retry-500",
        "src/llmgw/server/gateway/retry.py",
        "RETRYABLE_STATUS = frozenset({502, 503})",
        "RETRYABLE_STATUS = frozenset({500, 502, 503})",
        RETRY,
    ),
    # -- placement --------------------------------------------------------------------------
    Mutant(
        "placement-no-spread",
        "src/llmgw/placement/single.py",
        "((node.replicas_of_model, len(free) - req.gpus, node.node_id), node, free)",
        "((0, len(free) - req.gpus, node.node_id), node, free)",
        PLACEMENT,
    ),
    Mutant(
        "placement-reuses-busy-gpus",
        "src/llmgw/placement/single.py",
        "g.index not in node.used_gpus\n        and (not kind",
        "True\n        and (not kind",
        PLACEMENT,
    ),
    Mutant(
        "placement-port-in-use",
        "src/llmgw/placement/single.py",
        "if port not in used:",
        "if True:",
        PLACEMENT,
    ),
)


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
    """Every `old` text occurs exactly once in its file: a list that no longer matches the code
    says so, by name, before anything runs."""
    problems = []
    for mutant in mutants:
        path = ROOT / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.name}: {mutant.file} does not exist")
            continue
        count = path.read_text().count(mutant.old)
        if count != 1:
            where = "is no longer found" if count == 0 else f"occurs {count} times"
            problems.append(f"{mutant.name}: the text to mutate {where} in {mutant.file}: {mutant.old!r}")
    names = [m.name for m in mutants]
    problems += [f"{n}: the name is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ListError("the mutant list does not match the code (it moved?):\n  " + "\n  ".join(problems))


def run(mutants: tuple[Mutant, ...], limit: float) -> int:
    check_list(mutants)
    with tempfile.TemporaryDirectory(prefix="llmgw-mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        env = environment(copy)
        probe = subprocess.run([sys.executable, "-c", "import llmgw; print(llmgw.__file__)"],
                               env=env, cwd=copy, capture_output=True, text=True, check=True)
        if not probe.stdout.strip().startswith(str(copy / "src")):
            raise ListError(f"the copy is not what Python imports: llmgw comes from {probe.stdout.strip()}")

        selected: list[str] = []  # every file or test id the mutants name (a -k selects within one)
        for mutant in mutants:
            for i, arg in enumerate(mutant.tests):
                if not arg.startswith("-") and (i == 0 or mutant.tests[i - 1] != "-k") and arg not in selected:
                    selected.append(arg)
        started = time.monotonic()
        print(f"baseline: the unmutated copy against {len(selected)} test selections ...", flush=True)
        rc, out = pytest(copy, env, tuple(selected), limit * 2)
        if rc != 0:
            print(out[-6000:])
            raise ListError(f"the tests fail without any mutant (pytest exit {rc}); fix that first")
        print(f"baseline: green in {time.monotonic() - started:.0f}s", flush=True)

        missed: list[str] = []
        for mutant in mutants:
            path = copy / mutant.file
            original = path.read_text()
            path.write_text(original.replace(mutant.old, mutant.new, 1))
            started = time.monotonic()
            try:
                rc, out = pytest(copy, env, mutant.tests, limit)
            finally:
                path.write_text(original)
            took = time.monotonic() - started
            tests = " ".join(mutant.tests)
            if rc == 1:
                verdict = "caught"
            elif rc is None:
                verdict = f"caught (hung past {limit:g}s)"
            elif rc == 0:
                verdict = "NOT CAUGHT"
                missed.append(mutant.name)
            else:
                print(out[-4000:])
                raise ListError(f"{mutant.name}: pytest exit {rc} (not a test failure: the mutant "
                                f"does not import or the tests were not collected); fix the list")
            print(f"{verdict:<12} {mutant.name:<45} {took:5.1f}s  {tests}", flush=True)
    print()
    if missed:
        print(f"{len(missed)} of {len(mutants)} planted bugs NOT caught: {', '.join(missed)}")
        return 1
    print(f"all {len(mutants)} planted bugs caught")
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
