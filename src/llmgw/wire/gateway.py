"""The gateway feed: what the control plane tells a gateway worker, and what the worker reports.

One Connect stream per worker, on the fleet transport (the same envelopes, the same h2 framing,
path GATEWAY_PATH): a local worker dials the control plane's Unix socket, a gateway on another
machine dials the fleet port with a gateway certificate. Pure: values in, bytes out.

    worker → control plane   GatewayHello (once), GatewayStats (its metrics, every second)
    control plane → worker   GatewayConfig (catalog models, static endpoints, gateway settings),
                             GatewayEndpoints (ready endpoints and their engine keys)

Each server message carries the whole state it describes, never a delta: a worker that missed
one (a reconnect) is whole again with the next, and the control plane sends only the latest.
"""

from __future__ import annotations

import hashlib

import msgspec

from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint, TlsPublic
from llmgw.catalog.units import dec_hook, enc_hook
from llmgw.wire.messages import MessageError, Unknown, _decode

GATEWAY_PATH = "/llmgw.fleet.v1.Fleet/Gateway"

__all__ = [
    "GATEWAY_PATH",
    "GatewayConfig",
    "GatewayEndpoints",
    "GatewayHello",
    "GatewayStats",
    "MessageError",
    "decode_from_gateway",
    "decode_to_gateway",
    "encode",
]


class _Base(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class GatewayHello(_Base, tag="GatewayHello", tag_field="type"):
    name: str  # "worker-0" for a local worker, the certificate's name for a remote gateway
    version: str
    pid: int = 0


class GatewayStats(_Base, tag="GatewayStats", tag_field="type"):
    """The worker's own metrics, in Prometheus text format; the control plane's /metrics shows
    them with a `worker` label (one scrape for every worker)."""

    metrics: str
    requests: int = 0  # requests this worker finished since it started
    config: str = ""  # config_digest of the last GatewayConfig it applied ("" from an older gateway)


class GatewayConfig(_Base, tag="GatewayConfig", tag_field="type"):
    models: list[Model] = []
    static: list[StaticEndpoint] = []
    settings: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    # A local worker forwards the rest of the public port (/api/v1, /admin, /metrics) here.
    api_url: str = ""
    # A local worker terminates the public port's TLS with these files (the server's public_tls);
    # the digest of their contents changes when a reload found them renewed in place. Never sent
    # to a gateway on another machine.
    public_tls: TlsPublic | None = None
    public_tls_digest: str = ""


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


FromGateway = GatewayHello | GatewayStats
ToGateway = GatewayConfig | GatewayEndpoints

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
    return _decode(payload, _from_decoder, FROM_TYPES)


def decode_to_gateway(payload: bytes) -> ToGateway | Unknown:
    return _decode(payload, _to_decoder, TO_TYPES)
