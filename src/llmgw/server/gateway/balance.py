"""Which engine endpoint of a model gets the next request. Pure: time and randomness are
passed in (`now`, an injected `random.Random`), so every choice is reproducible in tests.

Two policies, chosen per model:

- ``least-outstanding``: power of two choices. Two endpoints drawn at random, the one with
  fewer requests in flight *from this gateway* wins; on a tie, the engine's own scraped load
  (running + waiting, then KV-cache usage) decides. P2C avoids the herd that "pick the global
  minimum" causes when many requests arrive between two load updates.
- ``prefix-affinity``: consistent hashing of the prompt's prefix so requests sharing a prefix
  land on the engine that already holds its KV cache, *with bounded loads* (Mirrokni, Thorup,
  Zadimoghaddam 2018): an endpoint takes the request only if its load after taking it is at most
  ceil(c × (total + 1) / n); otherwise the walk goes on along the ring. A hot prefix spills
  over to the next endpoints instead of piling onto one. Each endpoint owns `vnodes` points
  on the ring, so adding or removing one moves only the keys it gains or owned.

For both: endpoints whose breaker does not allow traffic, endpoints out of rotation for failing
their active health checks (`health()`: N failures in a row take one out, one pass puts it
back) and endpoints in `exclude` (already tried for this request) are skipped; endpoints with
violations (KV cache nearly full, long waiting queue, from the scrape) are taken only when no
other endpoint can take the request.

Usage by the proxy::

    pick = balancer.pick(now, key=prompt_prefix(body), exclude=tried)  # None: no endpoint
    ... send to pick.endpoint ...
    balancer.release(pick, now, ok=True)  # False: engine failed; None: client went away
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Literal

import msgspec

from llmgw.server.gateway.breaker import Breaker
from llmgw.server.gateway.enginemetrics import (
    KV_CACHE_LIMIT,
    MAX_WAITING,
    EngineLoad,
    violations,
)

Policy = Literal["least-outstanding", "prefix-affinity"]
POLICIES: tuple[Policy, ...] = ("least-outstanding", "prefix-affinity")

# Characters of prompt text that make the affinity key: long enough to cover a typical shared
# system prompt (where KV-cache reuse pays), short enough that hashing it is free.
PREFIX_CHARS = 256
_INF = float("inf")


def _hash(text: str) -> int:
    """Stable across processes and restarts (unlike hash()), so the ring is too."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _Endpoint:
    __slots__ = ("breaker", "health_failures", "health_reason", "id", "load", "outstanding", "unhealthy_since",
                 "violations")

    def __init__(self, endpoint_id: str, breaker: Breaker) -> None:
        self.id = endpoint_id
        self.breaker = breaker
        self.outstanding = 0
        self.load: EngineLoad | None = None
        self.violations: tuple[str, ...] = ()
        self.health_failures = 0  # consecutive failed health checks
        self.unhealthy_since: float | None = None  # out of rotation since (None: in rotation)
        self.health_reason = ""

    def rank(self) -> tuple[int, float, float]:
        """Lower is better: our own in-flight count, then the engine's scraped load."""
        load = self.load
        if load is None or not load.known:
            return (self.outstanding, _INF, _INF)
        return (self.outstanding, load.running + load.waiting, load.kv_cache_usage)


class Pick:
    """A request's hold on one endpoint; give it back with `Balancer.release` exactly once."""

    __slots__ = ("_ep", "breaker", "breaker_token", "endpoint", "released")

    def __init__(self, ep: _Endpoint, token: int) -> None:
        self._ep = ep
        self.endpoint = ep.id
        self.breaker = ep.breaker  # the endpoint's breaker (to log a change the release makes)
        self.breaker_token = token  # tells the breaker which state the request started in
        self.released = False

    def __repr__(self) -> str:
        return f"Pick({self.endpoint!r})"


class EndpointStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One endpoint as the balancer sees it, for /metrics and the admin pages."""

    endpoint: str
    outstanding: int
    breaker: str  # closed, open, half-open
    breaker_state: int  # 0 closed, 1 open, 2 half-open (Prometheus gauge)
    breaker_reason: str = ""
    violations: list[str] = []
    load: EngineLoad | None = None
    healthy: bool = True
    health_reason: str = ""  # the last failed health check, while out of rotation
    unhealthy_since: float | None = None  # on the balancer's clock


class Balancer:
    """The endpoints of one model and the policy that picks among them."""

    def __init__(
        self,
        policy: Policy = "least-outstanding",
        *,
        rng: random.Random | None = None,
        load_factor: float = 1.25,
        vnodes: int = 64,
        breaker_failures: int = 5,
        breaker_cooldown: float = 10.0,
        breaker_max_cooldown: float = 300.0,
        kv_cache_limit: float = KV_CACHE_LIMIT,
        max_waiting: int = MAX_WAITING,
        health_failures: int = 3,
        health_probes: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown balancer policy {policy!r}")
        if load_factor <= 1.0:
            raise ValueError("load_factor must be > 1 (1 would forbid any imbalance)")
        self.policy: Policy = policy
        self.rng = rng if rng is not None else random.Random()
        self.load_factor = load_factor
        self.vnodes = vnodes
        self.breaker_failures = breaker_failures
        self.breaker_cooldown = breaker_cooldown
        self.breaker_max_cooldown = breaker_max_cooldown
        self.kv_cache_limit = kv_cache_limit
        self.max_waiting = max_waiting
        self.health_failures = max(1, health_failures)
        self.health_probes = health_probes  # breakers are probed by health checks, not clients
        self._eps: dict[str, _Endpoint] = {}
        self._ring_hashes: list[int] = []
        self._ring_ids: list[str] = []

    # ---- membership ---------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        return list(self._eps)

    def __len__(self) -> int:
        return len(self._eps)

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._eps

    def add(self, endpoint: str) -> None:
        """Add an endpoint (no-op if present): O(vnodes × ring) and only its own ring points."""
        if endpoint in self._eps:
            return
        breaker = Breaker(
            self.breaker_failures,
            self.breaker_cooldown,
            max_cooldown=self.breaker_max_cooldown,
            health_probes=self.health_probes,
        )
        self._eps[endpoint] = _Endpoint(endpoint, breaker)
        for i in range(self.vnodes):
            h = _hash(f"{endpoint}#{i}")
            at = bisect.bisect_left(self._ring_hashes, h)
            self._ring_hashes.insert(at, h)
            self._ring_ids.insert(at, endpoint)

    def remove(self, endpoint: str) -> None:
        """Remove an endpoint (no-op if absent). Picks still held on it release harmlessly."""
        if self._eps.pop(endpoint, None) is None:
            return
        keep = [i for i, e in enumerate(self._ring_ids) if e != endpoint]
        self._ring_hashes = [self._ring_hashes[i] for i in keep]
        self._ring_ids = [self._ring_ids[i] for i in keep]

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Make the set equal to `endpoints`, keeping the state of those that stay."""
        wanted = dict.fromkeys(endpoints)
        for endpoint in [e for e in self._eps if e not in wanted]:
            self.remove(endpoint)
        for endpoint in wanted:
            self.add(endpoint)

    def breaker(self, endpoint: str) -> Breaker:
        return self._eps[endpoint].breaker

    def outstanding(self, endpoint: str) -> int:
        return self._eps[endpoint].outstanding

    def update_load(self, endpoint: str, load: EngineLoad | None) -> None:
        """Latest scrape of `endpoint`; None when the scrape failed (load unknown, and with no
        evidence of violations they are cleared)."""
        ep = self._eps.get(endpoint)
        if ep is None:
            return
        ep.load = load
        ep.violations = (
            ()
            if load is None
            else tuple(
                violations(load, kv_cache_limit=self.kv_cache_limit, max_waiting=self.max_waiting)
            )
        )

    def set_health_policy(self, failures: int, probes: bool) -> None:
        """A reload changed active health: with it off, nothing would ever put an endpoint
        back in rotation or probe an open breaker, so none stays out for failed checks."""
        self.health_failures = max(1, failures)
        self.health_probes = probes
        for ep in self._eps.values():
            ep.breaker.health_probes = probes
            if not probes:
                ep.unhealthy_since = None
                ep.health_failures = 0
                ep.health_reason = ""

    def health(self, endpoint: str, now: float, ok: bool, reason: str = "") -> str | None:
        """One active health check of `endpoint` (or a metrics scrape that got no answer).
        `health_failures` failures in a row take it out of rotation; one pass puts it back.
        The result is also the probe of an open breaker (see Breaker.probe). Returns "down"
        when this result took it out, "up" when it put it back, otherwise None."""
        ep = self._eps.get(endpoint)
        if ep is None:
            return None
        ep.breaker.probe(now, ok, reason)
        if ok:
            ep.health_failures = 0
            if ep.unhealthy_since is None:
                return None
            ep.unhealthy_since = None
            ep.health_reason = ""
            return "up"
        ep.health_failures += 1
        ep.health_reason = reason or "health check failed"
        if ep.unhealthy_since is None and ep.health_failures >= self.health_failures:
            ep.unhealthy_since = now
            return "down"
        return None

    def healthy(self, endpoint: str) -> bool:
        ep = self._eps.get(endpoint)
        return ep is not None and ep.unhealthy_since is None

    # ---- choosing -----------------------------------------------------------------------

    def pick(
        self, now: float, *, key: str | None = None, exclude: Collection[str] = ()
    ) -> Pick | None:
        """Choose an endpoint and count the request on it; None when no endpoint can take it
        (none left, all excluded or all behind open breakers)."""
        usable = [
            ep for ep in self._eps.values() if ep.unhealthy_since is None and ep.breaker.allows(now)
        ]
        candidates = [ep for ep in usable if ep.id not in exclude] if exclude else usable
        if not candidates:
            return None
        if self.policy == "prefix-affinity" and key:
            ep = self._bounded_hash(key, candidates, usable)
        else:
            ep = self._p2c(candidates)
        token = ep.breaker.start(now)
        ep.outstanding += 1
        return Pick(ep, token)

    def release(self, pick: Pick, now: float, *, ok: bool | None, reason: str = "") -> None:
        """The request is over on that endpoint. ok=True: the engine answered (any status but
        a gateway error); False: connect error, reset, timeout, 502/503/504 (counts toward the
        breaker; `reason` is shown); None: neither (the client left first)."""
        if pick.released:
            return
        pick.released = True
        ep = pick._ep
        ep.outstanding -= 1
        if ok is True:
            ep.breaker.success(now, pick.breaker_token)
        elif ok is False:
            ep.breaker.failure(now, pick.breaker_token, reason)
        else:
            ep.breaker.cancel(now, pick.breaker_token)

    def owner(self, key: str) -> str | None:
        """The endpoint a key hashes to with no load and nothing excluded (for tests, admin)."""
        if not self._ring_ids:
            return None
        at = bisect.bisect(self._ring_hashes, _hash(key)) % len(self._ring_ids)
        return self._ring_ids[at]

    def _p2c(self, candidates: list[_Endpoint]) -> _Endpoint:
        pool = [ep for ep in candidates if not ep.violations] or candidates
        if len(pool) == 1:
            return pool[0]
        a, b = self.rng.sample(pool, 2)
        return a if a.rank() <= b.rank() else b

    def _bounded_hash(
        self, key: str, candidates: list[_Endpoint], usable: list[_Endpoint]
    ) -> _Endpoint:
        # Endpoints in violation only take the request when no clean one can, and then the
        # bound is computed among them: the bound is about the endpoints that share the load.
        tier = [ep for ep in candidates if not ep.violations]
        if tier:
            sharing = [ep for ep in usable if not ep.violations]
        else:
            tier, sharing = candidates, usable
        # Counting the new request: ceil(c·(m+1)/n) × n ≥ m+1, so unless endpoints are
        # excluded (they still carry load, so they count) some endpoint always has room.
        total = sum(ep.outstanding for ep in sharing)
        bound = math.ceil(self.load_factor * (total + 1) / len(sharing))
        allowed = {ep.id: ep for ep in tier}
        ring = self._ring_ids
        start = bisect.bisect(self._ring_hashes, _hash(key))
        seen: set[str] = set()
        for step in range(len(ring)):
            endpoint = ring[(start + step) % len(ring)]
            if endpoint in seen:
                continue
            seen.add(endpoint)
            ep = allowed.get(endpoint)
            if ep is not None and ep.outstanding + 1 <= bound:
                return ep
            if len(seen) == len(self._eps):
                break
        # Every endpoint with room was excluded: the least loaded of the rest.
        return min(tier, key=_Endpoint.rank)

    def status(self) -> list[EndpointStatus]:
        return [
            EndpointStatus(
                endpoint=ep.id,
                outstanding=ep.outstanding,
                breaker=ep.breaker.state.label,
                breaker_state=int(ep.breaker.state),
                breaker_reason=ep.breaker.reason,
                violations=list(ep.violations),
                load=ep.load,
                healthy=ep.unhealthy_since is None,
                health_reason=ep.health_reason if ep.unhealthy_since is not None else "",
                unhealthy_since=ep.unhealthy_since,
            )
            for ep in self._eps.values()
        ]


def prompt_prefix(body: Mapping[str, Any], chars: int = PREFIX_CHARS) -> str | None:
    """The affinity key of an OpenAI request body: the first `chars` characters of its prompt
    text, in the order the chat template renders it (role, then content, message by message).
    None when the body has no prompt text (the balancer then falls back to p2c)."""
    pieces: list[str] = []
    size = 0

    def add(text: str) -> bool:
        nonlocal size
        pieces.append(text)
        size += len(text)
        return size >= chars

    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            texts: list[str] = []
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(
                    part["text"]
                    for part in content
                    if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                )
            if not any(texts):
                continue
            if add(f"\x1e{message.get('role', '')}\x1f") or any(add(t) for t in texts if t):
                break
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            # A batch of prompts (strings or token lists) or one token list.
            first = prompt[0]
            prompt = first if isinstance(first, str | list) else prompt
        if isinstance(prompt, str):
            add(prompt)
        elif isinstance(prompt, list):
            add(",".join(str(t) for t in prompt[:chars]))
    text = "".join(pieces)[:chars]
    return text or None
