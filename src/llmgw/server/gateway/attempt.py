"""One request's way through its engines, as a state machine with no I/O (issue 42).

admit → pick → attempt → outcome → retry or answer → release: the sequence both request paths
drive, the task path (Gateway._forward) and the fast lane (llmgw.server.gateway.fastlane), which
hands the same machine to the task path where it stops. Before, each path kept its own copy of
the loop in its own style (flags and locals there, attributes here), and a policy change had to
be made twice. The machine decides; its driver does the I/O (the engine request, the answer to
the client), the logging and the metrics it is told to.

    PICK ──pick──▶ ATTEMPT ──head──▶ ANSWER ──finish──▶ DONE
     ▲  └─none─▶ UNAVAILABLE  │  ▲     │
     └──── retry / evicted ───┘  │     └─evicted (nothing sent)─▶ PICK
                              └─fail─▶ FAILED
    any live phase ──gone──▶ GONE

Time is a parameter; the balancer and the retry budget are the pure policies it consults. The
phases and their table are llmgw.server.gateway.phases (this module is compiled with the fast lane,
and mypyc builds no exception class).
"""

from __future__ import annotations

from llmgw.server.gateway.balance import Balancer, Pick
from llmgw.server.gateway.phases import ENDED, NEXT, IllegalStep, Phase
from llmgw.server.gateway.retry import FailureKind, RetryBudget, should_retry

_FAILURES: dict[str, FailureKind] = {"connect": "connect", "reset": "reset", "timeout": "timeout"}



class AttemptLoop:
    """One request's attempts. The driver calls `pick`, then reports what became of the attempt
    (`failed`, `head`, `evicted`), then `finish`, or `gone` at any point; after each report
    `release` is what to give back to the balancer (an attempt's hold and its outcome), and
    `retried` the reason a retry was taken, for the metrics (None: no retry)."""

    __slots__ = ("attempt", "balancer", "budget", "detail", "key", "last_error", "max_attempts", "outcome", "phase",
                 "pick_", "released", "retried", "status", "streaming", "tried")

    def __init__(self, balancer: Balancer, budget: RetryBudget, max_attempts: int, now: float, *,
                 key: str | None = None, streaming: bool = False) -> None:
        self.balancer = balancer
        self.budget = budget
        self.max_attempts = max_attempts
        self.key = key  # the prefix-affinity key, when the policy wants one
        self.streaming = streaming
        self.phase = Phase.PICK
        self.attempt = 0  # attempts counted against max_attempts (an eviction gives its one back)
        self.tried: set[str] = set()
        self.last_error = ""
        self.pick_: Pick | None = None  # the attempt's hold on its endpoint, until released
        self.outcome: bool | None = None  # the attempt's outcome for the balancer and breaker
        self.released: Pick | None = None  # set by a step that ends an attempt: the driver releases it
        self.retried: str | None = None
        self.status = 0  # FAILED: the status the client gets
        self.detail = ""  # FAILED: why, for the log
        budget.record_request(now)

    def _to(self, phase: Phase) -> None:
        if phase not in NEXT[self.phase]:
            raise IllegalStep(f"{self.phase.value} → {phase.value} is not a step of a request's attempts")
        self.phase = phase

    @property
    def endpoint(self) -> str:
        return self.pick_.endpoint if self.pick_ is not None else ""

    def pick(self, now: float) -> Pick | None:
        """PICK → ATTEMPT on the endpoint the balancer gives, or UNAVAILABLE when none is left."""
        if self.phase is not Phase.PICK:
            raise IllegalStep(f"a pick in phase {self.phase.value}: a request picks only between attempts")
        pick = self.balancer.pick(now, key=self.key, exclude=self.tried)
        self.retried = None
        if pick is None:
            self._to(Phase.UNAVAILABLE)
            return None
        self.attempt += 1
        self.pick_ = pick
        self.outcome = None
        self._to(Phase.ATTEMPT)
        return pick

    def failed(self, kind: str, error: str, now: float) -> Phase:
        """The attempt failed before the engine's head (`kind` as UpstreamError's): retried on
        another endpoint (PICK) when the retry policy and budget allow, else FAILED (504 for a
        timeout, 502 otherwise). A stream's head timeout is retried as "no_head"."""
        failure = _FAILURES.get(kind, "other")
        if failure == "timeout" and self.streaming:
            failure = "no_head"
            error = f"{error} (stream_head_timeout)"
        self.last_error = f"{self.endpoint}: {error}"
        decision = should_retry(failure=failure, status=None, sent_to_client=False, attempt=self.attempt,
                                max_attempts=self.max_attempts, budget=self.budget, now=now)
        self._end_attempt(False)
        if decision.retry:
            self.retried = failure if failure == "no_head" else kind
            return self._again()
        self.status = 504 if kind == "timeout" else 502
        self.detail = f"{self.last_error} ({decision.reason})"
        self._to(Phase.FAILED)
        return self.phase

    def head(self, status: int, now: float) -> Phase:
        """The engine's head came: its answer goes to the client (ANSWER), unless it is a 502/503
        the retry policy takes elsewhere (PICK: the driver closes that answer)."""
        if status in (502, 503):
            self.outcome = False
            self.last_error = f"{self.endpoint}: answered {status}"
            decision = should_retry(failure="status", status=status, sent_to_client=False, attempt=self.attempt,
                                    max_attempts=self.max_attempts, budget=self.budget, now=now)
            if decision.retry:
                self._end_attempt(False)
                self.retried = str(status)
                return self._again()
        self._to(Phase.ANSWER)
        return self.phase

    def evicted(self, reason: str) -> Phase:
        """The endpoint went out of rotation before anything went to the client: another endpoint,
        with no retry spent (the engine is known to be out, and this request no longer loads it)."""
        self.last_error = f"{self.endpoint}: {reason}"
        self.attempt -= 1
        self._end_attempt(False)
        self.retried = "unhealthy"
        return self._again()

    def finish(self, engine_ok: bool | None) -> None:
        """ANSWER → DONE: the answer went out. `engine_ok`: whether the engine did its part (None:
        not the engine's doing, e.g. an answer too large to pass on); a 502/503 passed on as the
        answer stays a failure."""
        self._to(Phase.DONE)
        self._end_attempt(engine_ok if self.outcome is None else self.outcome)

    def gone(self) -> None:
        """The client went away (or the request was cancelled): an attempt in flight ends with no
        outcome for its engine."""
        if self.phase in ENDED:
            return
        self._to(Phase.GONE)
        self._end_attempt(None)

    def _end_attempt(self, outcome: bool | None) -> None:
        if self.pick_ is not None:
            self.tried.add(self.pick_.endpoint)
            self.released, self.pick_ = self.pick_, None
            self.outcome = outcome

    def _again(self) -> Phase:
        self._to(Phase.PICK)
        return self.phase

    def take_release(self) -> tuple[Pick, bool | None] | None:
        """What the last step ended: an attempt's hold and its outcome, given back once."""
        pick = self.released
        if pick is None:
            return None
        self.released = None
        return pick, self.outcome
