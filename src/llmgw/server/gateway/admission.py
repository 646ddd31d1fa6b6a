"""Per-model admission: a limit of requests in flight, then a bounded FIFO queue with a
maximum wait, then rejection with a Retry-After estimate.

Pure: no clock, no waiting. A freed slot goes straight to the head of the queue (the slot never
becomes free in between, so a newcomer cannot overtake a waiter), and `finish` returns the
tickets that were just admitted so the caller wakes exactly those: no polling tick anywhere.
`admission_gate.AdmissionGate` is the trio wrapper that does the waiting.

Every ticket from `arrive` must be handed to `finish` exactly once, whatever happened (done,
expired, client went away); `finish` does the right thing for each state, so a slot cannot leak.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import OrderedDict

# Weight of the newest sample in the service-time average used for Retry-After.
_EWMA_ALPHA = 0.2
# Retry-After is capped at max(this, max_wait): past a minute an estimate is a guess anyway.
_RETRY_AFTER_CAP = 60.0


class TicketState(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"  # holds a slot until finish()
    REJECTED = "rejected"  # never queued: over the limit with a full (or no) queue
    EXPIRED = "expired"  # waited max_wait without a slot
    CANCELLED = "cancelled"  # left the queue before its deadline (client went away)
    DONE = "done"  # was admitted, has finished, slot released


class Ticket:
    """One request's place in admission. Compared by identity."""

    __slots__ = ("admitted_at", "arrived", "deadline", "reason", "retry_after", "seq", "state")

    def __init__(self, seq: int, arrived: float, deadline: float, state: TicketState) -> None:
        self.seq = seq
        self.arrived = arrived
        self.deadline = deadline
        self.state = state
        self.admitted_at: float | None = None
        self.retry_after = 0  # seconds, set when REJECTED or EXPIRED
        self.reason = ""  # why REJECTED or EXPIRED, for logs and a metric label

    @property
    def waited(self) -> float | None:
        """Seconds from arrival to admission (None if never admitted)."""
        return None if self.admitted_at is None else self.admitted_at - self.arrived

    def __repr__(self) -> str:
        return f"Ticket(#{self.seq} {self.state.value} arrived={self.arrived:g})"


class Admission:
    """Admission state of one model. limit 0 = unlimited (nothing is ever queued)."""

    def __init__(self, limit: int = 0, max_queue: int = 256, max_wait: float = 30.0) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.max_wait = max_wait
        self.in_flight = 0
        self.service_time: float | None = None  # moving average of admitted→finished seconds
        self._queue: OrderedDict[int, Ticket] = OrderedDict()
        self._seq = itertools.count(1)

    @property
    def queued(self) -> int:
        """Queue depth (waiters that are still waiting)."""
        return len(self._queue)

    def has_room_now(self) -> bool:
        """Whether `arrive` would admit at once (a slot free and nobody waiting), with no expired
        waiter left to sweep first (a queue that is empty has none)."""
        return not self._queue and (self.limit <= 0 or self.in_flight < self.limit)

    def _has_room(self) -> bool:
        return self.limit <= 0 or self.in_flight < self.limit

    def arrive(self, now: float) -> Ticket:
        """A request arrives: the ticket comes back ADMITTED, QUEUED or REJECTED."""
        # Expired waiters must not hold queue places. Deadlines grow along the queue (one
        # max_wait for all), so looking at the head is enough; `expire` is the full sweep.
        while self._queue:
            head = next(iter(self._queue.values()))
            if now < head.deadline:
                break
            del self._queue[head.seq]
            self._reject(head, now, "queue wait expired", TicketState.EXPIRED)
        seq = next(self._seq)
        if self._has_room() and not self._queue:
            ticket = Ticket(seq, now, now, TicketState.ADMITTED)
            ticket.admitted_at = now
            self.in_flight += 1
            return ticket
        if self.max_queue <= 0 or self.max_wait <= 0:
            return self._reject(Ticket(seq, now, now, TicketState.REJECTED), now, "over limit")
        if len(self._queue) >= self.max_queue:
            return self._reject(Ticket(seq, now, now, TicketState.REJECTED), now, "queue full")
        ticket = Ticket(seq, now, now + self.max_wait, TicketState.QUEUED)
        self._queue[seq] = ticket
        return ticket

    def finish(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The ticket's owner is done with it, for whatever reason. Returns the tickets that
        this admitted (a freed slot passed to the queue's head), for the caller to wake.

        QUEUED → leaves the queue (EXPIRED if its deadline has come, else CANCELLED);
        ADMITTED → DONE and its slot is released; any other state → nothing (idempotent).
        """
        if ticket.state is TicketState.QUEUED:
            del self._queue[ticket.seq]
            if now >= ticket.deadline:
                self._reject(ticket, now, "queue wait expired", TicketState.EXPIRED)
            else:
                ticket.state = TicketState.CANCELLED
            return []
        if ticket.state is not TicketState.ADMITTED:
            return []
        ticket.state = TicketState.DONE
        if ticket.admitted_at is not None:
            sample = max(0.0, now - ticket.admitted_at)
            prev = self.service_time
            self.service_time = sample if prev is None else prev + _EWMA_ALPHA * (sample - prev)
        self.in_flight -= 1
        return self._fill(now)

    def expire(self, now: float) -> list[Ticket]:
        """Take out the waiters whose deadline has come; they become EXPIRED with a
        Retry-After. (The trio wrapper does not need this: each waiter has its own deadline.)"""
        out = [t for t in self._queue.values() if now >= t.deadline]
        for ticket in out:
            del self._queue[ticket.seq]
            self._reject(ticket, now, "queue wait expired", TicketState.EXPIRED)
        return out

    def set_limits(
        self, now: float, *, limit: int, max_queue: int, max_wait: float
    ) -> list[Ticket]:
        """Config reload. Returns the waiters a higher limit admitted. A lower limit lets the
        requests in flight finish; new ones wait until the count is under it. Waiters keep the
        deadline they were given."""
        self.limit, self.max_queue, self.max_wait = limit, max_queue, max_wait
        return self._fill(now)

    def retry_after(self, now: float) -> int:
        """Seconds a rejected client should wait: the time for the queue ahead of it to drain at
        the observed service rate (limit slots, each busy `service_time` per request)."""
        service = self.service_time if self.service_time else 1.0
        slots = self.limit if self.limit > 0 else 1
        estimate = (len(self._queue) + 1) * service / slots
        cap = max(_RETRY_AFTER_CAP, self.max_wait)
        return max(1, math.ceil(min(estimate, cap)))

    def _fill(self, now: float) -> list[Ticket]:
        admitted: list[Ticket] = []
        while self._queue and self._has_room():
            _, ticket = self._queue.popitem(last=False)
            if now >= ticket.deadline:
                self._reject(ticket, now, "queue wait expired", TicketState.EXPIRED)
                continue
            ticket.state = TicketState.ADMITTED
            ticket.admitted_at = now
            self.in_flight += 1
            admitted.append(ticket)
        return admitted

    def _reject(
        self,
        ticket: Ticket,
        now: float,
        reason: str,
        state: TicketState = TicketState.REJECTED,
    ) -> Ticket:
        ticket.state = state
        ticket.reason = reason
        ticket.retry_after = self.retry_after(now)
        return ticket
