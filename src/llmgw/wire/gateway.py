"""The gateway feed: what the control plane tells a gateway worker, and what the worker reports.

One Connect stream per worker, on the fleet transport (the same envelopes, the same h2 framing,
path GATEWAY_PATH): a local worker dials the control plane's Unix socket, a gateway on another
machine dials the fleet port with a gateway certificate. Pure: values in, bytes out.

    worker → control plane   GatewayHello (once), GatewayStats (its metrics, every second)
    control plane → worker   GatewayConfig (the catalog's routing view, static endpoints, gateway
                             settings), GatewayEndpoints (ready endpoints and their engine keys),
                             GatewayProbes (the server's own workers only: its engine probes)

A gateway is sent what routing needs and nothing else (issue 40, finding 2): of each model its
name, balancer and admission (RouteModel), never its profiles (their `env` holds HF_TOKEN and the
like, their args and commands), nor its source URL (user:pass@, presigned query strings).

Each server message carries the whole state it describes, never a delta: a worker that missed
one (a reconnect) is whole again with the next, and the control plane sends only the latest.
GatewayProbes is the exception, by nature: results of health checks and scrapes, the latest of
each engine that this stream was not sent yet (a new stream gets every engine's latest).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import msgspec

from llmgw.gwsettings import BalancerKind, GatewaySettings, StaticEndpoint, TlsPublic
from llmgw.units import dec_hook, enc_hook
from llmgw.wire.messages import MessageError, Unknown, decode_tagged

GATEWAY_PATH = "/llmgw.fleet.v1.Fleet/Gateway"
# How the control plane ends a gateway certificate's stream when a newer one of the same
# certificate opened (one stream per certificate); the gateway that reads it waits longest before
# dialling again, so two processes sharing one certificate alternate every few seconds, not in a loop.
REPLACED = "a newer stream of this gateway certificate replaced this one (one stream per certificate)"
# How the control plane ends a local worker's stream when its hello carries another key than the
# one this server started its workers with: a worker of an earlier server (issue 41, finding 4).
NOT_OWN_WORKER = "this server did not start this worker (its LLMGW_WORKER_KEY is not this server's)"

__all__ = [
    "GATEWAY_PATH",
    "NOT_OWN_WORKER",
    "REPLACED",
    "EngineHealth",
    "EngineLoad",
    "EngineScrape",
    "GatewayConfig",
    "GatewayEndpoints",
    "GatewayHello",
    "GatewayProbes",
    "GatewayStats",
    "MessageError",
    "RouteAdmission",
    "RouteModel",
    "decode_from_gateway",
    "decode_to_gateway",
    "encode",
    "route_model",
]


class _Base(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class GatewayHello(_Base, tag="GatewayHello", tag_field="type"):
    name: str  # "worker-0" for a local worker, the certificate's name for a remote gateway
    version: str
    pid: int = 0
    # A local worker's proof that this server started it: the per-start secret its server put in
    # its environment (LLMGW_WORKER_KEY). A gateway on another machine sends none: its certificate
    # says who it is. Never logged.
    key: str = ""


class GatewayStats(_Base, tag="GatewayStats", tag_field="type"):
    """The worker's own metrics, in Prometheus text format; the control plane's /metrics shows
    them with a `worker` label (one scrape for every worker)."""

    metrics: str
    requests: int = 0  # requests this worker finished since it started
    config: str = ""  # config_digest of the last GatewayConfig it applied ("" from an older gateway)


class _Route(msgspec.Struct, kw_only=True):
    """Every field on the wire, defaults too: a gateway of another version never reads a value
    the control plane left out as its own (different) default."""


class RouteAdmission(_Route):
    """A model's admission as the gateway's AdmissionGate applies it (catalog Admission)."""

    max_in_flight: int = 0  # 0 = unlimited
    max_queue: int = 256
    max_wait: float = 30.0  # seconds


class RouteModel(_Route):
    """A catalog model as a gateway routes it: the fields llmgw.server.gateway.routes reads, and
    no other. Decodable as a catalog Model by an older gateway (a subset of its fields)."""

    name: str
    balancer: BalancerKind = "least-outstanding"
    admission: RouteAdmission = msgspec.field(default_factory=RouteAdmission)


class _Limits(Protocol):
    @property
    def max_in_flight(self) -> int: ...
    @property
    def max_queue(self) -> int: ...
    @property
    def max_wait(self) -> float: ...


class Routed(Protocol):
    """What route_model reads of a model: a catalog Model (llmgw.catalog.schema) is one, named
    by its fields rather than imported (wire does not import the catalog, issue 42)."""

    @property
    def name(self) -> str: ...
    @property
    def balancer(self) -> BalancerKind: ...
    @property
    def admission(self) -> _Limits: ...


def route_model(model: Routed | RouteModel) -> RouteModel:
    """The routing view of a catalog model (a RouteModel is returned as it is)."""
    if isinstance(model, RouteModel):
        return model
    adm = model.admission
    return RouteModel(name=model.name, balancer=model.balancer,
                      admission=RouteAdmission(max_in_flight=adm.max_in_flight, max_queue=adm.max_queue,
                                               max_wait=float(adm.max_wait)))


class GatewayConfig(_Base, tag="GatewayConfig", tag_field="type"):
    models: list[RouteModel] = []
    static: list[StaticEndpoint] = []
    settings: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    # A local worker forwards the rest of the public port (/api/v1, /admin, /metrics) here.
    api_url: str = ""
    # A local worker terminates the public port's TLS with these files (the server's public_tls);
    # the digest of their contents changes when a reload found them renewed in place. Never sent
    # to a gateway on another machine.
    public_tls: TlsPublic | None = None
    public_tls_digest: str = ""
    # A local worker takes the engine probes of its server (GatewayProbes) instead of probing
    # every engine itself: one process per machine probes each engine, not N + 1 (issue 42).
    # False (a gateway on another machine; a control plane older than the flag): it probes them.
    probes: bool = False


class GatewayEndpoints(_Base, tag="GatewayEndpoints", tag_field="type"):
    ready: dict[str, list[str]] = {}  # model → endpoints of its ready replicas
    keys: dict[str, str] = {}  # endpoint → the engine key of the shard behind it
    # Model → why it has no ready replica: what the one-process server logs beside its 503 (the
    # client's body says only "no ready replica of M"), so a worker's log says the same. Absent
    # from an older control plane: the worker then says less, nothing breaks.
    reasons: dict[str, str] = {}
    # The control plane restarted and has not rebuilt its endpoint set yet (it waits for the nodes
    # that were there: llmgw.server.settling): `ready` is what it has so far, and a follower keeps
    # the endpoints it has beside them until a message without this flag replaces them. An older
    # follower ignores the flag and takes `ready` as it is.
    settling: bool = False


# The load fields an engine's /metrics may show (llmgw.server.gateway.enginemetrics reads them).
LOAD_FIELDS = ("running", "waiting", "kv_cache_usage")


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Load of one engine endpoint as its last scrape showed it."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1, the fullest cache in the scrape
    engine: str = ""  # "vllm", "sglang", or "" when none of the families was found
    missing: tuple[str, ...] = ()  # fields of LOAD_FIELDS the scrape did not have

    @property
    def known(self) -> bool:
        """False when the scrape had none of the families (not an engine we understand)."""
        return len(self.missing) < len(LOAD_FIELDS)


class EngineHealth(_Route):
    """One active health check of an engine (llmgw.server.gateway.probes)."""

    ok: bool
    reason: str = ""  # why it failed, bounded (MAX_PROBE_REASON)


class EngineScrape(_Route):
    """One /metrics scrape of an engine: its load (None: no usable answer), whether it answered
    at all (no answer counts as a failed health check too), and what went wrong."""

    load: EngineLoad | None = None
    answered: bool = True
    error: str = ""


MAX_PROBE_REASON = 500  # characters of a probe's reason sent on (as GatewayEndpoints.reasons)


class GatewayProbes(_Base, tag="GatewayProbes", tag_field="type"):
    """Engine probes the server made since the last of these on this stream, the latest of each
    endpoint: a worker feeds them to its balancers as its own checks were (issue 42)."""

    health: dict[str, EngineHealth] = {}
    scrapes: dict[str, EngineScrape] = {}


FromGateway = GatewayHello | GatewayStats
ToGateway = GatewayConfig | GatewayEndpoints | GatewayProbes

# The catalog's Duration and ByteSize travel as plain numbers.
_encoder = msgspec.json.Encoder(enc_hook=enc_hook)
_from_decoder = msgspec.json.Decoder(FromGateway, dec_hook=dec_hook)
_to_decoder = msgspec.json.Decoder(ToGateway, dec_hook=dec_hook)
FROM_TYPES: frozenset[str] = frozenset(t.__struct_config__.tag for t in FromGateway.__args__)
TO_TYPES: frozenset[str] = frozenset(t.__struct_config__.tag for t in ToGateway.__args__)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def config_digest(payload: bytes) -> str:
    """Names a GatewayConfig as sent: a follower reports the one it applied (`ctl gateways` CONFIG)."""
    return hashlib.sha256(payload).hexdigest()[:16]


def decode_from_gateway(payload: bytes) -> FromGateway | Unknown:
    return decode_tagged(payload, _from_decoder, FROM_TYPES)


def decode_to_gateway(payload: bytes) -> ToGateway | Unknown:
    return decode_tagged(payload, _to_decoder, TO_TYPES)
