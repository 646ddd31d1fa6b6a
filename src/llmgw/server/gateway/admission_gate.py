"""trio side of admission: waits on the pure `Admission` core without any polling tick.

A queued request sleeps on its own `trio.Event` inside `trio.move_on_at(deadline)`. When a
request finishes, the core says which waiter got the freed slot and only that waiter's event
is set, so it runs at the same instant. Its deadline expiring, or the client going away
(cancellation), makes it leave the queue; if the slot reached it in that same instant, the slot
is passed on, never leaked.

    try:
        async with gate.admit():
            ... proxy the request ...
    except AdmissionRejected as exc:
        ... answer 429/503 with Retry-After: exc.retry_after ...
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from llmgw.server.gateway.admission import Admission, Ticket, TicketState


class AdmissionRejected(Exception):
    """Over the limit and the queue is full, or the wait in the queue expired."""

    def __init__(self, retry_after: int, reason: str) -> None:
        super().__init__(f"{reason}; retry after {retry_after}s")
        self.retry_after = retry_after
        self.reason = reason  # "queue full", "over limit", "queue wait expired"


class _Admitted:
    __slots__ = ("gate", "ticket")

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.ticket: Ticket | None = None

    async def __aenter__(self) -> Ticket:
        self.ticket = await self.gate._acquire()
        return self.ticket

    async def __aexit__(self, *exc: object) -> None:
        gate, ticket = self.gate, self.ticket
        if ticket is not None:
            gate._wake(gate.core.finish(ticket, trio.current_time()))


class AdmissionGate:
    """One model's admission. Observability: `in_flight`, `queued`, the counters below, and two
    optional callbacks (`on_admit(wait_seconds)` for a histogram, `on_reject(reason)`)."""

    def __init__(
        self,
        limit: int = 0,
        max_queue: int = 256,
        max_wait: float = 30.0,
        *,
        on_admit: Callable[[float], None] | None = None,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.core = Admission(limit, max_queue, max_wait)
        self.on_admit = on_admit
        self.on_reject = on_reject
        self.admitted_total = 0
        self.rejected_total: dict[str, int] = {}
        self._events: dict[int, trio.Event] = {}

    @property
    def in_flight(self) -> int:
        return self.core.in_flight

    @property
    def queued(self) -> int:
        return self.core.queued

    def set_limits(self, *, limit: int, max_queue: int, max_wait: float) -> None:
        """Config reload; a higher limit admits waiters at once."""
        now = trio.current_time()
        self._wake(self.core.set_limits(now, limit=limit, max_queue=max_queue, max_wait=max_wait))

    def admit(self) -> _Admitted:
        """Hold a slot for the body of the `async with`; raises AdmissionRejected instead.
        A class rather than @asynccontextmanager: the generator-based one was ~3 % of the CPU
        per request (py-spy, issue 17)."""
        return _Admitted(self)

    def admit_now(self, now: float) -> Ticket | None:
        """A slot at once when one is free and nobody waits (the common case), else None (then
        `acquire`); hand the ticket to `release` when done. The gateway's way: no coroutine and
        no context manager object per request (`admit` cost ~5 µs a request, this ~1.5; timeit,
        issue 17)."""
        core = self.core
        if not core.has_room_now():
            return None
        return self._admitted(core.arrive(now))

    async def acquire(self) -> Ticket:
        """Wait for a slot (raises AdmissionRejected instead); then `release`."""
        return await self._acquire()

    def release(self, ticket: Ticket, now: float | None = None) -> None:
        self._wake(self.core.finish(ticket, trio.current_time() if now is None else now))

    async def _acquire(self) -> Ticket:
        ticket = self.core.arrive(trio.current_time())
        if ticket.state is TicketState.QUEUED:
            event = self._events[ticket.seq] = trio.Event()
            admitted = False
            try:
                with trio.move_on_at(ticket.deadline):
                    await event.wait()
                admitted = ticket.state is TicketState.ADMITTED
            finally:
                del self._events[ticket.seq]
                if not admitted:
                    # Leaves the queue (EXPIRED or CANCELLED); if the slot reached this ticket
                    # while it was being cancelled, finish() passes the slot on.
                    self._wake(self.core.finish(ticket, trio.current_time()))
        if ticket.state is not TicketState.ADMITTED:
            self.rejected_total[ticket.reason] = self.rejected_total.get(ticket.reason, 0) + 1
            if self.on_reject is not None:
                self.on_reject(ticket.reason)
            raise AdmissionRejected(ticket.retry_after, ticket.reason)
        return self._admitted(ticket)

    def _admitted(self, ticket: Ticket) -> Ticket:
        self.admitted_total += 1
        if self.on_admit is not None:
            self.on_admit(ticket.waited or 0.0)
        return ticket

    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            event = self._events.get(ticket.seq)
            if event is not None:
                event.set()
