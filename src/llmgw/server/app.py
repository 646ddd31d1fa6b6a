"""`llmgw server`: one trio process with two listeners, the public port and the fleet port.

This module is the composition root and nothing else: `ControlPlane` builds the server's parts
in dependency order and runs their tasks; `run_server` binds the ports first (one clear line
for a port in use) and serves until a signal. What each part does lives in its module:

    auth.py           who is calling (API keys, operator and viewer credentials; one digest check)
    operator.py       what an operator changes: reload, forget, restart (drain and cordon next)
    views.py          what the API and the gateway read (typed read models)
    api.py            the JSON API's routes, each behind a door; fabric and doctor endpoints
                      are rows there; the admin pages are a handler of their own (server/admin/)
    control.py        the reconciler's driver; reconcile.py, observe.py and states.py its pure core
    fleet_service.py  the fleet port's streams; gateway/ the /v1 proxy
    gwfeed.py         the gateway feed: what gateway workers (gateway/workers.py starts the local
                      ones) and gateways on other machines are told, and their metrics
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import ssl
import time
from typing import Any

import msgspec
import trio
from prometheus_client import CollectorRegistry

from llmgw import __version__, hotpath
from llmgw.catalog.schema import ServerConfig
from llmgw.errors import UsageError
from llmgw.fleet import FleetListener
from llmgw.fleet.limits import Caps, RefusalLog
from llmgw.netaddr import hostport
from llmgw.runtime import settle_garbage_collector
from llmgw.server.admin.pages import AdminPages, package_assets
from llmgw.server.alertmetrics import AlertCollector, CheckResults
from llmgw.server.api import PublicHandler
from llmgw.server.auth import Auth
from llmgw.server.control import Controller, Settle, make_reconciler
from llmgw.server.doctor import DoctorService
from llmgw.server.drain import Drainer, MarkStore
from llmgw.server.events import EventFeeds, EventLog, RecordingObserver, chain, port_events
from llmgw.server.fabric_service import FabricCollector, FabricService
from llmgw.server.fabric_store import FabricStore
from llmgw.server.fabric_test import FabricTests
from llmgw.server.fleet_service import FleetService, Session
from llmgw.server.gateway.fastlane import GatewayLane
from llmgw.server.gateway.forwarded import trusting_forwarded_peers
from llmgw.server.gateway.metrics import GatewayMetrics, watch_gateway
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.gateway.workers import WorkerPool
from llmgw.server.gwfeed import GatewayFeedService, WorkerMetrics
from llmgw.server.known_nodes import KnownNodes
from llmgw.server.last_endpoints import LastEndpoints
from llmgw.server.links import FleetLinks
from llmgw.server.logfollow import ModelLogs
from llmgw.server.logs import EngineLogs, LogHub
from llmgw.server.metrics import ServerMetrics
from llmgw.server.operator import Operator
from llmgw.server.registry import NodeRegistry
from llmgw.server.remedy_service import RemedyService
from llmgw.server.views import FleetReads, GatewayFeed
from llmgw.server.wakeup import Wakeup
from llmgw.server.weights import WeightsBoard
from llmgw.tls import server_context
from llmgw.tls.context import ServerTls
from llmgw.tls.info import cert_not_after
from llmgw.tls.revocation import Revocations, fleet_refusal, gateway_refusal
from llmgw.web.fastserve import FastPath
from llmgw.web.listen import bind_socket, unix_socket
from llmgw.web.reactor import Reactor
from llmgw.web.relay import RelayHub
from llmgw.web.server import Handler, HttpServer, Limits

log = logging.getLogger("llmgw.server")


class Bound(msgspec.Struct, frozen=True):
    public_url: str
    fleet_url: str
    admin_url: str = ""  # the admin listener (admin_listen), when one is configured


def _url(scheme: str, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{scheme}://{hostport(host, port)}"


def fleet_ssl_context(cfg: ServerConfig) -> ssl.SSLContext:
    tls = cfg.tls
    assert tls is not None
    return server_context(tls.cert, tls.key, tls.ca or None, require_client_cert=True, alpn=("h2",))


class ControlPlane:
    """The composition root: every part of the server, built in dependency order (nothing is
    wired afterwards), and the tasks that run them. Behaviour lives in the parts."""

    def __init__(self, cfg: ServerConfig, *, insecure: bool = False, config_path: str | None = None,
                 overrides: dict[str, Any] | None = None) -> None:
        if cfg.tls is None and not insecure:
            raise UsageError(
                "the fleet port needs TLS: set tls.cert, tls.key and tls.ca in the server config "
                "(issue them with `llmgw ctl cert`), or pass --insecure for a lab"
            )
        if cfg.tls is not None and (not cfg.tls.cert or not cfg.tls.key):
            raise UsageError("tls: both tls.cert and tls.key are needed for the fleet port")
        self.cfg = cfg
        # The public port's TLS (built now: a bad file is one line before anything starts), handed
        # to each listener of the public port, to the gateway workers through the feed, and read
        # again on reload.
        public_tls = cfg.public_tls
        try:
            self.public_tls = (ServerTls(public_tls.cert, public_tls.key, public_tls.ca)
                               if public_tls and public_tls.cert else None)
        except UsageError as exc:
            raise UsageError(f"public_tls: {exc}") from None  # which key of the config names the file
        fleet = cfg.fleet
        require_identity = bool(cfg.tls and cfg.tls.require_identity)
        # Who may call: the deny list, then the doors of the public port.
        self.revocations = Revocations(cfg.tls.deny_list if cfg.tls else "")
        self.registry = NodeRegistry(fleet.heartbeat_interval, fleet.unreachable_after, fleet.lost_after)
        self.metrics = ServerMetrics(self.registry.counts, nodes=lambda: self.registry.nodes.values())
        self.auth = Auth(cfg, insecure=insecure, count=self.metrics.count_auth_failure,
                         revoked=self.revocations.refuses)
        # The reconciler and what the gateway learns from it.
        self.known_nodes = KnownNodes(cfg.state_dir)
        # What happened, kept across restarts (its writer task starts first in run()).
        self.events = EventLog(cfg.state_dir, retention=float(cfg.events.retention))
        reconciler = make_reconciler(cfg.models, cfg.reconcile, placement=cfg.placement)
        settle = Settle(cfg.reconcile, self.registry, self.known_nodes)
        self.last_endpoints = LastEndpoints(cfg.state_dir)  # what a restart serves until it has settled
        feed = GatewayFeed(reconciler, settle, trio.current_time, self.last_endpoints)
        # Relays every streamed answer; its task starts (nursery.start) before the public port opens.
        self.relay_hub = RelayHub(coalesce=float(cfg.gateway.stream_coalesce))
        # Serves plain requests on the public port by callback (llmgw.server.gateway.fastlane).
        self.reactor = Reactor()
        # Gateway workers (gateway.workers > 1) serve the public port in processes of their own;
        # they and gateways on other machines follow the feed. /metrics shows every follower's
        # counters with a `worker` label, and this process's own gateway's when it serves the port.
        self.workers = cfg.gateway.worker_count(os.cpu_count() or 1)
        self.feed_socket = os.path.join(cfg.state_dir, "gateway.sock")
        self.api_socket = os.path.join(cfg.state_dir, "api.sock")
        self.followers = GatewayFeedService(local_workers=self.workers if self.workers > 1 else 0,
                                            api_socket=self.api_socket if self.workers > 1 else "",
                                            not_ready_reason=feed.not_ready_reason,
                                            public_tls=self.public_tls if self.workers > 1 else None)
        gateway_registry = CollectorRegistry()
        gateway = Gateway(cfg.gateway, GatewayMetrics(gateway_registry), relay_hub=self.relay_hub,
                          client_door=self.auth.client_door.allows, not_ready_reason=feed.not_ready_reason,
                          followers=self.followers)
        watch_gateway(gateway_registry, gateway)
        self.worker_metrics = WorkerMetrics(self.followers, gateway_registry if self.workers == 1 else None)
        self.metrics.registry.register(self.worker_metrics)
        gateway.configure(cfg.models, cfg.endpoints)
        self.gateway = gateway
        self.lane = GatewayLane(gateway, self.reactor)
        # The live stream of each node: the fleet service adds and removes them, the controller,
        # the fabric service, the fabric tests and the log hub send on them (server/links.py).
        links = FleetLinks[Session]()
        weights = WeightsBoard()  # weight downloads of starting shards, and their metrics (issue 12)
        # "Make a pass now": asked by the drainer and the remedy service, waited on by the controller.
        wakeup = Wakeup()
        # Cordon and drain marks, kept across restarts; drains move replicas after each pass.
        self.drainer = Drainer(MarkStore(cfg.state_dir), reconciler, self.registry, now=trio.current_time,
                               wake=wakeup.wake,
                               record=lambda kind, message, node: self.events.record(kind, message, node=node))
        # A fleet that heals itself (issue 43): doctor's GPU findings → unplaceable GPUs, auto-cordons, moves.
        self.remedy = RemedyService(cfg.remedy, self.registry, reconciler, self.drainer,
                                    record=lambda kind, message, node: self.events.record(kind, message, node=node),
                                    metrics=self.metrics.registry, wake=wakeup.wake)
        # The fabric map: asks agents on the same streams, keeps its history in the state dir.
        self.fabrics = FabricService(self.registry, links, FabricStore(cfg.state_dir), cfg.fabric)
        self.metrics.registry.register(FabricCollector(self.fabrics))
        # What the API, the admin pages and the event feeds read.
        self.reads = FleetReads(self.registry, reconciler, gateway, weights, self.fabrics, marks=self.drainer,
                                followers=self.followers, unplaceable=self.remedy.unplaceable)
        self.event_feeds = EventFeeds(self.events, reconciler.replicas.values, self.reads.endpoints,
                                      reconciler.drain_notes)
        self.controller = Controller(
            reconciler,
            self.registry,
            settle=settle,
            links=links,
            known=self.known_nodes,
            on_pass=chain(lambda: _hand_endpoints(gateway, feed), self.event_feeds.after_pass,
                          self.drainer.after_pass),
            on_refused=self.metrics.count_refused,
            weights=weights,
            places=lambda: self.fabrics.places,  # multi-node placement reads the fabric map's latest view
            cordoned=self.drainer.cordoned,
            unplaceable=self.remedy.unplaceable,
            wakeup=wakeup,
        )
        # `ctl logs`: engine log chunks from the streams to their readers.
        self.log_hub = LogHub(links)
        self.refusal_log = RefusalLog(logging.getLogger("llmgw.fleet"), every=float(fleet.refusal_log_interval))
        # `ctl fabric-test`: ib_write_bw between two nodes' agents, over the same streams.
        results = CheckResults(time.time)  # the last doctor run and fabric tests, for /metrics
        self.fabric_tests = FabricTests(self.registry, links, results=results, grace=float(cfg.fabric.test_grace),
                                        install_wait=float(cfg.fabric.test_install_wait))
        self.fleet = FleetService(
            self.registry,
            self.metrics,
            register_timeout=fleet.register_timeout,
            require_identity=require_identity,
            endpoint_host=fleet.endpoint_host,
            observer=RecordingObserver(self.controller, self.events),
            caps=Caps(gpus=fleet.max_gpus, ports=fleet.max_ports, shards=fleet.max_shards),
            heartbeat_rate=float(fleet.max_heartbeat_rate),
            refusal_log=self.refusal_log,
            links=links,
            on_discover=self.fabrics.on_result,
            log_hub=self.log_hub,
            fabric_tests=self.fabric_tests,
            max_message=int(fleet.max_message),
            on_port_change=lambda node_id, changes: port_events(self.events, node_id, changes),
        )
        fleet_ctx = None if cfg.tls is None else fleet_ssl_context(cfg)
        self.fleet_tls = fleet_ctx is not None
        self.fleet_listener = FleetListener(
            self.fleet.handle,
            ssl_context=fleet_ctx,
            max_message=fleet.max_message,
            handshake_timeout=fleet.register_timeout,
            # A registered connection silent for twice the unreachable threshold is dead; the
            # register timeout alone governs a connection that has not registered yet.
            idle_timeout=2 * self.registry.silence_limit + fleet.register_timeout,
            on_refused=self.metrics.count_refused,
            peer_check=lambda peer: self.event_feeds.fleet_refusal(
                fleet_refusal(peer, self.revocations, require_node=require_identity)),
            refusal_log=self.refusal_log,
            gateway_handler=self.followers.handle,
            gateway_check=lambda peer: gateway_refusal(peer, self.revocations),
        )
        # The server's own workers follow on a Unix socket (its file mode keeps other users out), each
        # with this start's key in its hello (a worker of an earlier server is refused).
        self.feed_listener = FleetListener(_no_nodes_here, ssl_context=None, max_message=fleet.max_message,
                                           gateway_handler=self.followers.handle_local,
                                           on_refused=self.metrics.count_refused)
        # The gateway workers: started in run(), once the public port is bound (None until then, and
        # with gateway.workers = 1); the operator's reload reads whichever is current.
        self.worker_pool: WorkerPool | None = None
        # What operators change.
        self.operator = Operator(cfg, config_path=config_path, overrides=overrides, auth=self.auth, gateway=gateway,
                                 controller=self.controller, registry=self.registry, revocations=self.revocations,
                                 end_revoked_streams=self.fleet_listener.recheck, drainer=self.drainer,
                                 public_tls=self.public_tls,
                                 record=lambda kind, message: self.events.record(kind, message),
                                 feed=self.followers, worker_pool=lambda: self.worker_pool, cores=os.cpu_count() or 1,
                                 set_remedy=self.remedy.configure)
        self.metrics.registry.register(weights)  # llmgw_weights_* (issue 12)
        self.engine_logs = EngineLogs(self.log_hub, reconciler.replicas.get)
        self.model_logs = ModelLogs(self.log_hub, reconciler)  # `ctl logs MODEL`, following it across moves
        self.admin_pages = AdminPages(reads=self.reads, auth=self.auth, assets=package_assets(), events=self.events,
                                      tls=self.public_tls is not None)
        # GET /api/v1/doctor (issue 14)
        self.doctor = DoctorService(self.registry, reconciler, self.fabrics, results=results)
        # What alerts are written on: replicas wanted and ready, certificate expiry, the last checks.
        own = [("server", port, cert_not_after(tls.cert))
               for port, tls in (("fleet-port", cfg.tls), ("public-port", public_tls))
               if tls is not None and tls.cert]  # read once: a new file takes a restart, as the listeners do
        self.metrics.registry.register(AlertCollector(
            lambda: {name: model.replicas for name, model in reconciler.models.items()}, reconciler.replicas.values,
            lambda: [*own, *(("node", n.id, n.cert_not_after) for n in self.registry.nodes.values())], results))
        self.http_servers: list[HttpServer] = []  # the public port's and the admin listener's
        self.shutdown_event = trio.Event()

    def handler(self, *, clients: bool = True, admin: bool = True) -> PublicHandler:
        """One listener's routes (the public port; the admin listener serves no clients)."""
        return PublicHandler(reads=self.reads, actions=self.operator, auth=self.auth, gateway=self.gateway,
                             render_metrics=self.metrics.render, clients=clients, admin=admin,
                             events=self.events, engine_logs=self.engine_logs, model_logs=self.model_logs,
                             pages=self.admin_pages, fabric_tests=self.fabric_tests, doctor=self.doctor,
                             prepare_metrics=self.worker_metrics.parse_reports)

    async def run(
        self,
        *,
        public_sock: socket.socket,
        fleet_sock: socket.socket,
        admin_sock: socket.socket | None = None,
        task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        if not self.fleet_tls:
            log.warning(
                "the fleet port runs plain h2c (--insecure): any process that can reach it can "
                "register as any node. Use TLS outside a lab."
            )
        public_scheme = "https" if self.cfg.public_tls else "http"
        bound = Bound(
            public_url=_url(public_scheme, public_sock),
            fleet_url=_url("https" if self.fleet_tls else "http", fleet_sock),
            admin_url=_url(public_scheme, admin_sock) if admin_sock is not None else "",
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(self.events.run)
            fleet_listener = trio.SocketListener(trio.socket.from_stdlib_socket(fleet_sock))
            await nursery.start(self.fleet_listener.serve, [fleet_listener])
            await nursery.start(self.relay_hub.run)
            await nursery.start(self.reactor.run)
            if self.workers > 1:
                # The workers accept on the public port (and terminate its TLS); this process serves
                # what they forward (/api/v1, /admin, /metrics, with the client certificate they
                # verified) on a Unix socket, and feeds them on another.
                await nursery.start(functools.partial(self._serve_public, unix_socket(self.api_socket),
                                                      trusting_forwarded_peers(self.handler(clients=False)), tls=False))
                await nursery.start(
                    self.feed_listener.serve,
                    [trio.SocketListener(trio.socket.from_stdlib_socket(unix_socket(self.feed_socket)))])
                host, port = public_sock.getsockname()[:2]
                self.worker_pool = WorkerPool(self.workers, listen=hostport(host, port), feed_socket=self.feed_socket,
                                              key=self.followers.worker_key,
                                              log_level=logging.getLevelName(logging.getLogger().level).lower(),
                                              debug=log.isEnabledFor(logging.DEBUG))
                await nursery.start(self.worker_pool.run)
            else:
                await nursery.start(functools.partial(self._serve_public, public_sock,
                                                      self.handler(admin=admin_sock is None), lane=self.lane))
            if admin_sock is not None:
                await nursery.start(self._serve_public, admin_sock, self.handler(clients=False))
            # This process probes the engines for its workers too (they take the results on the feed).
            nursery.start_soon(self.gateway.probes.run_scraper, self.followers.publish_probe)
            nursery.start_soon(self.gateway.probes.run_health_checks, self.followers.publish_probe)
            nursery.start_soon(self.gateway.run_disconnect_watchdog)
            nursery.start_soon(self.fleet.run_ticker)
            nursery.start_soon(self.fabrics.run)
            nursery.start_soon(self.controller.run)
            nursery.start_soon(self.remedy.run)
            nursery.start_soon(self.operator.reload_on_sighup)
            nursery.start_soon(self.event_feeds.watch_breakers)
            log.info("llmgw server %s: public %s, fleet %s%s; %s", __version__, bound.public_url, bound.fleet_url,
                     f", admin {bound.admin_url} (/api/v1, /metrics)" if bound.admin_url else "", hotpath.summary())
            self.auth.announce()
            task_status.started(bound)
            await self.shutdown_event.wait()
            self.followers.freeze()
            self.last_endpoints.freeze()
            grace = float(self.operator.cfg.gateway.shutdown_grace)  # as reloaded
            log.info("shutting down: public port closed; %d request(s) in flight get up to %gs to finish",
                     sum(h.active_requests for h in self.http_servers), grace)
            async with trio.open_nursery() as draining:
                for http in self.http_servers:
                    draining.start_soon(http.drain, grace)
                if self.worker_pool is not None:
                    draining.start_soon(self.worker_pool.drain, grace)
            if left := sum(h.active_requests for h in self.http_servers):
                log.warning("shutting down: %d request(s) still in flight after %gs (shutdown_grace) are cut",
                            left, grace)
            log.info("shutting down: closing %d fleet streams", len(self.fleet.links))
            with trio.move_on_after(3):
                await self.fleet.shutdown()
                await self.fleet_listener.wait_idle()
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await self.gateway.aclose()

    def _http_server(self, handler: Handler, *, tls: bool, lane: GatewayLane | None = None) -> HttpServer:
        gw = self.cfg.gateway
        http = HttpServer(
            handler,
            limits=Limits(max_body=int(gw.max_body), body_timeout=float(gw.body_timeout),
                          header_timeout=float(gw.header_timeout), max_connections=int(gw.max_connections)),
            lane=FastPath(lane) if lane is not None else None,
        )
        if tls and self.public_tls is not None:
            self.public_tls.attach(http)
        return http

    async def _serve_public(self, sock: socket.socket, handler: Handler, *, tls: bool = True,
                            lane: GatewayLane | None = None, task_status: trio.TaskStatus[None]) -> None:
        http = self._http_server(handler, tls=tls, lane=lane)
        self.http_servers.append(http)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        await http.serve([listener], task_status=task_status)


async def run_server(cfg: ServerConfig, *, insecure: bool = False, config_path: str | None = None,
                     overrides: dict[str, Any] | None = None) -> None:
    """The `llmgw server` main: binds first (clear errors), then serves until SIGINT/SIGTERM."""
    plane = ControlPlane(cfg, insecure=insecure, config_path=config_path, overrides=overrides)
    socks: list[socket.socket] = []
    try:
        socks.append(bind_socket(cfg.listen, "public port", "--listen", reserve=plane.workers > 1))
        socks.append(bind_socket(cfg.fleet_listen, "fleet port", "--fleet-listen"))
        if cfg.admin_listen:
            socks.append(bind_socket(cfg.admin_listen, "admin listener", "--admin-listen"))
    except UsageError:
        for sock in socks:
            sock.close()
        raise
    settle_garbage_collector()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, plane.shutdown_event)
        await plane.run(public_sock=socks[0], fleet_sock=socks[1], admin_sock=socks[2] if cfg.admin_listen else None)
        nursery.cancel_scope.cancel()


async def _no_nodes_here(channel: object) -> None:
    from llmgw.fleet import StreamRefused

    raise StreamRefused("not_fleet", "this socket feeds the server's gateway workers; agents dial the fleet port")


def _hand_endpoints(gateway: Gateway, feed: GatewayFeed) -> None:
    """After every pass: the gateway (and through it every follower) gets the endpoint set."""
    ready, keys, settling = feed.endpoint_set()
    gateway.set_endpoints(ready, keys, settling=settling)


async def _stop_on_signals(event: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            event.set()
            return
