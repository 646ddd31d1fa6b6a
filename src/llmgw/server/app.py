"""`llmgw server`: one trio process with two listeners, the public port and the fleet port."""

from __future__ import annotations

import gc
import logging
import signal
import socket
import ssl
from typing import Any

import msgspec
import trio

from llmgw import __version__
from llmgw.catalog import load_server_config, override
from llmgw.catalog.schema import ServerConfig
from llmgw.errors import UsageError
from llmgw.fleet import FleetListener
from llmgw.fleet.limits import Caps, RefusalLog
from llmgw.netaddr import hostport
from llmgw.server.api import PublicHandler
from llmgw.server.auth import Auth
from llmgw.server.control import Controller
from llmgw.server.fleet_service import FleetService
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.known_nodes import KnownNodes
from llmgw.server.metrics import GatewayMetrics, ServerMetrics
from llmgw.server.registry import NodeRegistry
from llmgw.tls import server_context
from llmgw.tls.revocation import Revocations, fleet_refusal
from llmgw.web.server import HttpServer, Limits

log = logging.getLogger("llmgw.server")


class ReloadResult(msgspec.Struct, kw_only=True):
    ok: bool
    message: str
    models: list[str] = []


class Bound(msgspec.Struct, frozen=True):
    public_url: str
    fleet_url: str
    admin_url: str = ""  # the admin listener (admin_listen), when one is configured


def split_hostport(text: str, what: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{what} address {text!r} must be HOST:PORT (set it with {flag})")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def bind_socket(text: str, what: str, flag: str) -> socket.socket:
    """Bind now, so that a port in use is one clear line before anything starts."""
    host, port = split_hostport(text, what, flag)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} for the {what}: {exc.strerror or exc}; choose another with {flag}"
        ) from None
    sock.listen(4096)
    sock.setblocking(False)
    return sock


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
    """The server's state and its long-running tasks."""

    def __init__(self, cfg: ServerConfig, *, insecure: bool = False, config_path: str | None = None,
                 overrides: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides or {}
        self.insecure = insecure
        fleet = cfg.fleet
        self.registry = NodeRegistry(fleet.heartbeat_interval, fleet.unreachable_after, fleet.lost_after)
        self.metrics = ServerMetrics(self.registry.counts, nodes=lambda: self.registry.nodes.values())
        self.auth = Auth(cfg, insecure=insecure, count=self.metrics.count_auth_failure,
                         revoked=lambda peer: self.revocations.refuses(peer))
        require_identity = bool(cfg.tls and cfg.tls.require_identity)
        self.known_nodes = KnownNodes(cfg.state_dir)
        self.controller = Controller(cfg.models, cfg.reconcile, self.registry, self.known_nodes)
        self.refusal_log = RefusalLog(logging.getLogger("llmgw.fleet"), every=float(fleet.refusal_log_interval))
        self.fleet = FleetService(
            self.registry,
            self.metrics,
            register_timeout=fleet.register_timeout,
            require_identity=require_identity,
            endpoint_host=fleet.endpoint_host,
            observer=self.controller,
            caps=Caps(gpus=fleet.max_gpus, ports=fleet.max_ports, shards=fleet.max_shards),
            heartbeat_rate=float(fleet.max_heartbeat_rate),
            refusal_log=self.refusal_log,
        )
        self.controller.fleet = self.fleet
        self.gateway = Gateway(
            cfg.gateway,
            GatewayMetrics(self.metrics.registry, lambda: getattr(self, "gateway", None)),
            client_door=self.auth.client,
            not_ready_reason=self.not_ready_reason,
        )
        self.gateway.configure(cfg.models, cfg.endpoints)
        self.controller.on_pass = self._sync_gateway
        self.controller.on_refused = self.metrics.count_refused
        self.http_servers: list[HttpServer] = []  # the public port's and the admin listener's
        self.shutdown_event = trio.Event()
        self._reload_lock = trio.Lock()
        if cfg.tls is None and not insecure:
            raise UsageError(
                "the fleet port needs TLS: set tls.cert, tls.key and tls.ca in the server config "
                "(issue them with `llmgw ctl cert`), or pass --insecure for a lab"
            )
        if cfg.tls is not None and (not cfg.tls.cert or not cfg.tls.key):
            raise UsageError("tls: both tls.cert and tls.key are needed for the fleet port")
        self.revocations = Revocations(cfg.tls.deny_list if cfg.tls else "")
        self._fleet_listener: FleetListener | None = None

    async def run(
        self,
        *,
        public_sock: socket.socket,
        fleet_sock: socket.socket,
        admin_sock: socket.socket | None = None,
        task_status: trio.TaskStatus[Bound] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        fleet_ctx = None if self.cfg.tls is None else fleet_ssl_context(self.cfg)
        if fleet_ctx is None:
            log.warning(
                "the fleet port runs plain h2c (--insecure): any process that can reach it can "
                "register as any node. Use TLS outside a lab."
            )
        silence = self.registry.silence_limit
        listener = FleetListener(
            self.fleet.handle,
            ssl_context=fleet_ctx,
            max_message=self.cfg.fleet.max_message,
            handshake_timeout=self.cfg.fleet.register_timeout,
            # A registered connection silent for twice the unreachable threshold is dead; the
            # register timeout alone governs a connection that has not registered yet.
            idle_timeout=2 * silence + self.cfg.fleet.register_timeout,
            on_refused=self.metrics.count_refused,
            peer_check=lambda peer: fleet_refusal(peer, self.revocations, require_node=self.fleet.require_identity),
            refusal_log=self.refusal_log,
        )
        self._fleet_listener = listener
        public_scheme = "https" if self.cfg.public_tls else "http"
        bound = Bound(
            public_url=_url(public_scheme, public_sock),
            fleet_url=_url("https" if fleet_ctx else "http", fleet_sock),
            admin_url=_url(public_scheme, admin_sock) if admin_sock is not None else "",
        )
        async with trio.open_nursery() as nursery:
            fleet_listener = trio.SocketListener(trio.socket.from_stdlib_socket(fleet_sock))
            await nursery.start(listener.serve, [fleet_listener])
            await nursery.start(self._serve_public, public_sock, PublicHandler(self, admin=admin_sock is None))
            if admin_sock is not None:
                await nursery.start(self._serve_public, admin_sock, PublicHandler(self, clients=False))
            nursery.start_soon(self.gateway.run_scraper)
            nursery.start_soon(self.gateway.run_health_checks)
            nursery.start_soon(self.gateway.run_disconnect_watchdog)
            nursery.start_soon(self.gateway.run_relay_hub)
            nursery.start_soon(self.fleet.run_ticker)
            nursery.start_soon(self.controller.run)
            nursery.start_soon(self._reload_on_sighup)
            log.info("llmgw server %s: public %s, fleet %s%s", __version__, bound.public_url, bound.fleet_url,
                     f", admin {bound.admin_url} (/api/v1, /metrics)" if bound.admin_url else "")
            self.auth.announce()
            task_status.started(bound)
            await self.shutdown_event.wait()
            grace = float(self.cfg.gateway.shutdown_grace)
            log.info("shutting down: public port closed; %d request(s) in flight get up to %gs to finish",
                     sum(h.active_requests for h in self.http_servers), grace)
            async with trio.open_nursery() as draining:
                for http in self.http_servers:
                    draining.start_soon(http.drain, grace)
            if left := sum(h.active_requests for h in self.http_servers):
                log.warning("shutting down: %d request(s) still in flight after %gs (shutdown_grace) are cut", left, grace)
            log.info("shutting down: closing %d fleet streams", len(self.fleet.sessions))
            with trio.move_on_after(3):
                await self.fleet.shutdown()
                await listener.wait_idle()
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await self.gateway.aclose()

    async def reload(self) -> ReloadResult:
        """Re-read the config file; the catalog (models, static endpoints, gateway settings)
        takes effect at once, listener and TLS settings need a restart. The deny list
        (tls.deny_list) is re-read too, and fleet streams of certificates it now names end.

        The file is read and parsed in a worker thread: a big catalog (or a hostile one) must not
        hold the gateway and the fleet streams while it parses (a ~300-byte reload froze the
        gateway 2.4 s when it was parsed in the event loop, issue 9). Reloads run one at a time.
        """
        self._reload_deny_list()
        if not self.config_path:
            log.warning("reload: no config file to reload (the server was started without --config)")
            return ReloadResult(ok=False, message="the server was started without --config")
        path = self.config_path
        async with self._reload_lock:
            try:
                cfg = await trio.to_thread.run_sync(lambda: override(load_server_config(path), self.overrides))
            except UsageError as exc:
                log.error("reload failed, keeping the running config: %s", exc)
                return ReloadResult(ok=False, message=f"{exc}; the running config stays")
            return self._apply_reload(cfg)

    def _apply_reload(self, cfg: ServerConfig) -> ReloadResult:
        changed = [k for k in ("listen", "fleet_listen", "admin_listen", "tls", "public_tls", "fleet", "state_dir") if getattr(cfg, k) != getattr(self.cfg, k)]
        if changed:
            log.warning("reload: changes to %s take effect only after a restart", ", ".join(changed))
        self.cfg = msgspec.structs.replace(self.cfg, models=cfg.models, endpoints=cfg.endpoints, gateway=cfg.gateway,
                                           api=cfg.api, reconcile=cfg.reconcile)
        self.auth.configure(self.cfg)
        self.gateway.configure(cfg.models, cfg.endpoints, cfg.gateway)
        self.controller.set_catalog(cfg.models)
        note = f"; restart needed for {', '.join(changed)}" if changed else ""
        return ReloadResult(ok=True, message=f"reloaded {self.config_path}{note}", models=[m.name for m in cfg.models])

    def _reload_deny_list(self) -> None:
        if not self.revocations.reload():
            return
        ended = self._fleet_listener.recheck() if self._fleet_listener is not None else 0
        if ended:
            log.warning("deny list: ended %d fleet connections whose certificate is now revoked", ended)

    async def _reload_on_sighup(self) -> None:
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                log.info("SIGHUP: reloading %s", self.config_path)
                await self.reload()

    # -- the gateway's view of the control plane --------------------------------------------------

    def _sync_gateway(self) -> None:
        ready: dict[str, set[str]] = {}
        keys: dict[str, str] = {}  # endpoint → the engine API key of the shard behind it
        for replica in self.controller.reconciler.replicas.values():
            if replica.state != "ready":
                continue
            for shard in replica.shards:
                if shard.rank == 0 and shard.endpoint:
                    ready.setdefault(replica.model, set()).add(shard.endpoint)
                    keys[shard.endpoint] = shard.spec.api_key if shard.spec is not None else ""
        self.gateway.set_endpoints(ready, keys)

    def not_ready_reason(self, model: str) -> str:
        """Why the gateway has no endpoint for `model`, for its 503. It once said "no ready
        replica: small-k94f5 ready; small-cd96h ready" (issue 9): replicas adopted during the
        settle period were ready but never handed to the gateway. A ready replica named here
        is one whose endpoint is out of rotation, and the text says so."""
        replicas = self.controller.reconciler.of_model(model)
        settle = self.controller.settle_note()
        if not replicas:
            return settle or "no replicas (replicas: 0 in the catalog?)"
        parts = []
        for r in replicas[:3]:
            if r.state == "ready":
                endpoint = next((s.endpoint for s in r.shards if s.rank == 0 and s.endpoint), "")
                parts.append(f"{r.id} is ready but its endpoint {endpoint} is not in rotation" if endpoint
                             else f"{r.id} is ready but reported no endpoint")
            else:
                parts.append(f"{r.id} {r.state}" + (f" ({r.reason})" if r.reason else ""))
        if len(replicas) > 3:
            parts.append(f"{len(replicas) - 3} more")
        return "; ".join(parts + ([settle] if settle else []))

    def gateway_endpoints(self) -> list[dict[str, Any]]:
        out = []
        for name, route in sorted(self.gateway.routes.items()):
            for status in route.balancer.status():
                out.append({
                    "model": name,
                    "endpoint": status.endpoint,
                    "outstanding": status.outstanding,
                    "breaker": status.breaker,
                    "breaker_reason": status.breaker_reason,
                    "violations": list(status.violations),
                    "engine_up": self.gateway.engine_up.get(status.endpoint, False),
                    "healthy": status.healthy,
                    "health_reason": status.health_reason,
                    "load": status.load,
                })
        return out

    # -- operator actions ------------------------------------------------------------------------

    def forget_node(self, node_id: str) -> str:
        node = self.registry.get(node_id)
        if node is None:
            return "not found"
        if node.connected or node.state == "ready":
            return f"it is {node.state} and connected; stop its agent first"
        del self.registry.nodes[node_id]
        self.controller.node_forgotten(node_id)
        return ""

    def restart_replica(self, replica_id: str, who: str) -> str:
        replica = self.controller.reconciler.replicas.get(replica_id)
        if replica is None:
            return f"no replica {replica_id!r}"
        self.controller.reconciler.stop_replica(replica, trio.current_time(), f"restart requested by {who}")
        self.controller.wake()
        return ""

    def _http_server(self, handler: PublicHandler) -> HttpServer:
        ssl_context = None
        public_tls = self.cfg.public_tls
        if public_tls is not None and public_tls.cert:
            ssl_context = server_context(public_tls.cert, public_tls.key, public_tls.ca or None,
                                         require_client_cert=False, alpn=("http/1.1",))
        gw = self.cfg.gateway
        return HttpServer(
            handler,
            limits=Limits(max_body=int(gw.max_body), body_timeout=float(gw.body_timeout),
                          header_timeout=float(gw.header_timeout), max_connections=int(gw.max_connections)),
            ssl_context=ssl_context,
        )

    async def _serve_public(self, sock: socket.socket, handler: PublicHandler, *, task_status: trio.TaskStatus[None]) -> None:
        http = self._http_server(handler)
        self.http_servers.append(http)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        await http.serve([listener], task_status=task_status)


async def run_server(cfg: ServerConfig, *, insecure: bool = False, config_path: str | None = None,
                     overrides: dict[str, Any] | None = None) -> None:
    """The `llmgw server` main: binds first (clear errors), then serves until SIGINT/SIGTERM."""
    plane = ControlPlane(cfg, insecure=insecure, config_path=config_path, overrides=overrides)
    socks: list[socket.socket] = []
    try:
        socks.append(bind_socket(cfg.listen, "public port", "--listen"))
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


def settle_garbage_collector() -> None:
    """Keep full garbage collections short: they stop the whole event loop. With a 1,000-model
    catalog and 1,000 replicas a full collection took 0.25-0.46 s on the 2-core development
    machine (issue 9's abuse tests saw it as /healthz stalls). What exists once the server is
    configured (modules, the catalog, the gateway's routes) lives as long as the process:
    `gc.freeze()` takes it out of every later collection. Cycles are rare in what the server
    makes afterwards (reference counting frees the rest), so young collections run less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


async def _stop_on_signals(event: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            event.set()
            return
