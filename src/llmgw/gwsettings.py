"""The gateway's settings, static endpoints and public TLS files: as the server's config file
declares them (llmgw.catalog.schema's ServerConfig holds them) and as the gateway feed carries
them (llmgw.wire.gateway's GatewayConfig), one definition for both.

Below both the catalog and the fleet protocol (wire), as llmgw/names.py is: neither floor imports
the other (issue 42: wire/gateway.py imported the catalog's schema for these, an arrow back up;
the catalog re-exports them). They are config sections, so unknown keys are errors
(`forbid_unknown_fields`): a typo in a config file must not pass silently. Pure.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from llmgw.units import ByteSize, Duration


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]

BalancerKind = Literal["least-outstanding", "prefix-affinity"]


def sha256_digest(value: str) -> str | None:
    """The lower-case hex digest of a stored secret ("sha256:<64 hex digits>"), or None when
    the value is not in that form. The one parser of stored secrets (config checks, auth)."""
    algo, _, digest = value.partition(":")
    if algo != "sha256" or len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
        return None
    return digest.lower()


def check_digests(values: list[str], what: str) -> None:
    for value in values:
        if sha256_digest(value) is None:
            raise ValueError(
                f"{what} must be stored as sha256:<64 hex digits>, never in plain text "
                "(make one with `llmgw ctl hash-secret`)"
            )


class StaticEndpoint(Config):
    """An engine not run by llmgw (router-only use)."""

    model: str
    url: str


class TlsPublic(Config):
    cert: str = ""
    key: str = ""
    ca: str = ""  # CA for operator client certificates


class GatewaySettings(Config):
    # Open connections on the public port at most (0 = no cap). At the cap, or when accept fails
    # for want of file descriptors (EMFILE), accept pauses (new clients wait in the listen
    # backlog) and one line a second says so. Keep it under the fd limit (LimitNOFILE) minus
    # what engines and agents need (~2 per engine, 1 per node). A restart applies a change.
    max_connections: NonNegative = 10000
    # SIGTERM: stop accepting, let requests in flight finish for up to this long, exit 0.
    shutdown_grace: Duration = Duration(30)
    max_body: ByteSize = ByteSize(1024 * 1024)
    # A new connection's first request head must arrive within this (slowloris: 408).
    header_timeout: Duration = Duration(30)
    # The largest engine answer the gateway holds in memory (a non-streamed body; streamed
    # answers are relayed as they arrive, never held): past it the client gets a 502. Without
    # one, a 600 MB answer took a server from 51 MB to ~2 GB. 128 MiB: the largest answer the
    # OpenAI API's own limits allow is an embeddings batch, 2,048 inputs x 3,072 floats, ~80 MB
    # as JSON.
    max_response: ByteSize = ByteSize(128 * 1024 * 1024)
    # The whole request body must arrive within this (a slow drip is cut off with 408).
    body_timeout: Duration = Duration(30)
    # API keys for /v1/*, as "sha256:<hex>"; empty = open.
    api_keys: list[str] = []
    scrape_interval: Duration = Duration(2)
    scrape_timeout: Duration = Duration(1)
    upstream_timeout: Duration = Duration(600)
    connect_timeout: Duration = Duration(2)
    # Active health of every endpoint in rotation: GET health_path every health_interval; this many
    # failures or timeouts (health_timeout) in a row, or metrics scrapes that got no answer, take it
    # out of rotation until a check passes (any answer under 500), and the requests waiting on it
    # that sent the client nothing are moved to another endpoint. Its next check after the
    # breaker's cool-down is the breaker's probe. health_interval 0 turns this off (a client's
    # request probes the breaker then). Kubernetes' probe defaults: 1 s timeout, 3 failures.
    health_path: str = "/health"
    health_interval: Duration = Duration(1)
    health_timeout: Duration = Duration(1)
    health_failures: Positive = 3
    # A streamed request whose response head has not come within this counts as a failure and is
    # retried elsewhere. Engines send a stream's head at once or with its first token (the
    # simulated engine, like vLLM behind uvicorn, does the latter), so this also bounds a stream's
    # time to first token under queueing: keep it above the worst queueing you accept. A
    # non-streamed request waits for its whole generation before the head: upstream_timeout only.
    stream_head_timeout: Duration = Duration(30)
    max_attempts: Positive = 3
    retry_budget: float = 0.2
    breaker_failures: Positive = 5
    breaker_cooldown: Duration = Duration(10)
    # An endpoint is least preferred while its KV cache is this full or this many wait.
    kv_cache_limit: float = 0.95
    max_waiting: NonNegative = 32
    affinity_load_factor: float = 1.25
    # Under heavy streaming load (over 2,000 tokens/s through this gateway) tokens are relayed
    # in passes this far apart, so one wake-up serves many streams (about a third less CPU per
    # token); 0 relays each token the moment it arrives. Below that load: no delay either way.
    stream_coalesce: Duration = Duration(0.002)
    # Processes serving /v1 on the public port ("auto": one per core). 1: the server serves the
    # port itself, as before. N > 1: N gateway workers accept on it (SO_REUSEPORT), each with its
    # own balancer, breakers and admission, fed by the control plane over a Unix socket in the
    # state directory (the engines' health checks and scrapes too: the server makes them once for
    # all); /api/v1, /admin and /metrics reach the control plane through them. A
    # model's admission.max_in_flight and max_queue are divided among the workers (rounded up),
    # so the engines see about the configured total. A reload applies a change between two
    # counts above 1 live; 1 <-> N needs a restart (llmgw.server.operator.workers_refusal).
    workers: Positive | Literal["auto"] = 1

    def __post_init__(self) -> None:
        check_digests(self.api_keys, "api_keys")

    def worker_count(self, cores: int) -> int:
        return max(1, cores) if self.workers == "auto" else int(self.workers)
