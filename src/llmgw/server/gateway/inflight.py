"""What the gateway keeps of an attempt in flight: the guard its endpoint's eviction and its head
timeout reach it through, and where the fast lane left a request the task path finishes."""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from llmgw.server.gateway.attempt import AttemptLoop
from llmgw.web.client import Response, UpstreamError, Watch


class AttemptGuard(Watch):
    """One upstream attempt in flight, so that the health check that takes its endpoint out of
    rotation can end what it is waiting on. While it waits for the engine's head the attempt is
    a Watch (no cancel scope: see llmgw.web.client.Watch), its head timeout kept in the
    gateway's table (`due`, checked by Gateway.run_disconnect_watchdog); past the head, or when
    that task is not running, `scope()` guards each wait (an attempt evicted between two waits
    finds the next one cancelled at once)."""

    __slots__ = ("_scope", "evicted", "reason")

    def __init__(self) -> None:
        self.due = math.inf  # Watch's fields, without the call
        self.fd = -1
        self.why = ""
        self.wake: Callable[[], None] | None = None
        self._scope: trio.CancelScope | None = None
        self.evicted = False
        self.reason = ""

    def scope(self) -> trio.CancelScope:
        self._scope = trio.CancelScope()
        if self.evicted:
            self._scope.cancel()
        return self._scope

    def evict(self, reason: str) -> None:
        self.evicted = True
        self.reason = reason
        self.fire("evicted")
        if self._scope is not None:
            self._scope.cancel()


class Resumed:
    """Where the fast lane (llmgw.server.gateway.fastlane) left a request it began: its attempt
    loop (admitted, the retry budget charged, in ATTEMPT on its first pick or UNAVAILABLE) and
    that attempt's end so far: the engine's answer (head read) or its error, to be handled as the
    task path handles its own; neither: the attempt is made there (the lane had no idle engine
    connection)."""

    __slots__ = ("loop", "replay")

    def __init__(self, loop: AttemptLoop, replay: Response | UpstreamError | None = None) -> None:
        self.loop = loop
        self.replay = replay
