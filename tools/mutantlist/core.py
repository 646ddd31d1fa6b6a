"""The mutants of the code before the fabric wave (before 1 Dec): the bugs issue 22's mutation
check found slipping through, and the pure cores (reconciler, envelope, HTTP/1.1 framing,
breaker, retry budget, single-node placement)."""

from __future__ import annotations

from mutantlist.spec import Mutant

RECONCILE = ("tests/unit/test_reconcile.py",)
FLEET_REGISTER = ("tests/unit/test_fleet_register.py",)
ENVELOPE = ("tests/unit/test_envelope.py",)
HTTP1 = ("tests/unit/test_http1.py",)
BREAKER = ("tests/unit/test_gateway_breaker.py",)
RETRY = ("tests/unit/test_gateway_retry.py",)
PLACEMENT = ("tests/unit/test_placement.py",)

CORE: tuple[Mutant, ...] = (
    # -- the planted bugs of issue 22 ---------------------------------------------------------
    Mutant(
        "surplus-ready-before-starting",
        "src/llmgw/server/reconcile.py",
        "ReplicaState.STARTING: 2, ReplicaState.READY: 3,",
        "ReplicaState.STARTING: 3, ReplicaState.READY: 2,",
        RECONCILE,
    ),
    Mutant(
        "register-node-id-unchecked",
        "src/llmgw/server/admit.py",
        "if not valid_node_id(node_id):",
        "if False:",
        FLEET_REGISTER,
    ),
    Mutant(
        "register-certificate-name-unchecked",
        "src/llmgw/server/admit.py",
        "if rules.require_identity and identity != node_id:",
        "if False:",
        FLEET_REGISTER,
    ),
    Mutant(
        "gateway-outcome-always-success",
        "src/llmgw/server/gateway/proxy.py",
        "balancer.release(pick, trio.current_time() if now is None else now, ok=outcome,",
        "balancer.release(pick, trio.current_time() if now is None else now, ok=True,",
        ("tests/unit/test_gateway_attempts.py",),
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
        "{ReplicaState.PENDING: 0, ReplicaState.FAILED: 1,",
        "{ReplicaState.PENDING: 1, ReplicaState.FAILED: 0,",
        RECONCILE,
    ),
    Mutant(
        "unreachable-node-loses-its-replicas",
        "src/llmgw/server/lost.py",
        'if state != "lost":\n            return\n        self.generation += 1',
        'if state not in ("lost", "unreachable"):\n            return\n        self.generation += 1',
        RECONCILE,
    ),
    Mutant(
        "backoff-not-exponential",
        "src/llmgw/server/replicas.py",
        "self.settings.backoff_initial * 2 ** (replica.failures - 1)",
        "self.settings.backoff_initial * replica.failures",
        RECONCILE,
    ),
    Mutant(
        "stop-not-resent-after-reconnect",
        "src/llmgw/server/observe.py",
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
        'def failure(self, now: float, token: int, reason: str = "") -> None:\n        if token != self._gen:\n        '
        '    return\n',
        'def failure(self, now: float, token: int, reason: str = "") -> None:\n',
        BREAKER,
    ),
    Mutant(
        "breaker-probe-failure-no-backoff",
        "src/llmgw/server/gateway/breaker.py",
        "self._cooldown = min(self._cooldown * self.backoff, self.max_cooldown)\n            self._open(now, "
        "f\"probe failed",
        "self._cooldown = min(self._cooldown, self.max_cooldown)\n            self._open(now, f\"probe failed",
        BREAKER,
    ),
    Mutant(
        "breaker-health-probe-failure-no-backoff",
        "src/llmgw/server/gateway/breaker.py",
        "self._cooldown = min(self._cooldown * self.backoff, self.max_cooldown)\n            self._open(now, f\"health "
        "probe failed",
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
        "g.index not in node.used_gpus\n        and g.index not in node.unplaceable",
        "True\n        and g.index not in node.unplaceable",
        PLACEMENT,
    ),
    Mutant(
        "placement-port-in-use",
        "src/llmgw/placement/single.py",
        "if port not in used:",
        "if True:",
        PLACEMENT,
    ),
    # -- the supervisor (issue 37: the seed's bug, adopted engines reported stopped, none killed) --
    Mutant(
        "adopted-engine-not-killed-by-stop",  # the seed's bug: reported stopped, nothing killed
        "src/llmgw/agent/supervisor.py",
        "run.pid, run.pgid, run.start_ticks = state.pid, state.pgid, state.start_ticks",
        "run.pid, run.pgid, run.start_ticks = state.pid, 0, state.start_ticks",
        (),
        ("tests/e2e/test_supervisor.py::test_stopping_an_adopted_engine_kills_it_and_frees_its_gpus",),
    ),
)
