"""When the gateway retries a failed upstream attempt on another engine, and how often it may.

Retried: a connect error, a connection reset before the engine's response started, and a 502 or
503 from the engine; nothing else (a 500 or a timeout may mean the engine is working on it, and
a second copy doubles the load). Never once a byte of the response went to the client: the
proxy tracks that and passes `sent_to_client`.

Retries are bounded per request (max attempts) and per model by a budget: retries in the last
`window` seconds may be at most `ratio` of the requests in it, with a floor of `min_retries` so
that a lone request can still retry. During an outage every request fails; without a budget
each one would be tried `max_attempts` times and the outage would triple the load on whatever
is left.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

# "no_head": a streamed request whose response head did not come within stream_head_timeout
# (vLLM and SGLang send a stream's head at once, so the engine is not working on it: retried).
FailureKind = Literal["connect", "reset", "no_head", "status", "timeout", "other"]
RETRYABLE_STATUS = frozenset({502, 503})


class RetryDecision(msgspec.Struct, frozen=True):
    retry: bool
    reason: str  # for logs and a `reason` label: "retry", "budget exhausted", ...


class RetryBudget:
    """Sliding window of `buckets` time buckets (O(1) memory and time per call).

    The window at time `now` is the bucket holding `now` plus the `buckets - 1` before it. A
    retry is granted when, counting it, retries in the window ≤ max(min_retries, ratio × requests
    in the window). Only first attempts count as requests, so retries cannot feed their own budget.
    """

    __slots__ = (
        "_bucket_len",
        "_epoch",
        "_requests",
        "_retries",
        "buckets",
        "min_retries",
        "ratio",
        "window",
    )

    def __init__(
        self, ratio: float = 0.2, *, window: float = 10.0, min_retries: int = 5, buckets: int = 10
    ) -> None:
        if window <= 0 or buckets < 1:
            raise ValueError("window must be > 0 and buckets >= 1")
        self.ratio = ratio
        self.window = window
        self.min_retries = min_retries
        self.buckets = buckets
        self._bucket_len = window / buckets
        self._requests = [0] * buckets
        self._retries = [0] * buckets
        self._epoch = -(2**62)  # floor(now / bucket_len) of the newest bucket; none yet

    def _advance(self, now: float) -> int:
        epoch = math.floor(now / self._bucket_len)
        if epoch > self._epoch:
            for e in range(max(self._epoch + 1, epoch - self.buckets + 1), epoch + 1):
                slot = e % self.buckets
                self._requests[slot] = 0
                self._retries[slot] = 0
            self._epoch = epoch
        # A `now` older than the newest bucket (clock skew between callers) counts in the newest.
        return self._epoch % self.buckets

    def record_request(self, now: float) -> None:
        """Count a request's first attempt."""
        self._requests[self._advance(now)] += 1

    def allowance(self, now: float) -> int:
        """How many retries the window allows in total right now."""
        self._advance(now)
        return max(self.min_retries, math.floor(self.ratio * sum(self._requests)))

    def try_spend(self, now: float) -> bool:
        """Take one retry from the budget if there is one left."""
        slot = self._advance(now)
        if sum(self._retries) + 1 > self.allowance(now):
            return False
        self._retries[slot] += 1
        return True

    @property
    def requests_in_window(self) -> int:
        return sum(self._requests)

    @property
    def retries_in_window(self) -> int:
        return sum(self._retries)


def is_retryable(failure: FailureKind, status: int | None = None) -> bool:
    """Whether this kind of failure is worth another engine at all (ignoring limits)."""
    if failure in ("connect", "reset", "no_head"):
        return True
    return failure == "status" and status in RETRYABLE_STATUS


def should_retry(
    *,
    failure: FailureKind,
    status: int | None = None,
    sent_to_client: bool,
    attempt: int,
    max_attempts: int,
    budget: RetryBudget,
    now: float,
) -> RetryDecision:
    """Decide whether attempt number `attempt` (1 = the first) that just failed is retried.

    Spends one retry from `budget` only when the answer is yes, so call it once per failure.
    `failure`: "connect" (could not connect), "reset" (connection lost before the engine's
    response started), "status" (the engine answered `status`), "timeout", "other".
    """
    if sent_to_client:
        return RetryDecision(False, "response already started")
    if not is_retryable(failure, status):
        what = f"status {status}" if failure == "status" else failure
        return RetryDecision(False, f"not retryable: {what}")
    if attempt >= max_attempts:
        return RetryDecision(False, "max attempts reached")
    if not budget.try_spend(now):
        return RetryDecision(False, "retry budget exhausted")
    return RetryDecision(True, "retry")
