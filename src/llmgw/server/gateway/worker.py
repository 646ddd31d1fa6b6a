"""A gateway worker: the /v1 proxy in a process of its own, fed by the control plane.

It follows the control plane's gateway feed (llmgw.wire.gateway) and serves what it was told:
its own balancer, breakers, health state and admission (per worker, see `gateway.workers` in
the config reference), its own keep-alive pools. A server's own worker does not ask the engines
for their health and metrics itself: its server does, once for all its workers, and sends the
answers on the feed (GatewayProbes), which the worker feeds to its balancers as its own; while it
has lost the feed it asks them itself. Two ways to run one:

- `gateway.workers: N` in the server config: the control plane starts N of these (llmgw.server
  .gateway.workers), each accepting on the public port with SO_REUSEPORT, following over a Unix
  socket in the state directory; the rest of the public port (/api/v1, /admin, /metrics) is
  forwarded to the control plane over a second Unix socket.
- `llmgw gateway --control-plane URL --listen ADDR` on another machine: follows over the fleet
  port with a gateway certificate (`llmgw ctl cert gateway NAME`) and serves /v1 and /healthz,
  its own /metrics only on --metrics-listen.

When the control plane goes away the worker keeps serving with the last state it had, says so
(a warning, `llmgw_gateway_control_plane_connected 0`) and dials again with backoff.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import ssl
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from llmgw import __version__, hotpath
from llmgw.errors import UsageError, leaves
from llmgw.fleet import FleetChannel, dial
from llmgw.gwsettings import GatewaySettings, TlsPublic
from llmgw.server.gateway import forwarded
from llmgw.server.gateway.apikeys import ClientDoor
from llmgw.server.gateway.fastlane import GatewayLane
from llmgw.server.gateway.metrics import GatewayMetrics, watch_gateway
from llmgw.server.gateway.openai_api import openai_error
from llmgw.server.gateway.proxy import JSON, Gateway
from llmgw.tls.context import ServerTls
from llmgw.web.client import Upstream, UpstreamError
from llmgw.web.fastserve import FastPath
from llmgw.web.reactor import Reactor
from llmgw.web.relay import RelayHub, relay_body
from llmgw.web.server import HttpServer, Limits, Request, Responder
from llmgw.wire.gateway import (
    GATEWAY_PATH,
    NOT_OWN_WORKER,
    REPLACED,
    GatewayConfig,
    GatewayEndpoints,
    GatewayHello,
    GatewayProbes,
    GatewayStats,
    MessageError,
    config_digest,
    decode_to_gateway,
    encode,
)

log = logging.getLogger("llmgw.gateway")

STATS_EVERY = 1.0  # seconds between two metrics reports to the control plane
BACKOFF = (0.1, 5.0)  # first and longest wait between two dials of the control plane
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection",
              b"content-length", b"host"}
NOT_FORWARDED = HOP_BY_HOP | forwarded.HEADERS  # the client's address and certificate: the worker's to say
FORWARD_TIMEOUT = 600.0  # an API answer (or an event stream's silence) may take this long


class Follow:
    """How this worker reaches the control plane: a Unix socket (local) or the fleet port (remote)."""

    def __init__(self, *, unix_path: str = "", url: str = "", ssl_context: ssl.SSLContext | None = None,
                 insecure: bool = False, max_message: int = 4 * 1024 * 1024) -> None:
        self.unix_path = unix_path
        self.url = url
        self.ssl_context = ssl_context
        self.insecure = insecure
        self.max_message = max_message

    def where(self) -> str:
        return self.unix_path or self.url

    def dial(self) -> AbstractAsyncContextManager[FleetChannel]:
        return dial(self.url, ssl_context=self.ssl_context, insecure=self.insecure, max_message=self.max_message,
                    path=GATEWAY_PATH, unix_path=self.unix_path, idle_timeout=None)


class GatewayWorker:
    def __init__(self, name: str, follow: Follow, *, local: bool, public_tls: ServerTls | None = None,
                 worker_key: str = "") -> None:
        self.name = name
        self.follow = follow
        self.local = local  # a local worker forwards the non-/v1 paths to the control plane
        self.worker_key = worker_key  # a local worker's proof that its server started it (GatewayHello.key)
        self.disowned = trio.Event()  # set when the control plane refused it as not its own worker: it exits
        # The client port's TLS: a remote gateway's own files (--public-tls-*), a local worker's
        # from the control plane (its public_tls, in GatewayConfig).
        self.public_tls = public_tls
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.hub = RelayHub(coalesce=float(GatewaySettings().stream_coalesce))
        # The client door alone: the control plane keeps the others and says what it should about
        # them and its port. A gateway on another machine without TLS on its client port says that
        # API keys cross it in clear text (a local worker's port is its server's, whose notes say it).
        self.door = ClientDoor(cleartext=not local and public_tls is None)
        self.gateway = Gateway(GatewaySettings(), self.metrics, relay_hub=self.hub, client_door=self.door.allows,
                               not_ready_reason=self._not_ready)
        watch_gateway(self.registry, self.gateway)
        self.reactor = Reactor()
        self.lane = GatewayLane(self.gateway, self.reactor)
        self.connected = Gauge("llmgw_gateway_control_plane_connected",
                               "1 while this gateway follows the control plane; 0: it serves with its last state.",
                               registry=self.registry)
        self.updates = Counter("llmgw_gateway_control_plane_updates", "Updates received from the control plane.",
                               registry=self.registry)
        self.last_update = Gauge("llmgw_gateway_control_plane_last_update_timestamp_seconds",
                                 "When the last update from the control plane came (unix time).",
                                 registry=self.registry)
        Gauge("llmgw_gateway_worker_pid", "This gateway process's id (a restarted worker has a new one).",
              registry=self.registry).set(os.getpid())
        self.settling_gauge = Gauge("llmgw_gateway_control_plane_settling",
                                    "1 while the control plane has not rebuilt its endpoint set since it restarted: "
                                    "this gateway keeps its last one.", registry=self.registry)
        self.control_plane_settling = False
        self.requests = 0
        self.config_digest = ""  # of the GatewayConfig last applied: reported, so `ctl gateways` says if it is current
        self.reasons: dict[str, str] = {}  # model → why it has no ready replica (GatewayEndpoints.reasons)
        self.following = False
        # The control plane probes the engines for this worker (GatewayConfig.probes): while it
        # follows, it asks them nothing itself. `_probing_changed` is set when either changes.
        self.probed_for_us = False
        self._probing_changed = trio.Event()
        self.configured = trio.Event()  # the first GatewayConfig came: serving makes sense
        self.api: Upstream | None = None
        self.http: HttpServer | None = None

    def _not_ready(self, model: str) -> str:
        said = self.reasons.get(model, "")  # the control plane's reason, as its own gateway logs it
        if not self.following:
            return (f"gateway {self.name} has lost the control plane and serves its last endpoint set"
                    + (f"; it last said: {said}" if said else ""))
        return said or "no ready replica (as the control plane last said)"

    # -- following -------------------------------------------------------------------------------

    async def run_follower(self) -> None:
        """Follow forever: dial, apply what comes, report; on a break keep the state and dial again."""
        wait, rng = BACKOFF[0], random.Random()
        lost_said = False
        while True:
            try:
                async with self.follow.dial() as channel:
                    await channel.send(encode(GatewayHello(name=self.name, version=__version__, pid=os.getpid(),
                                                           key=self.worker_key)))
                    # Following from the control plane's first message, not from the stream's opening: a
                    # refused gateway (revoked, not a gateway certificate) has its stream opened and then
                    # ended with the reason, and said "following ... again" and "lost" on every dial.
                    self._apply(await channel.receive())
                    self.connected.set(1)
                    self._follows(True)
                    if lost_said:
                        log.info("gateway %s: following the control plane at %s again", self.name, self.follow.where())
                    lost_said = False
                    wait = BACKOFF[0]
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._report, channel)
                        while True:
                            self._apply(await channel.receive())
            except Exception as exc:  # a refused dial, the stream's end, a malformed message: dial again
                leaf = leaves(exc)[0] if isinstance(exc, BaseExceptionGroup) else exc
                why = str(leaf) or type(leaf).__name__
            self.connected.set(0)
            self._follows(False)
            if NOT_OWN_WORKER in why:  # another server's socket now: this worker's own server is gone
                log.error("gateway %s: the control plane at %s refused it: %s; exiting", self.name,
                          self.follow.where(), why)
                self.disowned.set()
                return
            if REPLACED in why:  # another process follows with this certificate: let it, for a while
                log.warning("gateway %s: the control plane at %s ended this stream: %s; is another gateway "
                            "running with this certificate? Dialling again in %gs", self.name, self.follow.where(),
                            why, BACKOFF[1])
                wait = BACKOFF[1]
            if not lost_said:
                if self.configured.is_set():
                    log.warning("gateway %s: lost the control plane at %s (%s); serving with the last endpoint set "
                                "(%d endpoint(s)) and dialling again", self.name, self.follow.where(), why,
                                len(self.gateway.table.upstreams))
                else:  # nothing to serve with yet: its port does not listen
                    log.warning("gateway %s: cannot follow the control plane at %s (%s); not serving until it does, "
                                "dialling again", self.name, self.follow.where(), why)
                lost_said = True
            await trio.sleep(wait * (0.5 + rng.random()))
            wait = min(wait * 2, BACKOFF[1])

    def _follows(self, following: bool, *, probed: bool | None = None) -> None:
        """Whether it follows now, and (`probed`) whether the control plane probes for it."""
        probed = self.probed_for_us if probed is None else probed
        if (following, probed) != (self.following, self.probed_for_us):
            self.following, self.probed_for_us = following, probed
            self._probing_changed.set()
            self._probing_changed = trio.Event()

    def _apply(self, payload: bytes) -> None:
        try:
            msg = decode_to_gateway(payload)
        except MessageError as exc:
            raise ValueError(f"the control plane sent a malformed message: {exc}") from None
        if isinstance(msg, GatewayProbes):  # not counted as an update: several a second
            probes = self.gateway.probes
            for endpoint, health in msg.health.items():
                probes.health_result(endpoint, health.ok, health.reason)
            for endpoint, scrape in msg.scrapes.items():
                probes.scrape_result(endpoint, scrape)
            return
        if isinstance(msg, GatewayConfig):
            self._follows(self.following, probed=msg.probes)
            self.gateway.configure(msg.models, msg.static, msg.settings)
            self.door.configure(msg.settings.api_keys)
            if self.local and msg.api_url and self.api is None:
                self.api = Upstream("http://control-plane", unix_path=msg.api_url, max_idle=16)
            if self.local and msg.public_tls is not None:
                self._take_tls(msg.public_tls, msg.public_tls_digest)
            if not self.local or msg.public_tls is None or self.public_tls is not None:
                self.configured.set()  # with TLS to terminate, not before a context is built
            self.config_digest = config_digest(payload)
        elif isinstance(msg, GatewayEndpoints):
            self._settling(msg.settling)
            self.gateway.set_endpoints(msg.ready, msg.keys, settling=msg.settling)
            self.reasons = msg.reasons
        else:
            return  # a newer control plane's message: skipped
        self.updates.inc()
        self.last_update.set_to_current_time()

    def _settling(self, settling: bool) -> None:
        """A restarted control plane says it has not rebuilt its endpoint set: the last one is kept
        (and its endpoints stay in rotation while they answer) until it has settled. Said once each way."""
        if settling == self.control_plane_settling:
            return
        self.control_plane_settling = settling
        self.settling_gauge.set(1 if settling else 0)
        if settling:
            log.warning("gateway %s: the control plane is settling (it restarted and waits for its nodes); keeping "
                        "the last endpoint set (%d endpoint(s)) until it has", self.name,
                        len(self.gateway.table.upstreams))
        else:
            log.info("gateway %s: the control plane has settled; following its endpoint set", self.name)

    def control_plane(self) -> str:
        """What /healthz on the metrics listener says of the control plane."""
        if not self.following:
            return "lost"
        return "settling" if self.control_plane_settling else "following"

    def _take_tls(self, files: TlsPublic, digest: str) -> None:
        """The control plane's public_tls, built here with the same builder; rebuilt when the
        files' digest changed (renewed and reloaded). A failure keeps the running context."""
        tls = self.public_tls
        try:
            if tls is None:
                self.public_tls = ServerTls(files.cert, files.key, files.ca)
                log.info("gateway %s: public port TLS with %s", self.name, files.cert)
            elif digest != tls.digest and tls.reload():
                log.info("gateway %s: public port TLS reloaded from %s", self.name, files.cert)
        except UsageError as exc:
            log.error("gateway %s: public_tls: %s%s", self.name, exc,
                      "; the running certificate stays" if tls is not None else "; not serving until it can be read")

    async def run_probes(self) -> None:
        """The engines' health checks and metrics scrapes, made here unless the control plane
        makes them for this worker and it follows (a server's own worker: one process per
        machine asks each engine, issue 42); a gateway on another machine always makes its own."""
        while True:
            if self.following and self.probed_for_us:
                await self._probing_changed.wait()
                continue
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.gateway.run_scraper)
                nursery.start_soon(self.gateway.run_health_checks)
                while not (self.following and self.probed_for_us):
                    await self._probing_changed.wait()
                nursery.cancel_scope.cancel()

    async def _report(self, channel: FleetChannel) -> None:
        while True:
            requests = int(sum(s.value for m in self.metrics.requests.collect() for s in m.samples
                               if s.name.endswith("_total")))
            self.requests = requests
            text = generate_latest(self.registry).decode()
            await channel.send(encode(GatewayStats(metrics=text, requests=requests, config=self.config_digest)))
            await trio.sleep(STATS_EVERY)

    # -- serving ---------------------------------------------------------------------------------

    async def __call__(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path.startswith("/v1/"):
            await self.gateway.handle(request, responder)
        elif path == "/healthz":
            await responder.respond(200, [JSON], b'{"status":"ok"}')
        elif self.local and self.api is not None:
            await self._forward(self.api, request, responder)
        else:
            await responder.respond(404, [JSON], openai_error(f"unknown route {path} on gateway {self.name}",
                                                             "invalid_request_error", "not_found"))

    async def metrics_door(self, request: Request, responder: Responder) -> None:
        """The metrics listener of a gateway on another machine (--metrics-listen): its metrics
        name engine addresses, which never reach the client port (the control plane's /metrics
        shows them too, behind its viewer door)."""
        if request.path == "/metrics":
            await responder.respond(200, [(b"content-type", b"text/plain; version=0.0.4")],
                                    generate_latest(self.registry))
        elif request.path == "/healthz":  # this listener may say more than ok: "following", "settling", "lost"
            await responder.respond(200, [JSON],
                                    b'{"status":"ok","control_plane":"%s"}' % self.control_plane().encode())
        else:
            await responder.respond(404, [JSON], openai_error("this listener serves /metrics and /healthz",
                                                             "invalid_request_error", "not_found"))

    async def _forward(self, api: Upstream, request: Request, responder: Responder) -> None:
        """/api/v1, /admin and /metrics, passed to the control plane as they came (its doors decide)."""
        headers = [(k, v) for k, v in request.head.headers if k not in NOT_FORWARDED] + forwarded.peer_headers(request)
        try:
            response = await api.request(request.head.method, request.head.target, headers, request.body,
                                         head_timeout=FORWARD_TIMEOUT)
        except UpstreamError as exc:
            await responder.respond(502, [JSON],
                                    openai_error(f"the control plane did not answer: {exc}", "server_error"))
            return
        relay = [(k, v) for k, v in response.head.headers if k not in HOP_BY_HOP]
        if not response.head.chunked:
            body = await response.read(FORWARD_TIMEOUT)
            await responder.respond(response.status, relay, body)
            return
        await responder.start(response.status, relay)
        await relay_body(response, responder, self.hub, FORWARD_TIMEOUT)

    async def serve(self, socks: Iterable[socket.socket], *, metrics_socks: Iterable[socket.socket] = (),
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow, wait for the first configuration, then serve on `socks` until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.run_follower)
            await self.configured.wait()
            await nursery.start(self.hub.run)
            await nursery.start(self.reactor.run)
            settings = self.gateway.settings
            self.http = HttpServer(self, limits=Limits(
                max_body=int(settings.max_body), body_timeout=float(settings.body_timeout),
                header_timeout=float(settings.header_timeout), max_connections=int(settings.max_connections)),
                lane=FastPath(self.lane))
            if self.public_tls is not None:
                self.public_tls.attach(self.http)
            # Listening only now: the kernel hands a listening socket its share of the port's new
            # connections (SO_REUSEPORT) and completes them, so a worker still waiting for its
            # first config, or for TLS files it cannot read, would hold that share unanswered
            # (5 of 8 requests hung behind one such worker of two).
            for s in socks:
                s.listen(4096)
            listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in socks]
            await nursery.start(self.http.serve, listeners)
            metrics = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in metrics_socks]
            if metrics:
                await nursery.start(HttpServer(self.metrics_door).serve, metrics)
            nursery.start_soon(self.run_probes)
            nursery.start_soon(self.gateway.run_disconnect_watchdog)
            log.info("gateway %s serving (following %s); %s", self.name, self.follow.where(), hotpath.summary())
            task_status.started()


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port that other workers share (SO_REUSEPORT: the kernel spreads
    new connections across every worker's listening socket; a dead worker's share goes to the
    others). It listens once the worker can serve (`GatewayWorker.serve`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock
