"""The public JSON API, health and metrics, as a small ASGI app (served by hypercorn)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from llmgw.catalog.units import enc_hook
from llmgw.server.registry import Node

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

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


async def send_json(send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = _json.encode(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def send_error(send: Send, status: int, message: str, code: str) -> None:
    await send_json(send, status, {"error": {"message": message, "type": code, "code": code}})


class PublicApp:
    """Routes of the public port that are not the gateway: /healthz, /metrics, /api/v1/*."""

    def __init__(self, plane: Any) -> None:
        self.plane = plane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
            return
        if kind != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/healthz":
            await send_json(send, 200, {"status": "ok"})
            return
        if path == "/metrics":
            body = self.plane.metrics.render()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if path.startswith("/api/v1/"):
            await self.api(path[len("/api/v1/") :].rstrip("/"), method, scope, receive, send)
            return
        await send_error(send, 404, f"no route for {path}", "not_found")

    async def api(self, route: str, method: str, scope: Scope, receive: Receive, send: Send) -> None:
        plane = self.plane
        now = trio.current_time()
        if route == "nodes":
            if method != "GET":
                await send_error(send, 405, "use GET", "method_not_allowed")
                return
            nodes = sorted(plane.registry.nodes.values(), key=lambda n: n.id)
            await send_json(send, 200, [node_view(n, now) for n in nodes])
            return
        if route.startswith("nodes/"):
            node = plane.registry.get(route[len("nodes/") :])
            if node is None:
                await send_error(send, 404, f"no node {route[len('nodes/'):]!r}", "not_found")
                return
            await send_json(send, 200, node_view(node, now, detail=True))
            return
        if route in ("replicas", "models") or route.startswith("replicas/"):
            if method != "GET":
                await send_error(send, 405, "use GET", "method_not_allowed")
                return
            reconciler = plane.controller.reconciler
            if route == "replicas":
                replicas = sorted(reconciler.replicas.values(), key=lambda r: (r.model, r.created_at, r.id))
                await send_json(send, 200, [replica_view(r, now) for r in replicas])
            elif route == "models":
                await send_json(send, 200, [
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
            else:
                replica = reconciler.replicas.get(route[len("replicas/"):])
                if replica is None:
                    await send_error(send, 404, f"no replica {route[len('replicas/'):]!r}", "not_found")
                else:
                    await send_json(send, 200, replica_view(replica, now))
            return
        handler = getattr(plane, "api_routes", {}).get(route)
        if handler is not None:
            await handler(method, scope, receive, send)
            return
        await send_error(send, 404, f"no API route /api/v1/{route}", "not_found")


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
