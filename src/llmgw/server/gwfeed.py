"""The control plane's side of the gateway feed (llmgw.wire.gateway): every gateway worker, local
or on another machine, follows one Connect stream on which the control plane sends the catalog,
the gateway settings and the ready endpoints, and reads back the worker's metrics.

The state is kept as the encoded messages, the latest only: a worker that is slow to read gets
the newest state when it is ready, never a queue of old ones (memory does not grow with a slow
or stuck worker). Endpoints are re-encoded on every reconcile pass but sent only when they changed.

The server's own workers also get its engine probes (GatewayProbes): the server asks each
engine for its health and metrics once and each worker takes the answers as its own, instead of
every worker asking every engine too (N + 1 probes of each engine with N workers; issue 42). A
gateway on another machine probes the engines itself: what the server's machine reaches says
nothing of what it reaches.

/metrics stays one scrape: each worker sends its own metrics text every second and
`WorkerMetrics` shows every worker's families with a `worker` label. Why aggregated here rather
than prometheus multiprocess mode: a gateway on another machine has no shared directory with
the control plane, multiprocess mode loses gauges' meaning (each needs a mode) and custom
collectors (the breaker and health state), and it needs its environment before the first import.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import msgspec
import trio
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint, TlsPublic
from llmgw.fleet import ChannelClosed, FleetChannel, StreamRefused
from llmgw.server.gateway.probes import LatestProbes
from llmgw.tls.context import ServerTls
from llmgw.wire.gateway import (
    NOT_OWN_WORKER,
    REPLACED,
    EngineHealth,
    EngineScrape,
    GatewayConfig,
    GatewayEndpoints,
    GatewayHello,
    GatewayStats,
    MessageError,
    RouteModel,
    config_digest,
    decode_from_gateway,
    encode,
    route_model,
)
from llmgw.wire.ids import printable

log = logging.getLogger("llmgw.gateway")

HELLO_TIMEOUT = 10.0  # seconds a new stream has to say who it is
# A follower reports every second which config it applied: one still naming an older one this
# long after a change is "behind" (stuck, or too loaded to read its stream), not "updating".
BEHIND_AFTER = 5.0
# Why a model has no ready replica travels with the endpoints, bounded: at most this many models
# (issue 9's abuse catalog has 1,000), each reason cut at this many characters (the API's bound on
# a tool's error text); 2,000 × 500 characters stay well under the feed's 4 MiB message.
MAX_REASONS = 2000
MAX_REASON = 500
# Engine probes go to a worker at most this often, each engine's latest (GatewayProbes): a round
# of checks of every engine is one message, not one per engine (eviction waits this much more).
PROBES_EVERY = 0.05
# The metric families a gateway exports (GatewayWorker's registry, as the text parser names them),
# each with its type and the labels it sets: only these of a follower's report reach the control
# plane's /metrics. Another name would let a compromised gateway forge the control plane's own
# families (llmgw_nodes, llmgw_fleet_refused) or any other, and a name the control plane exports
# too repeats its `# TYPE` line, which fails Prometheus's whole scrape; another label (or type)
# would let it grow a real family by any series it likes (issue 40, finding 5).
# tests/unit/test_gateway_feed.py checks this against a real worker.
_MODEL, _ENDPOINT, _LE = "model", "endpoint", "le"
GATEWAY_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "llmgw_requests": ("counter", frozenset({_MODEL, "code"})),
    "llmgw_request_duration_seconds": ("histogram", frozenset({_MODEL, _LE})),
    "llmgw_time_to_first_token_seconds": ("histogram", frozenset({_MODEL, _LE})),
    "llmgw_admission_wait_seconds": ("histogram", frozenset({_MODEL, _LE})),
    "llmgw_upstream_retries": ("counter", frozenset({_MODEL, "reason"})),
    "llmgw_admission_rejected": ("counter", frozenset({_MODEL, "reason"})),
    "llmgw_gateway_fast_lane_requests": ("counter", frozenset({_MODEL, "outcome"})),
    "llmgw_endpoint_breaker_state": ("gauge", frozenset({_MODEL, _ENDPOINT})),
    "llmgw_endpoint_healthy": ("gauge", frozenset({_MODEL, _ENDPOINT})),
    "llmgw_engine_up": ("gauge", frozenset({_MODEL, _ENDPOINT})),
    "llmgw_admission_queue_depth": ("gauge", frozenset({_MODEL})),
    "llmgw_requests_in_flight": ("gauge", frozenset({_MODEL})),
    "llmgw_gateway_control_plane_connected": ("gauge", frozenset()),
    "llmgw_gateway_control_plane_settling": ("gauge", frozenset()),
    "llmgw_gateway_control_plane_updates": ("counter", frozenset()),
    "llmgw_gateway_control_plane_updates_created": ("gauge", frozenset()),
    "llmgw_gateway_control_plane_last_update_timestamp_seconds": ("gauge", frozenset()),
    "llmgw_gateway_worker_pid": ("gauge", frozenset()),
}
GATEWAY_FAMILIES = frozenset(GATEWAY_METRICS)
# The sample names of a family of each type, as suffixes of the family's name.
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum", "_created")}
# A label value longer than this is no gateway's (a model name is at most 256 characters,
# wire.ids.MODEL_MAX; an endpoint URL far less): the sample is refused, so that series under the
# cap cannot be made megabytes each.
MAX_LABEL_VALUE = 512
# Series (sample lines) one follower may add to /metrics: SERIES_BASE, plus SERIES_PER_MODEL for
# each model it routes and SERIES_PER_ENDPOINT for each endpoint, as the largest routing view
# published since start (a model dropped by a reload keeps its counters in the gateway until it
# restarts). A gateway exports about 80 series per model it served (3 histograms of 19 lines, a
# code, a reason, an outcome each) and 3 per endpoint; 4 streams x 20,000 forged series took
# /metrics from ~10 KB to 9.3 MB (3.9 s a scrape). The excess is left out and counted in
# llmgw_gateway_series_refused_total{reason="cap"}.
SERIES_BASE = 1024
SERIES_PER_MODEL = 256
SERIES_PER_ENDPOINT = 8
REFUSED_REASONS = ("family", "labels", "cap")
MAX_REFUSED_NAMES = 256  # followers named in the refused counter; later names count as "other"


class Admitted(msgspec.Struct):
    """What of one follower's report reaches /metrics, and how many series were left out, by reason."""

    families: list[Metric]
    refused: dict[str, int]


def admit_report(families: Iterable[Metric], cap: int) -> Admitted:
    """The families and labels a gateway exports, their samples up to `cap` in all (pure)."""
    kept: list[Metric] = []
    refused = dict.fromkeys(REFUSED_REASONS, 0)
    room = cap
    for family in families:
        allowed = GATEWAY_METRICS.get(family.name)
        if allowed is None or allowed[0] != family.type:
            refused["family"] += len(family.samples)
            continue
        names = {family.name + suffix for suffix in _SUFFIXES[family.type]}
        labels = allowed[1]
        samples = []
        for sample in family.samples:
            if (sample.name not in names or not labels.issuperset(sample.labels)
                    or any(len(v) > MAX_LABEL_VALUE for v in sample.labels.values())):
                refused["labels"] += 1
            elif room <= 0:
                refused["cap"] += 1
            else:
                room -= 1
                samples.append(sample)
        if samples:
            own = Metric(family.name, family.documentation, family.type, family.unit)
            own.samples = samples
            kept.append(own)
    return Admitted(kept, refused)


class Follower(msgspec.Struct, kw_only=True):
    """One connected gateway worker, as the control plane sees it."""

    name: str
    peer: str
    kind: str = "remote"  # "worker": one of this server's own (the Unix socket); "remote": another machine's
    pid: int = 0
    version: str = ""
    since: float = 0.0  # unix time it connected
    metrics: str = ""  # its last metrics text
    requests: int = 0
    last_report: float = 0.0  # unix time of its last GatewayStats; 0: none yet
    config: str = ""  # config_digest of the config it last said it applied


class GatewayView(msgspec.Struct, kw_only=True):
    """GET /api/v1/gateways, `ctl gateways`: one follower. `requests` and `last_report` are null
    until it has reported. `config`: "current" (it applied the config the control plane publishes
    now: the catalog and gateway settings of the last reload), "updating" (a newer one was
    published less than BEHIND_AFTER ago), "behind" (later than that), null (no report yet, or a
    gateway of a version that does not say)."""

    name: str
    kind: str
    peer: str
    pid: int
    version: str
    since: float
    last_report: float | None
    requests: int | None
    config: str | None = None


class GatewayFeedService:
    """Sends the latest gateway state to every follower; keeps what they report."""

    def __init__(self, *, local_workers: int = 0, api_socket: str = "",
                 not_ready_reason: Callable[[str], str] = lambda model: "",
                 public_tls: ServerTls | None = None) -> None:
        self.not_ready_reason = not_ready_reason  # what the one-process gateway logs with its 503
        self._models: list[str] = []  # the catalog's model names, for their reasons
        self._catalog: tuple[list[RouteModel], list[StaticEndpoint], GatewaySettings] | None = None  # as last published
        self.local_workers = local_workers  # the server's own workers share each model's admission
        self.api_socket = api_socket  # where a local worker forwards /api/v1, /admin and /metrics
        self.public_tls = public_tls  # the public port's TLS, which the server's own workers terminate
        self._config = b""  # for gateways on other machines: the catalog as configured
        self._local_config = b""  # for the server's own workers: admission divided among them
        self._digests = ("", "")  # config_digest of _config and _local_config
        self._config_changed = 0.0  # unix time they last changed
        self._endpoints = encode(GatewayEndpoints())
        self.probes = LatestProbes()  # the server's engine probes, for its own workers
        self._changed = trio.Event()
        self.followers: dict[int, Follower] = {}  # by stream identity (two workers may share a name)
        # A gateway certificate's one stream: its follower key and the scope that ends it when replaced.
        self._streams: dict[str, tuple[int, trio.CancelScope]] = {}
        self.replaced = 0  # streams ended because a newer one of the same certificate came
        self._most = (0, 0)  # the most models and endpoints routed since start: what series_cap allows
        self._static = 0  # static endpoints in the catalog
        self._static_urls: set[str] = set()
        self.connects = 0  # streams accepted since start (a restarted worker is one more)
        self.frozen = False
        # This start's secret, in the environment of the workers it starts (llmgw.server.gateway
        # .workers): a worker of an earlier server, left running by a kill -9 outside systemd, dials
        # the same gateway.sock with its own and is refused rather than serving beside ours.
        self.worker_key = secrets.token_urlsafe(32)

    # -- what the control plane publishes -------------------------------------------------------

    def publish_config(self, models: Sequence[Model | RouteModel], static: Sequence[StaticEndpoint],
                       settings: GatewaySettings) -> None:
        """Only the catalog's routing view is encoded, whatever the caller passed: a Model's
        profiles (their env: HF_TOKEN) and source URL (user:pass@, signed queries) never reach a
        gateway certificate (issue 40, finding 2)."""
        if self.frozen:
            return
        routing = [route_model(m) for m in models]
        self._catalog = (routing, list(static), settings)
        self._models = [m.name for m in routing]
        self._static = len(static)
        self._static_urls = {ep.url.rstrip("/") for ep in static}
        self._grow(len({m.name for m in routing} | {ep.model for ep in static}), len(static))
        data = encode(GatewayConfig(models=routing, static=list(static), settings=settings))
        n = max(1, self.local_workers)
        tls = self.public_tls
        local = encode(GatewayConfig(models=[divide_admission(m, n) for m in routing], static=list(static),
                                     settings=settings, api_url=self.api_socket,
                                     public_tls=TlsPublic(cert=tls.cert, key=tls.key, ca=tls.ca) if tls else None,
                                     public_tls_digest=tls.digest if tls else "", probes=True))
        if data != self._config or local != self._local_config:
            self._config, self._local_config = data, local
            self._digests = (config_digest(data), config_digest(local))
            self._config_changed = time.time()
            self._wake()

    def set_local_workers(self, count: int) -> None:
        """The server now runs `count` workers (a reload resized the pool): each model's admission
        is divided anew, and every worker is sent its new share."""
        self.local_workers = count
        if self._catalog is not None:
            self.publish_config(*self._catalog)

    def publish_endpoints(self, ready: Mapping[str, Iterable[str]], keys: Mapping[str, str], *,
                          settling: bool = False) -> None:
        """`settling`: the control plane restarted and has not rebuilt its endpoint set yet; the
        followers keep theirs and add these (GatewayEndpoints.settling)."""
        if self.frozen:
            return
        lists = {m: sorted(eps) for m, eps in ready.items()}
        self._grow(0, self._static + sum(len(eps) for eps in lists.values()))
        self.probes.keep({ep.rstrip("/") for eps in lists.values() for ep in eps} | self._static_urls)
        data = encode(GatewayEndpoints(ready=lists, keys=dict(keys), reasons=self._reasons(lists), settling=settling))
        if data != self._endpoints:
            self._endpoints = data
            self._wake()

    def publish_probe(self, endpoint: str, result: EngineHealth | EngineScrape) -> None:
        """A health check or scrape this server made of an engine (llmgw.server.gateway.probes),
        for its own workers, which probe nothing themselves while they follow (GatewayConfig.probes)."""
        if not self.frozen and self.local_workers:
            self.probes.add(endpoint, result)
            self._wake()

    def _grow(self, models: int, endpoints: int) -> None:
        self._most = (max(self._most[0], models), max(self._most[1], endpoints))

    @property
    def series_cap(self) -> int:
        """Series one follower may add to /metrics (SERIES_BASE and per model and endpoint)."""
        return SERIES_BASE + SERIES_PER_MODEL * self._most[0] + SERIES_PER_ENDPOINT * self._most[1]

    def _reasons(self, ready: Mapping[str, list[str]]) -> dict[str, str]:
        """Model → why it has no ready replica, for each catalog model without one (bounded)."""
        unready = [m for m in self._models if not ready.get(m)][:MAX_REASONS]
        return {m: reason[:MAX_REASON] for m in unready if (reason := self.not_ready_reason(m))}

    def freeze(self) -> None:
        """The control plane is shutting down: what it tears down on the way (streams closing,
        replicas no longer reported) is not news for the gateways, which keep the last state."""
        self.frozen = True

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def views(self, now: float | None = None) -> list[GatewayView]:
        now = time.time() if now is None else now
        return sorted((GatewayView(name=f.name, kind=f.kind, peer=f.peer, pid=f.pid, version=f.version, since=f.since,
                                   last_report=f.last_report or None, requests=f.requests if f.last_report else None,
                                   config=self._config_state(f, now))
                       for f in list(self.followers.values())), key=lambda v: (v.kind != "worker", v.name, v.since))

    def _config_state(self, follower: Follower, now: float) -> str | None:
        if not follower.config:
            return None
        if follower.config == self._digests[follower.kind == "worker"]:
            return "current"
        return "updating" if now - self._config_changed < BEHIND_AFTER else "behind"

    def served(self) -> dict[str, int]:
        """Requests each connected worker finished (for the bench and `ctl`)."""
        return {f.name: f.requests for f in self.followers.values()}

    # -- one follower's stream --------------------------------------------------------------------

    async def handle_local(self, channel: FleetChannel) -> None:
        await self.handle(channel, local=True)

    async def handle(self, channel: FleetChannel, *, local: bool = False) -> None:
        with trio.move_on_after(HELLO_TIMEOUT):
            first = await _receive(channel)
        hello = _decode(first) if first is not None else None
        if not isinstance(hello, GatewayHello):
            raise StreamRefused("bad_hello", "a gateway stream must open with GatewayHello")
        if local and not hmac.compare_digest(hello.key.encode(), self.worker_key.encode()):
            log.warning("gateway %s (pid %d) refused on the local feed: %s (a worker left running by an earlier "
                        "server?); it exits", printable(hello.name[:64]), hello.pid,
                        "it presented no worker key" if not hello.key else "its worker key is not this server's")
            raise StreamRefused("not_own_worker", NOT_OWN_WORKER)
        # A certificate's name wins over what the worker says (a remote gateway is who its certificate says).
        # Without a certificate (a lab's plain fleet port) the name is the peer's text: escaped, bounded.
        name = channel.tls_identity or printable(hello.name[:64])
        # A local worker comes over the Unix socket (no address): say so rather than "unknown".
        follower = Follower(name=name, peer="local (gateway.sock)" if local else channel.peer,
                            kind="worker" if local else "remote", pid=hello.pid,
                            version=printable(hello.version[:64]), since=time.time())
        key = id(follower)
        scope = trio.CancelScope()
        identity = channel.tls_identity if not local else None
        if identity:
            self._replace(identity, channel.peer)
            self._streams[identity] = (key, scope)
        self.followers[key] = follower
        self.connects += 1
        log.info("gateway %s (pid %d, %s) follows the control plane", name, hello.pid, channel.peer)
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_loop, channel, local)
                    while (payload := await _receive(channel)) is not None:
                        msg = _decode(payload)
                        if isinstance(msg, GatewayStats):
                            follower.metrics = msg.metrics
                            follower.requests = msg.requests
                            follower.config = msg.config[:64]
                            follower.last_report = time.time()
                    nursery.cancel_scope.cancel()
        finally:
            self.followers.pop(key, None)
            if identity and self._streams.get(identity, (0,))[0] == key:
                del self._streams[identity]
            log.info("gateway %s (pid %d) stopped following", name, hello.pid)
        if scope.cancelled_caught:
            raise StreamRefused("replaced", REPLACED)

    def _replace(self, identity: str, peer: str) -> None:
        """One stream per gateway certificate (issue 40, finding 5: four streams of one were four
        followers, each reporting its own metrics, listed four times): a new stream replaces the
        one before it, which is ended with REPLACED, and only the new one is listed from now."""
        before = self._streams.pop(identity, None)
        if before is None:
            return
        key, scope = before
        self.followers.pop(key, None)
        scope.cancel()
        self.replaced += 1
        log.warning("gateway %s: a new stream from %s replaces the one before it (one stream per gateway certificate)",
                    identity, peer)

    async def _send_loop(self, channel: FleetChannel, local: bool) -> None:
        sent_config = sent_endpoints = b""
        sent_probes, sent_probes_at = 0, -PROBES_EVERY
        try:
            while True:
                changed = self._changed
                config = self._local_config if local else self._config
                if config and config is not sent_config:
                    sent_config = config
                    await channel.send(config)
                if config and self._endpoints is not sent_endpoints:
                    sent_endpoints = self._endpoints
                    await channel.send(sent_endpoints)
                if config and local and self.probes.count > sent_probes:
                    if (wait := sent_probes_at + PROBES_EVERY - trio.current_time()) > 0:
                        await trio.sleep(wait)  # more results of the round come meanwhile
                        continue
                    probes, sent_probes, sent_probes_at = (self.probes.since(sent_probes), self.probes.count,
                                                           trio.current_time())
                    if probes is not None:
                        await channel.send(encode(probes))
                await changed.wait()
        except ChannelClosed:
            return


def divide_admission(model: RouteModel, workers: int) -> RouteModel:
    """`model` as one of `workers` workers applies it: its in-flight cap and queue divided
    (rounded up, so no worker is left at 0 = unlimited, and the total is at least the cap)."""
    adm = model.admission
    if workers <= 1 or (not adm.max_in_flight and not adm.max_queue):
        return model
    share = msgspec.structs.replace(adm, max_in_flight=-(-adm.max_in_flight // workers),
                                    max_queue=-(-adm.max_queue // workers))
    return msgspec.structs.replace(model, admission=share)


async def _receive(channel: FleetChannel) -> bytes | None:
    try:
        return await channel.receive()
    except ChannelClosed:
        return None


def _decode(payload: bytes) -> object:
    try:
        return decode_from_gateway(payload)
    except MessageError as exc:
        raise StreamRefused("malformed", str(exc)) from None


class WorkerMetrics(Collector):
    """Every follower's metrics, each sample labelled with the worker it came from.

    Parsing a report is the cost here (prometheus_client's parser, pure Python): a worker with
    1,000 models under traffic reports 2.7 MB, 0.6 s to parse, and a compromised gateway may send
    the feed's 4 MiB (1.9 s a scrape). `parse_reports` (the /metrics handler awaits it) parses each
    new report in steps of PARSE_STEP lines with a checkpoint between, so the event loop (the
    fleet's heartbeats, the feed, the gateway) is never held for a whole report; `collect` then
    takes the parsed families (and parses in one go only a report that came in between).

    Of each report only a gateway's own families and labels, up to the service's series_cap, are
    shown (`admit_report`); each series left out is counted once, in the report it came in, in
    llmgw_gateway_series_refused_total{worker, reason}."""

    def __init__(self, service: GatewayFeedService, local: CollectorRegistry | None = None) -> None:
        self.service = service
        # The server's own gateway's metrics (unlabelled, as before workers), when it serves the port.
        self.local = local
        self._warned: set[str] = set()  # followers already named in a warning (one line each, not one a scrape)
        self._parsed: dict[int, tuple[str, list[Metric]]] = {}  # follower key → (its report, what of it is shown)
        self.refused: dict[tuple[str, str], float] = {}  # (follower name, reason) → series left out

    async def parse_reports(self) -> None:
        followers = list(self.service.followers.items())
        for key, follower in followers:
            text = follower.metrics
            cached = self._parsed.get(key)
            if text and (cached is None or cached[0] is not text):
                parsed = await self._parse(follower, text, steps=True)
                # Admitting is a step of its own: 35 ms for a 4 MiB report's 60,000 series, measured.
                await trio.lowlevel.checkpoint()
                self._admit(key, follower, text, parsed)
        for key in set(self._parsed) - {key for key, _ in followers}:
            del self._parsed[key]

    async def _parse(self, follower: Follower, text: str, *, steps: bool) -> list[Metric]:
        try:
            return await parse_in_steps(text) if steps else list(text_string_to_metric_families(text))
        except ValueError as exc:
            log.warning("gateway %s sent metrics that do not parse: %s", follower.name, printable(str(exc)[:200]))
            return []

    def _families(self, key: int, follower: Follower) -> list[Metric]:
        text = follower.metrics
        cached = self._parsed.get(key)
        if cached is not None and cached[0] is text:
            return cached[1]
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as exc:
            log.warning("gateway %s sent metrics that do not parse: %s", follower.name, printable(str(exc)[:200]))
            parsed = []
        return self._admit(key, follower, text, parsed)

    def _admit(self, key: int, follower: Follower, text: str, parsed: list[Metric]) -> list[Metric]:
        """What of a new report is shown; what is not is counted (once: the result is kept)."""
        cap = self.service.series_cap
        admitted = admit_report(parsed, cap)
        self._parsed[key] = (text, admitted.families)
        if not any(admitted.refused.values()):
            return admitted.families
        name = follower.name
        if name not in {n for n, _ in self.refused} and len(self.refused) >= MAX_REFUSED_NAMES * len(REFUSED_REASONS):
            name = "other"
        for reason, n in admitted.refused.items():
            if n:
                self.refused[(name, reason)] = self.refused.get((name, reason), 0.0) + n
        if follower.name not in self._warned:
            self._warned.add(follower.name)
            foreign = sorted({f.name for f in parsed if f.name not in GATEWAY_FAMILIES})
            r = admitted.refused
            log.warning("gateway %s reports series no gateway exports, left out of /metrics and counted in "
                        "llmgw_gateway_series_refused_total: %d of other families%s, %d with labels a gateway does "
                        "not set, %d over its cap of %d series", follower.name, r["family"],
                        f" ({printable(', '.join(foreign)[:200])})" if foreign else "", r["labels"], r["cap"], cap)
        return admitted.families

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for family in self.local.collect() if self.local is not None else ():
            own = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            own.samples = list(family.samples)
        for key, follower in list(self.service.followers.items()):
            if not follower.metrics:
                continue
            for family in self._families(key, follower):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "worker": follower.name}, sample.value,
                                      sample.timestamp, sample.exemplar)
        yield from families.values()
        refused = CounterMetricFamily(
            "llmgw_gateway_series_refused",
            "Series of gateways' metrics reports left out of /metrics, by gateway and reason: family (not one a "
            "gateway exports), labels (a label it does not set, or a value over 512 characters), cap (over its "
            "series cap, gateway feed SERIES_BASE + per model and endpoint). Counted once, in the report they came in.",
            labels=["worker", "reason"])
        for (name, reason), n in sorted(self.refused.items()):
            refused.add_metric([name, reason], n)
        yield refused


# lines of a report parsed between two checkpoints: the loop waits at most ~60 ms (a 39,000-line
# report took 0.65 s in one piece)
PARSE_STEP = 2000


async def parse_in_steps(text: str, step: int = PARSE_STEP) -> list[Metric]:
    """`text_string_to_metric_families(text)`, PARSE_STEP lines at a time with a checkpoint between:
    each step is parsed with its family's `# HELP`/`# TYPE` lines before it, and a family cut
    across steps is joined again. Raises ValueError as the parser does."""
    families: dict[str, Metric] = {}
    head: list[str] = []  # the current family's comment lines
    chunk: list[str] = []
    after_sample = True

    def take() -> None:
        for family in text_string_to_metric_families("\n".join(chunk) + "\n"):
            have = families.get(family.name)
            if have is None:
                families[family.name] = family
            else:
                have.samples.extend(family.samples)

    for line in text.splitlines():
        chunk.append(line)
        if line.startswith("#"):
            head = [line] if after_sample else [*head, line]
            after_sample = False
            continue
        after_sample = True
        if len(chunk) >= step:
            take()
            chunk = list(head)
            await trio.lowlevel.checkpoint()
    if len(chunk) > len(head):
        take()
    return list(families.values())
