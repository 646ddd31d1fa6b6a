"""The settle period after a control-plane start, as a pure state: values in, state out, time a number.

A restarted control plane knows nothing of the replicas that serve: agents re-register with the
engines they run and the reconciler rebuilds replicas from them (adoption). Until the fleet that
was there is back it must neither place (a replica placed beside an engine not yet reported is
stopped as surplus a moment later: issue 41, finding 3) nor tell the gateways an endpoint set it
has not rebuilt (its still-empty list took every follower down: 1,133 × 503 over 11 s, issue 41,
finding 1). Agents reconnect with a jittered backoff of up to 30 s (agent `backoff.max`) after
an outage, so a fixed 10 s ended before the last of them was back.

    SETTLING ──all awaited nodes registered──► SETTLED   (reason ALL_BACK)
    SETTLING ──the bound passed──────────────► SETTLED   (reason BOUND)
    SETTLING ──nothing awaited, wait over────► SETTLED   (reason WAITED: a first start)
    SETTLED  ── anything ────────────────────► SETTLED   (it happens once per start)

What is awaited: the known nodes (seen before this start, kept in the state directory), else a
first start's `expect_nodes`. The bound: `settle_max` after a restart (the fleet that was there
may not all come back: a node that died with the control plane), `settle` for a first start.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Set


class SettleState(enum.Enum):
    SETTLING = "settling"
    SETTLED = "settled"


class Ended(enum.Enum):
    """How the settle period ended (the log line says it)."""

    ALL_BACK = "all awaited nodes registered"
    BOUND = "the bound passed"
    WAITED = "the first start's wait is over"


_TRANSITIONS: dict[tuple[SettleState, Ended], SettleState] = {
    (SettleState.SETTLING, Ended.ALL_BACK): SettleState.SETTLED,
    (SettleState.SETTLING, Ended.BOUND): SettleState.SETTLED,
    (SettleState.SETTLING, Ended.WAITED): SettleState.SETTLED,
}


class SettlePlan:
    """One start's settle period. `step(now, connected)` is the only transition; it is idempotent
    and time only moves it forward (a call with an earlier `now` changes nothing)."""

    def __init__(self, *, now: float, known: Iterable[str], expect: Iterable[str], settle: float,
                 settle_max: float) -> None:
        self.started_at = now
        self.rejoining = set(known)  # seen before this start; empty: a first start
        self.awaited: set[str] = set(self.rejoining) or set(expect)
        # After a restart the bound is the longer of the two (an operator's long `settle` for a
        # first start's expect_nodes is not cut short by a restart); a first start waits `settle`.
        self.bound = max(settle, settle_max) if self.rejoining else settle
        self.state = SettleState.SETTLING if self.bound > 0 else SettleState.SETTLED
        self.ended: Ended | None = None if self.state is SettleState.SETTLING else Ended.WAITED
        self.ended_at = now if self.ended is not None else None
        self.missing_at_end: set[str] = set()

    @property
    def settling(self) -> bool:
        return self.state is SettleState.SETTLING

    def missing(self, connected: Set[str]) -> set[str]:
        return self.awaited - connected

    def left(self, now: float) -> float:
        """Seconds until the bound, while settling; 0 once settled."""
        if not self.settling:
            return 0.0
        return max(0.0, self.bound - (now - self.started_at))

    def forget(self, node_id: str) -> None:
        """The node is gone for good (the operator said so, or it was lost): not awaited."""
        self.awaited.discard(node_id)

    def step(self, now: float, connected: Set[str]) -> SettleState:
        if not self.settling:
            return self.state
        event: Ended | None = None
        if self.awaited and not self.awaited - connected:
            event = Ended.ALL_BACK
        elif now - self.started_at >= self.bound:
            event = Ended.BOUND if self.awaited else Ended.WAITED
        if event is not None:
            self.state = _TRANSITIONS[(self.state, event)]
            self.ended, self.ended_at = event, now
            self.missing_at_end = self.awaited - connected
        return self.state

    def note(self, now: float, connected: Set[str]) -> str:
        """Why nothing new is placed (and the gateways keep their last endpoint set); "" once settled."""
        if not self.settling:
            return ""
        ago, left = now - self.started_at, self.left(now)
        missing = sorted(self.missing(connected))
        if missing:
            names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            verb = "re-register" if self.rejoining else "register"  # known before, or expect_nodes
            return (f"the server started {ago:.0f}s ago and places nothing new for up to {left:.0f}s more, "
                    f"until {names} {verb}{'s' if len(missing) == 1 else ''}")
        return f"the server started {ago:.0f}s ago and places nothing new for {left:.0f}s more"
