"""The phases of a request's attempts and the steps between them (llmgw.server.gateway.attempt
takes them): a table, as h11 keeps its connection states, so that a step out of order is a bug
found where it happens, not a request left holding an engine."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    PICK = "pick"  # an endpoint is to be chosen
    ATTEMPT = "attempt"  # the request is on its way to `pick`; no head yet
    ANSWER = "answer"  # the engine's head came: its answer goes (or is going) to the client
    UNAVAILABLE = "unavailable"  # no endpoint left to try: 503
    FAILED = "failed"  # the engine's failure is the answer: `status` (502/504)
    DONE = "done"  # answered
    GONE = "gone"  # the client went away, or the request was cancelled


NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.PICK: frozenset({Phase.ATTEMPT, Phase.UNAVAILABLE, Phase.GONE}),
    Phase.ATTEMPT: frozenset({Phase.PICK, Phase.ANSWER, Phase.FAILED, Phase.GONE}),
    Phase.ANSWER: frozenset({Phase.PICK, Phase.DONE, Phase.GONE}),
    Phase.UNAVAILABLE: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.DONE: frozenset(),
    Phase.GONE: frozenset(),
}
ENDED = frozenset(phase for phase, onward in NEXT.items() if not onward)


class IllegalStep(RuntimeError):
    """A driver asked for a step its phase does not allow: a bug in the driver."""
