"""The public port's routes besides the gateway: the JSON API, /healthz and /metrics.

Every API route is one row of `API_ROUTES` with the door it stands behind (llmgw.server.auth):
the dispatcher checks the door before any handler runs, so a route cannot be added without one
(tests/e2e/test_doors.py walks the table).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from llmgw.catalog.units import enc_hook
from llmgw.server.auth import Door
from llmgw.server.registry import Node
from llmgw.web.server import Request, Responder
from llmgw.wire.messages import EnvSetting, FabricStatus, PortCounters

log = logging.getLogger("llmgw.api")

_json = msgspec.json.Encoder(enc_hook=enc_hook)


class NodeView(msgspec.Struct, kw_only=True):
    """A node as `GET /api/v1/nodes` shows it."""

    id: str
    state: str
    reason: str
    state_since: float
    connected: bool
    address: str
    version: str
    last_heartbeat_age: float | None
    gpus: int
    gpu_name: str
    gpu_source: str
    gpu_note: str
    fabrics: list[str]
    ports: int
    ports_active: int
    identity: str | None
    cert_days_left: float | None
    features: list[str]
    # Every declared fabric's verdict (usable or not, and why), and each port's current state.
    fabric_status: list[FabricStatus] = []
    port_states: list[PortState] = []
    mgmt_interface: str = ""
    heartbeats: int = 0  # received from this node since the server started


class PortState(msgspec.Struct, kw_only=True):
    port: str  # "mlx5_0/1"
    state: str
    phys_state: str
    rate_gbps: float


class NodeDetail(NodeView, kw_only=True):
    inventory: Any = None
    # The latest heartbeat's reading of each port, counters included (None: "N/A (no PMA)").
    port_readings: list[PortCounters] = []


class ShardView(msgspec.Struct, kw_only=True):
    shard_id: str
    node: str
    rank: int
    gpus: list[int]
    port: int
    state: str
    endpoint: str
    pid: int
    exit_code: int | None
    reason: str
    launch_env: list[EnvSetting] = []


class ReplicaView(msgspec.Struct, kw_only=True):
    """A replica as `GET /api/v1/replicas` shows it."""

    id: str
    model: str
    profile: str
    state: str
    reason: str
    age: float
    state_since: float
    attempt: int
    failures: int
    retry_in: float | None
    adopted: bool
    endpoint: str
    shards: list[ShardView]
    tail: list[str]


class ModelView(msgspec.Struct, kw_only=True):
    name: str
    source: str
    replicas: int
    ready: int
    profiles: list[str]
    balancer: str


def _wall(now_mono: float, t: float) -> float:
    return round(time.time() - (now_mono - t), 3)


def node_view(node: Node, now: float, detail: bool = False) -> NodeView:
    inv = node.inventory
    names = sorted({g.name for g in inv.gpus if g.name})
    fabrics = [f.name for f in node.fabrics]
    view = NodeView(
        id=node.id,
        state=node.state,
        reason=node.reason,
        state_since=_wall(now, node.state_since),
        connected=node.connected,
        address=node.address,
        version=node.version,
        last_heartbeat_age=None if node.last_heartbeat is None else round(now - node.last_heartbeat, 3),
        gpus=len(inv.gpus),
        gpu_name=", ".join(names),
        gpu_source=inv.gpu_source,
        gpu_note=inv.gpu_note,
        fabrics=fabrics,
        ports=len(node.ports),
        ports_active=sum(1 for p in node.ports.values() if p.state.upper() == "ACTIVE"),
        identity=node.identity,
        cert_days_left=None
        if not node.cert_not_after
        else round((node.cert_not_after - time.time()) / 86400, 1),
        features=node.features,
        fabric_status=node.fabric_status,
        port_states=[PortState(port=key, state=p.state, phys_state=p.phys_state, rate_gbps=p.rate_gbps)
                     for key, p in node.ports.items()],
        mgmt_interface=inv.mgmt_interface,
        heartbeats=node.heartbeats,
    )
    if detail:
        return NodeDetail(**msgspec.structs.asdict(view), inventory=inv, port_readings=list(node.ports.values()))
    return view


def replica_view(r: Any, now: float) -> ReplicaView:
    shards = [
        ShardView(
            shard_id=sh.shard_id,
            node=sh.node,
            rank=sh.rank,
            gpus=list(sh.gpus),
            port=sh.port,
            state=sh.state,
            endpoint=sh.endpoint,
            pid=sh.pid,
            exit_code=sh.exit_code,
            reason=sh.reason,
            launch_env=list(sh.launch_env),
        )
        for sh in r.shards
    ]
    rank0 = next((sh for sh in r.shards if sh.rank == 0), None)
    return ReplicaView(
        id=r.id,
        model=r.model,
        profile=r.profile,
        state=r.state,
        reason=r.reason,
        age=round(now - r.created_at, 3),
        state_since=_wall(now, r.state_since),
        attempt=r.attempt,
        failures=r.failures,
        retry_in=round(r.next_attempt_at - now, 3) if r.state == "failed" and r.next_attempt_at > now else None,
        adopted=r.adopted,
        endpoint=rank0.endpoint if rank0 is not None and r.state == "ready" else "",
        shards=shards,
        tail=list(r.tail),
    )


_JSON = (b"content-type", b"application/json")


async def send_json(responder: Responder, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await responder.respond(status, [_JSON, *(headers or [])], _json.encode(body))


async def send_error(responder: Responder, status: int, message: str, code: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(responder, status, {"error": {"message": message, "type": code, "code": code}}, headers)


class PublicHandler:
    """One listener's routes. The public port serves the gateway (/v1/*) and, unless an
    admin listener is configured, the operator door too (/api/v1/*, /metrics); the admin
    listener serves only the latter. /healthz is open on both and says only ok."""

    def __init__(self, plane: Any, *, clients: bool = True, admin: bool = True) -> None:
        self.plane = plane
        self.clients = clients
        self.admin = admin

    async def __call__(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path == "/healthz":
            await send_json(responder, 200, {"status": "ok"})
            return
        if path.startswith("/v1/") and self.clients:
            await self.plane.gateway.handle(request, responder)
            return
        if path == "/metrics" and self.admin:
            if not self.plane.auth.metrics_open and not await self._pass(Door.VIEWER, request, responder):
                return
            await responder.respond(200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")], self.plane.metrics.render())
            return
        if path.startswith("/api/v1/") and self.admin:
            await self.api(path[len("/api/v1/"):].rstrip("/"), request, responder)
            return
        if not self.admin and (path.startswith("/api/") or path == "/metrics"):
            await send_error(responder, 404, f"no route for {path} on this port: it serves clients only; the API and "
                             "metrics are on the server's admin listener (admin_listen)", "not_found")
            return
        await send_error(responder, 404, f"no route for {path}", "not_found")

    async def _pass(self, door: Door, request: Request, responder: Responder) -> str | None:
        """Who passes `door` (for the logs), or None after answering the refusal."""
        verdict = self.plane.auth.check(door, request)
        if verdict.ok:
            return verdict.who
        headers = [(b"www-authenticate", f'Bearer realm="llmgw {door.value}"'.encode())] if verdict.status == 401 else []
        await send_error(responder, verdict.status, verdict.message,
                         "unauthorized" if verdict.status == 401 else "forbidden", headers)
        return None

    async def api(self, route: str, request: Request, responder: Responder) -> None:
        method = request.method
        found = match_route(method, route)
        door = found[0].door if found else (Door.VIEWER if method in ("GET", "HEAD") else Door.OPERATOR)
        who = await self._pass(door, request, responder)
        if who is None:
            return
        if found is None:
            if any(r.match(route) is not None for r in API_ROUTES):
                await send_error(responder, 405, f"method {method} not allowed on /api/v1/{route}", "method_not_allowed")
            else:
                await send_error(responder, 404, f"no API route {method} /api/v1/{route}", "not_found")
            return
        api_route, params = found
        await api_route.handler(self, Call(request, responder, who, trio.current_time(), params))

    # -- reads -------------------------------------------------------------------------------------------

    async def list_nodes(self, call: Call) -> None:
        nodes = sorted(self.plane.registry.nodes.values(), key=lambda n: n.id)
        await send_json(call.responder, 200, [node_view(n, call.now) for n in nodes])

    async def get_node(self, call: Call) -> None:
        node_id = call.params["node"]
        node = self.plane.registry.get(node_id)
        if node is None:
            await send_error(call.responder, 404, f"no node {node_id!r}", "not_found")
        else:
            await send_json(call.responder, 200, node_view(node, call.now, detail=True))

    async def list_replicas(self, call: Call) -> None:
        replicas = sorted(self.plane.controller.reconciler.replicas.values(), key=lambda r: (r.model, r.created_at, r.id))
        await send_json(call.responder, 200, [replica_view(r, call.now) for r in replicas])

    async def get_replica(self, call: Call) -> None:
        replica_id = call.params["replica"]
        replica = self.plane.controller.reconciler.replicas.get(replica_id)
        if replica is None:
            await send_error(call.responder, 404, f"no replica {replica_id!r}", "not_found")
        else:
            await send_json(call.responder, 200, replica_view(replica, call.now))

    async def list_models(self, call: Call) -> None:
        reconciler = self.plane.controller.reconciler
        await send_json(call.responder, 200, [
            ModelView(
                name=model.name,
                source=model.source or model.name,
                replicas=model.replicas,
                ready=sum(1 for r in reconciler.of_model(model.name) if r.state == "ready"),
                profiles=[p.name for p in model.profiles],
                balancer=model.balancer,
            )
            for model in reconciler.models.values()
        ])

    async def list_endpoints(self, call: Call) -> None:
        await send_json(call.responder, 200, self.plane.gateway_endpoints())

    # -- changes (operator door) -------------------------------------------------------------------

    async def reload(self, call: Call) -> None:
        result = await self.plane.reload()
        log.info("reload requested by %s: %s", call.who, result)
        await send_json(call.responder, 200 if result.ok else 400, result)

    async def forget_node(self, call: Call) -> None:
        node_id = call.params["node"]
        problem = self.plane.forget_node(node_id)
        if problem:
            missing = problem == "not found"
            await send_error(call.responder, 404 if missing else 409, f"cannot forget {node_id}: {problem}",
                             "not_found" if missing else "conflict")
        else:
            log.info("node %s forgotten by %s", node_id, call.who)
            await send_json(call.responder, 200, {"forgotten": node_id})

    async def restart_replica(self, call: Call) -> None:
        replica_id = call.params["replica"]
        problem = self.plane.restart_replica(replica_id, call.who)
        if problem:
            await send_error(call.responder, 404, problem, "not_found")
        else:
            await send_json(call.responder, 200, {"restarting": replica_id})


@dataclass(frozen=True, slots=True)
class Call:
    """One API request as a handler sees it: who passed the door, path parameters, the time."""

    request: Request
    responder: Responder
    who: str
    now: float
    params: dict[str, str]


@dataclass(frozen=True)
class ApiRoute:
    """A method and a path below /api/v1/ ("{name}" matches one segment), behind one door."""

    method: str
    path: str
    door: Door
    handler: Callable[[PublicHandler, Call], Awaitable[None]]

    def match(self, route: str) -> dict[str, str] | None:
        want, got = self.path.split("/"), route.split("/")
        if len(want) != len(got):
            return None
        params = {}
        for w, g in zip(want, got, strict=True):
            if w.startswith("{"):
                if not g:
                    return None
                params[w[1:-1]] = g
            elif w != g:
                return None
        return params


API_ROUTES: tuple[ApiRoute, ...] = (
    ApiRoute("GET", "nodes", Door.VIEWER, PublicHandler.list_nodes),
    ApiRoute("GET", "nodes/{node}", Door.VIEWER, PublicHandler.get_node),
    ApiRoute("GET", "replicas", Door.VIEWER, PublicHandler.list_replicas),
    ApiRoute("GET", "replicas/{replica}", Door.VIEWER, PublicHandler.get_replica),
    ApiRoute("GET", "models", Door.VIEWER, PublicHandler.list_models),
    ApiRoute("GET", "endpoints", Door.VIEWER, PublicHandler.list_endpoints),
    ApiRoute("POST", "reload", Door.OPERATOR, PublicHandler.reload),
    ApiRoute("DELETE", "nodes/{node}", Door.OPERATOR, PublicHandler.forget_node),
    ApiRoute("POST", "replicas/{replica}/restart", Door.OPERATOR, PublicHandler.restart_replica),
)


def match_route(method: str, route: str) -> tuple[ApiRoute, dict[str, str]] | None:
    for api_route in API_ROUTES:
        if api_route.method == method:
            params = api_route.match(route)
            if params is not None:
                return api_route, params
    return None
