"""The public port's routes besides the gateway: the JSON API, /healthz and /metrics."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import trio

from llmgw.catalog.units import enc_hook
from llmgw.server.registry import Node
from llmgw.web.server import Request, Responder

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


class NodeDetail(NodeView, kw_only=True):
    inventory: Any = None


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
    args = dict(
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
        ports=len(inv.ports),
        ports_active=sum(1 for p in inv.ports if p.state.upper() == "ACTIVE"),
        identity=node.identity,
        cert_days_left=None
        if not node.cert_not_after
        else round((node.cert_not_after - time.time()) / 86400, 1),
        features=node.features,
    )
    if detail:
        return NodeDetail(**args, inventory=inv)
    return NodeView(**args)


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
    """Everything on the public port: the gateway (/v1/*), the JSON API (/api/v1/*), /healthz
    and /metrics. Mutating API calls need an operator credential."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane

    async def __call__(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path.startswith("/v1/"):
            await self.plane.gateway.handle(request, responder)
            return
        if path == "/healthz":
            await send_json(responder, 200, {"status": "ok"})
            return
        if path == "/metrics":
            await responder.respond(200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")], self.plane.metrics.render())
            return
        if path.startswith("/api/v1/"):
            await self.api(path[len("/api/v1/"):].rstrip("/"), request, responder)
            return
        await send_error(responder, 404, f"no route for {path}", "not_found")

    def _operator(self, request: Request) -> str | None:
        """Who the operator is (token or certificate), or None."""
        return self.plane.operator_identity(request)

    async def api(self, route: str, request: Request, responder: Responder) -> None:
        plane = self.plane
        method = request.method
        now = trio.current_time()
        if method in ("POST", "DELETE", "PUT", "PATCH"):
            who = self._operator(request)
            if who is None:
                await send_error(responder, 401, plane.operator_hint(request), "unauthorized",
                                 [(b"www-authenticate", b'Bearer realm="llmgw operator"')])
                return
            await self.mutate(route, method, who, request, responder)
            return
        if method != "GET":
            await send_error(responder, 405, f"method {method} not allowed", "method_not_allowed")
            return
        reconciler = plane.controller.reconciler
        if route == "nodes":
            nodes = sorted(plane.registry.nodes.values(), key=lambda n: n.id)
            await send_json(responder, 200, [node_view(n, now) for n in nodes])
        elif route.startswith("nodes/"):
            node = plane.registry.get(route[len("nodes/"):])
            if node is None:
                await send_error(responder, 404, f"no node {route[len('nodes/'):]!r}", "not_found")
            else:
                await send_json(responder, 200, node_view(node, now, detail=True))
        elif route == "replicas":
            replicas = sorted(reconciler.replicas.values(), key=lambda r: (r.model, r.created_at, r.id))
            await send_json(responder, 200, [replica_view(r, now) for r in replicas])
        elif route.startswith("replicas/"):
            replica = reconciler.replicas.get(route[len("replicas/"):])
            if replica is None:
                await send_error(responder, 404, f"no replica {route[len('replicas/'):]!r}", "not_found")
            else:
                await send_json(responder, 200, replica_view(replica, now))
        elif route == "models":
            await send_json(responder, 200, [
                ModelView(
                    name=model.name,
                    source=model.source or model.name,
                    replicas=model.replicas,
                    ready=sum(1 for r in reconciler.replicas.values() if r.model == model.name and r.state == "ready"),
                    profiles=[p.name for p in model.profiles],
                    balancer=model.balancer,
                )
                for model in reconciler.models.values()
            ])
        elif route == "endpoints":
            await send_json(responder, 200, plane.gateway_endpoints())
        else:
            await send_error(responder, 404, f"no API route /api/v1/{route}", "not_found")

    async def mutate(self, route: str, method: str, who: str, request: Request, responder: Responder) -> None:
        plane = self.plane
        if route == "reload" and method == "POST":
            result = plane.reload()
            log.info("reload requested by %s: %s", who, result)
            await send_json(responder, 200 if result.ok else 400, result)
        elif route.startswith("nodes/") and method == "DELETE":
            node_id = route[len("nodes/"):]
            problem = plane.forget_node(node_id)
            if problem:
                missing = problem == "not found"
                await send_error(responder, 404 if missing else 409, f"cannot forget {node_id}: {problem}",
                                 "not_found" if missing else "conflict")
            else:
                log.info("node %s forgotten by %s", node_id, who)
                await send_json(responder, 200, {"forgotten": node_id})
        elif route.startswith("replicas/") and route.endswith("/restart") and method == "POST":
            replica_id = route[len("replicas/"):-len("/restart")]
            problem = plane.restart_replica(replica_id, who)
            if problem:
                await send_error(responder, 404, problem, "not_found")
            else:
                await send_json(responder, 200, {"restarting": replica_id})
        else:
            await send_error(responder, 404, f"no API route {method} /api/v1/{route}", "not_found")
