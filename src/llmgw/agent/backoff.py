"""Jittered exponential backoff for reconnects. Pure: the caller sleeps.

Delay n is drawn uniformly from [d/2, d] where d = min(cap, initial * 2**n): never zero (no
hot loop against a down server), never over the cap, and spread enough that a fleet whose
server restarts does not come back in lockstep.
"""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, initial: float, cap: float, rng: random.Random | None = None) -> None:
        if initial <= 0 or cap < initial:
            raise ValueError("need 0 < initial <= cap")
        self.initial = initial
        self.cap = cap
        self.rng = rng or random.Random()
        self.attempt = 0

    def ceiling(self, attempt: int) -> float:
        return min(self.cap, self.initial * 2 ** min(attempt, 62))

    def next(self) -> float:
        top = self.ceiling(self.attempt)
        self.attempt += 1
        return self.rng.uniform(top / 2, top)

    def reset(self) -> None:
        self.attempt = 0
