"""The gateway's client door: a gateway API key whose sha256 is in gateway.api_keys; open when
none is set. Its refusals are counted and logged without the secret (at most one line per door
per second, with the count of lines held back).

One implementation for every gateway: the server's own (llmgw.server.auth's `Auth` keeps its
client door here and adds the viewer and operator doors), each of its workers and a gateway on
another machine (llmgw.server.gateway.worker), which need this door and none of the control
plane's: before issue 42 a worker built a whole `Auth(ServerConfig())` to get it, and loaded the
control plane's credential checks with it.

This module is also the one place a presented secret is hashed (`secret_digest`); the config
holds only digests (llmgw.gwsettings.sha256_digest reads them).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable

from llmgw.gwsettings import sha256_digest
from llmgw.web.server import Request

log = logging.getLogger("llmgw.auth")

CLIENT = "client"  # the client door's name: the `door` label of llmgw_auth_failures_total
# What a gateway whose client port has no TLS says once API keys are configured.
CLEARTEXT = ("gateway.api_keys configured but this gateway's client port has no TLS (--public-tls-cert): "
             "API keys cross the network in cleartext unless a TLS proxy fronts this port")


def secret_digest(secret: bytes) -> str:
    """The sha256 (hex) of a presented secret: a bearer token, the admin cookie, a typed token."""
    return hashlib.sha256(secret).hexdigest()


def bearer_digest(request: Request) -> str | None:
    """The sha256 (hex) of the request's bearer token, or None without one."""
    auth = request.head.get(b"authorization") or b""
    if auth[:7].lower() != b"bearer ":
        return None
    return secret_digest(auth[7:].strip())


def digests(values: Iterable[str]) -> frozenset[str]:
    """The hex digests of stored secrets ("sha256:<hex>"); a value in another form counts for nothing."""
    return frozenset(d for d in (sha256_digest(v) for v in values) if d is not None)


def known(digest: str, held: frozenset[str]) -> bool:
    """Whether `digest` is one of `held`, compared in constant time."""
    return any(hmac.compare_digest(digest, k) for k in held)


class _Throttle:
    """At most one log line per `every` seconds; says how many were held back."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.next_at = 0.0
        self.held = 0

    def take(self, now: float) -> int | None:
        if now < self.next_at:
            self.held += 1
            return None
        held, self.held, self.next_at = self.held, 0, now + self.every
        return held


class Refusals:
    """Counts refusals by door (`count(door)`: llmgw_auth_failures_total) and logs them, at most
    one line per door per second, with what was presented and never the secret."""

    def __init__(self, count: Callable[[str], None] = lambda door: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._count = count
        self._clock = clock
        self._throttles: dict[str, _Throttle] = {}

    def refused(self, door: str, request: Request, what: str) -> None:
        self._count(door)
        throttle = self._throttles.get(door)
        if throttle is None:
            throttle = self._throttles[door] = _Throttle()
        held = throttle.take(self._clock())
        if held is None:
            return
        more = f" ({held} more refusals at this door since the last line)" if held else ""
        log.warning("refused at the %s door: %s %r from %s with %s%s", door, request.method, request.path[:200],
                    request.peer, what, more)


class ClientDoor:
    """May this request reach /v1? An API key when keys are configured, else anyone.

    `cleartext`: this gateway's client port has no TLS, so configured keys would cross the network
    in clear text; said once each time keys come to be configured (a gateway on another machine
    without --public-tls-cert; the server's own doors say it of the server's port)."""

    def __init__(self, api_keys: Iterable[str] = (), *, refusals: Refusals | None = None,
                 cleartext: bool = False) -> None:
        self.refusals = refusals or Refusals()
        self.cleartext = cleartext
        self.keys: frozenset[str] = frozenset()
        self.configure(api_keys)

    def configure(self, api_keys: Iterable[str]) -> None:
        """The keys of a (re)loaded config: stored values, "sha256:<hex>"."""
        had = bool(self.keys)
        self.keys = digests(api_keys)
        if self.cleartext and self.keys and not had:
            log.warning("%s", CLEARTEXT)

    def allows(self, request: Request) -> bool:
        if not self.keys:
            return True
        digest = bearer_digest(request)
        if digest is not None and known(digest, self.keys):
            return True
        presented = request.head.get(b"authorization")
        self.refusals.refused(CLIENT, request, "a token that is no API key" if presented else "no API key")
        return False
