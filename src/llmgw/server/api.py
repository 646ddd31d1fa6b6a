"""The public port's routes besides the gateway: the JSON API, /healthz and /metrics.

Every API route is one row of `API_ROUTES` with the door it stands behind (llmgw.server.auth):
the dispatcher checks the door before any handler runs, so a route cannot be added without one
(tests/e2e/test_doors.py walks the table), and then that a change is no request a browser was
made to send from another site (forgery.py: JSON and `X-Llmgw-Request`, no foreign Origin).

Handlers read through `ReadModel` (views.py) and change through `Actions` (operator.py); they
hold no state and reach no object behind those. Where what comes next goes: fabric and doctor
endpoints are rows here, reading new `ReadModel` methods (views.py) or, for fabric tests and
drain/cordon, calling new `Actions` (operator.py); the admin pages get a handler of their own
(server/admin/pages.py) over the read model, mounted under /admin/ beside /api/v1/ in
`PublicHandler.__call__`, behind the viewer door.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Protocol

import msgspec
import trio

from llmgw.doctor.facts import Report
from llmgw.server.answers import json_encoder, send_error, send_json
from llmgw.server.auth import Auth, Door
from llmgw.server.drain import DrainView
from llmgw.server.events import QUERY_LIMIT, EventLog, EventQuery
from llmgw.server.fabric_test import FabricTests, Refused
from llmgw.server.logfollow import ModelLogs
from llmgw.server.logs import EngineLogs
from llmgw.server.operator import ReloadResult
from llmgw.server.restart import RestartResult
from llmgw.server.views import ReadModel
from llmgw.web.server import Handler, Request, Responder

log = logging.getLogger("llmgw.api")

class Actions(Protocol):
    """The operator actions the mutating routes call (operator.py)."""

    async def reload(self) -> ReloadResult: ...
    def forget_node(self, node_id: str) -> str: ...
    def restart_replica(self, replica_id: str, who: str, *, force: bool = False) -> RestartResult | tuple[int, str]: ...
    def cordon(self, node_id: str, who: str) -> str: ...
    def uncordon(self, node_id: str, who: str) -> str: ...
    def drain(self, node_id: str, who: str, *, force: bool) -> DrainView | str: ...
    def drain_status(self, node_id: str) -> DrainView | None: ...


class Doctor(Protocol):
    """Doctor's findings (server/doctor.py): graded off the event loop, within a deadline."""

    async def report(self, node: str | None = None, check: str | None = None,
                     checks: frozenset[str] | None = None) -> Report: ...


class Clients(Protocol):
    """Where /v1/* goes (the gateway)."""

    async def handle(self, request: Request, responder: Responder) -> None: ...


class PublicHandler:
    """One listener's routes. The public port serves the gateway (/v1/*) and, unless an
    admin listener is configured, the operator door too (/api/v1/*, /metrics); the admin
    listener serves only the latter. /healthz is open on both and says only ok."""

    def __init__(self, *, reads: ReadModel, actions: Actions, auth: Auth, gateway: Clients,
                 render_metrics: Callable[[], bytes], clients: bool = True, admin: bool = True,
                 events: EventLog | None = None, engine_logs: EngineLogs | None = None,
                 model_logs: ModelLogs | None = None, pages: Handler | None = None,
                 fabric_tests: FabricTests | None = None,
                 doctor: Doctor | None = None, prepare_metrics: Callable[[], Awaitable[None]] | None = None) -> None:
        self.reads = reads
        self.prepare_metrics = prepare_metrics  # parses the gateway workers' reports in steps (gwfeed.py)
        self.pages = pages  # /admin/* (server/admin/pages.py): checks the viewer door itself
        self.fabric_tests = fabric_tests  # POST /api/v1/fabric-tests
        self.doctor = doctor  # GET /api/v1/doctor
        self.events = events  # GET /api/v1/events
        self.engine_logs = engine_logs  # GET /api/v1/replicas/{replica}/logs
        self.model_logs = model_logs  # GET /api/v1/logs/{name}: a model's, following it across moves
        self.actions = actions
        self.auth = auth
        self.gateway = gateway
        self.render_metrics = render_metrics
        self.clients = clients
        self.admin = admin

    async def __call__(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path == "/healthz":
            await send_json(responder, 200, {"status": "ok"})
            return
        if path.startswith("/v1/") and self.clients:
            await self.gateway.handle(request, responder)
            return
        if path == "/metrics" and self.admin:
            if not self.auth.metrics_open and not await self._pass(Door.VIEWER, request, responder):
                return
            if self.prepare_metrics is not None:
                await self.prepare_metrics()
            await responder.respond(200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
                                    self.render_metrics())
            return
        if path.startswith("/api/v1/") and self.admin:
            await self.api(path[len("/api/v1/"):].rstrip("/"), request, responder)
            return
        if (path == "/admin" or path.startswith("/admin/")) and self.admin and self.pages is not None:
            await self.pages(request, responder)
            return
        if not self.admin and (path.startswith("/api/") or path == "/metrics"):
            await send_error(responder, 404, f"no route for {path} on this port: it serves clients only; the API and "
                             "metrics are on the server's admin listener (admin_listen)", "not_found")
            return
        await send_error(responder, 404, f"no route for {path}", "not_found")

    async def _pass(self, door: Door, request: Request, responder: Responder) -> str | None:
        """Who passes `door` (for the logs), or None after answering the refusal."""
        verdict = self.auth.check(door, request)
        if verdict.ok:
            return verdict.who
        headers = ([(b"www-authenticate", f'Bearer realm="llmgw {door.value}"'.encode())] if verdict.status == 401
                   else [])
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
        if (forged := self.auth.forged(request, who)) is not None:  # CSRF: forgery.py
            await send_error(responder, forged.status, forged.message,
                             "unsupported_media_type" if forged.status == 415 else "forbidden")
            return
        if found is None:
            if any(r.match(route) is not None for r in API_ROUTES):
                await send_error(responder, 405, f"method {method} not allowed on /api/v1/{route}",
                                 "method_not_allowed")
            else:
                await send_error(responder, 404, f"no API route {method} /api/v1/{route}", "not_found")
            return
        api_route, params = found
        await api_route.handler(self, Call(request, responder, who, trio.current_time(), params))

    # -- reads -------------------------------------------------------------------------------------------

    async def list_fabrics(self, call: Call) -> None:
        await send_json(call.responder, 200, self.reads.fabrics())

    async def get_fabric(self, call: Call) -> None:
        fabric_id = call.params["fabric"]
        found = self.reads.fabric(fabric_id)
        if found is None:
            await send_error(call.responder, 404, f"no fabric {fabric_id!r}", "not_found")
        else:
            await send_json(call.responder, 200, found)

    async def get_topology(self, call: Call) -> None:
        fabric_id = call.params["fabric"]
        found = self.reads.fabric_topology(fabric_id)
        if found is not None:
            await send_json(call.responder, 200, found)
        elif self.reads.fabric(fabric_id) is not None:
            await send_error(call.responder, 404, f"fabric {fabric_id!r} has no topology yet: no agent on it has run "
                             "ibnetdiscover (are they ready, with the discover feature?)", "not_found")
        else:
            await send_error(call.responder, 404, f"no fabric {fabric_id!r}", "not_found")

    async def list_gateways(self, call: Call) -> None:
        await send_json(call.responder, 200, self.reads.gateways())

    async def list_nodes(self, call: Call) -> None:
        await send_json(call.responder, 200, self.reads.nodes(call.now))

    async def get_node(self, call: Call) -> None:
        node_id = call.params["node"]
        node = self.reads.node(node_id, call.now)
        if node is None:
            await send_error(call.responder, 404, f"no node {node_id!r}", "not_found")
        else:
            await send_json(call.responder, 200, node)

    async def list_replicas(self, call: Call) -> None:
        await send_json(call.responder, 200, self.reads.replicas(call.now))

    async def get_replica(self, call: Call) -> None:
        replica_id = call.params["replica"]
        replica = self.reads.replica(replica_id, call.now)
        if replica is None:
            await send_error(call.responder, 404, f"no replica {replica_id!r}", "not_found")
        else:
            await send_json(call.responder, 200, replica)

    async def list_models(self, call: Call) -> None:
        await send_json(call.responder, 200, self.reads.models(call.now))

    async def list_events(self, call: Call) -> None:
        try:
            query = parse_event_query(call.request.query, time.time())
        except ValueError as exc:
            await send_error(call.responder, 400, str(exc), "bad_request")
            return
        await send_json(call.responder, 200, await self.events.query(query) if self.events is not None else [])

    async def replica_logs(self, call: Call) -> None:
        """An engine's log, streamed from its node (`ctl logs`). A read, behind the viewer door
        like every GET; the agent takes the shard's engine API key out of every line first."""
        if self.engine_logs is None:
            await send_error(call.responder, 404, "engine logs are not served here", "not_found")
            return
        await self.engine_logs.serve(call.params["replica"], call.request.query, call.responder)

    async def logs(self, call: Call) -> None:
        """`ctl logs NAME`: a model's (or a replica's) engine log as NDJSON, notes beside the lines."""
        if self.model_logs is None:
            await send_error(call.responder, 404, "engine logs are not served here", "not_found")
            return
        await self.model_logs.serve(call.params["name"], call.request.query, call.responder)

    async def get_doctor(self, call: Call) -> None:
        """`ctl doctor`: every check's finding; `node=` one node's only, `only=a,b` / `skip=c` (or
        `check=`, one) the checks to run (`ctl doctor --list` lists them)."""
        from urllib.parse import parse_qs

        from llmgw.doctor.catalog import UnknownCheck, select

        if self.doctor is None:
            await send_error(call.responder, 404, "doctor is not served here", "not_found")
            return
        query = parse_qs(call.request.query)
        args = {k: v[-1] for k, v in query.items()}
        node = args.get("node") or None
        try:
            checks = select([*query.get("only", []), *query.get("check", [])], query.get("skip", []))
        except UnknownCheck as exc:
            await send_error(call.responder, 400, str(exc), "bad_request")
            return
        if node is not None and self.reads.node(node, call.now) is None:
            await send_error(call.responder, 404, f"no node {node[:80]!r}", "not_found")
            return
        await send_json(call.responder, 200, await self.doctor.report(node=node, checks=checks))

    async def list_endpoints(self, call: Call) -> None:
        await send_json(call.responder, 200, self.reads.endpoints())

    # -- changes (operator door) -------------------------------------------------------------------

    async def reload(self, call: Call) -> None:
        result = await self.actions.reload()
        log.info("reload requested by %s: %s%s", call.who, "" if result.ok else "refused: ", result.message)
        await send_json(call.responder, 200 if result.ok else 400, result)

    async def forget_node(self, call: Call) -> None:
        node_id = call.params["node"]
        problem = self.actions.forget_node(node_id)
        if problem:
            missing = problem == "not found"
            await send_error(call.responder, 404 if missing else 409, f"cannot forget {node_id}: {problem}",
                             "not_found" if missing else "conflict")
        else:
            log.info("node %s forgotten by %s", node_id, call.who)
            await send_json(call.responder, 200, {"forgotten": node_id})

    async def restart_replica(self, call: Call) -> None:
        """`?force=1`: where no node has room for the successor, stop the old one first."""
        from urllib.parse import parse_qs

        force = parse_qs(call.request.query).get("force", ["0"])[-1] in ("1", "true", "yes")
        result = self.actions.restart_replica(call.params["replica"], call.who, force=force)
        if isinstance(result, tuple):
            status, problem = result
            await send_error(call.responder, status, problem, "not_found" if status == 404 else "conflict")
        else:
            await send_json(call.responder, 202 if result.move else 200, result)

    async def get_move(self, call: Call) -> None:
        move_id = call.params["move"]
        outcome = self.reads.move(int(move_id)) if move_id.isdigit() and len(move_id) < 12 else None
        if outcome is None:
            await send_error(call.responder, 404, f"no move {move_id!r} (ended moves are kept a while, the newest)",
                             "not_found")
        else:
            await send_json(call.responder, 200, outcome)

    async def cordon(self, call: Call) -> None:
        await self._mark(call, self.actions.cordon, "cordoned")

    async def uncordon(self, call: Call) -> None:
        await self._mark(call, self.actions.uncordon, "uncordoned")

    async def _mark(self, call: Call, action: Callable[[str, str], str], done: str) -> None:
        node_id = call.params["node"]
        problem = action(node_id, call.who)
        if problem:
            await send_error(call.responder, 404, f"no node {node_id!r}", "not_found")
        else:
            log.info("node %s %s by %s", node_id, done, call.who)
            await send_json(call.responder, 200, {"node": node_id, done: True})

    async def drain(self, call: Call) -> None:
        """Start (or look at again) a drain: `?force=1` retires replicas that have nowhere to go."""
        from urllib.parse import parse_qs

        node_id = call.params["node"]
        force = parse_qs(call.request.query).get("force", ["0"])[-1] in ("1", "true", "yes")
        result = self.actions.drain(node_id, call.who, force=force)
        if isinstance(result, str):
            await send_error(call.responder, 404, f"no node {node_id!r}", "not_found")
        else:
            await send_json(call.responder, 200, result)

    async def drain_status(self, call: Call) -> None:
        node_id = call.params["node"]
        view = self.actions.drain_status(node_id)
        if view is None:
            await send_error(call.responder, 404, f"no node {node_id!r}", "not_found")
        else:
            await send_json(call.responder, 200, view)


    async def fabric_test(self, call: Call) -> None:
        """`ctl fabric-test A B`: ib_write_bw rail by rail. Refused at once (before anything is sent to
        a node) with the reason; otherwise NDJSON, one line per step as it happens, the report last."""
        if self.fabric_tests is None:
            await send_error(call.responder, 404, "fabric tests are not served here", "not_found")
            return
        try:
            body = msgspec.json.decode(call.request.body or b"{}", type=FabricTestRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await send_error(call.responder, 400, f"fabric test request: {exc} (send {{\"a\": NODE, \"b\": NODE}})",
                             "bad_request")
            return
        try:
            self.fabric_tests.check(body.a, body.b, gpudirect=body.gpudirect, duration=body.duration,
                                    rail_timeout=body.timeout)
        except Refused as exc:
            await send_error(call.responder, exc.status, str(exc), _REFUSED_CODES.get(exc.status, "conflict"))
            return
        log.info("fabric test %s → %s requested by %s", body.a, body.b, call.who)
        call.responder.watch_disconnect()  # Ctrl-C on `ctl fabric-test` ends the test, and the runs on both nodes
        await call.responder.start(200, [(b"content-type", b"application/x-ndjson")])

        async def emit(event: dict) -> None:
            await call.responder.send(json_encoder.encode(event) + b"\n")

        try:
            report = await self.fabric_tests.run(body.a, body.b, emit, rail_timeout=body.timeout, size=body.size,
                                                 iterations=body.iterations, duration=body.duration,
                                                 gpudirect=body.gpudirect)
        except Refused as exc:  # the fleet changed between the check and the start
            report = {"event": "done", "a": body.a, "b": body.b, "status": "unknown", "exit_code": 3,
                      "error": str(exc), "rails": []}
        await call.responder.end(json_encoder.encode(report) + b"\n")


class FabricTestRequest(msgspec.Struct, forbid_unknown_fields=True):
    """What `ctl fabric-test` sends; the bounds are its options' (a direct API call gets the same)."""

    a: str
    b: str
    timeout: Annotated[float, msgspec.Meta(ge=1, le=600)] = 60.0
    size: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] = 65536
    iterations: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 5000
    # -D seconds; 0: `iterations` of `size`; absent: 5, or what fits in `timeout` (fabric_test.default_duration)
    duration: Annotated[int, msgspec.Meta(ge=0, le=597)] | None = None
    gpudirect: bool = False


_REFUSED_CODES = {400: "bad_request", 404: "not_found", 409: "conflict", 503: "unavailable"}


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
    ApiRoute("GET", "fabrics", Door.VIEWER, PublicHandler.list_fabrics),
    ApiRoute("GET", "fabrics/{fabric}", Door.VIEWER, PublicHandler.get_fabric),
    ApiRoute("GET", "fabrics/{fabric}/topology", Door.VIEWER, PublicHandler.get_topology),
    ApiRoute("GET", "events", Door.VIEWER, PublicHandler.list_events),
    ApiRoute("GET", "doctor", Door.VIEWER, PublicHandler.get_doctor),
    ApiRoute("GET", "gateways", Door.VIEWER, PublicHandler.list_gateways),
    ApiRoute("GET", "replicas/{replica}/logs", Door.VIEWER, PublicHandler.replica_logs),
    ApiRoute("GET", "logs/{name}", Door.VIEWER, PublicHandler.logs),
    ApiRoute("GET", "nodes/{node}/drain", Door.VIEWER, PublicHandler.drain_status),
    ApiRoute("GET", "moves/{move}", Door.VIEWER, PublicHandler.get_move),
    ApiRoute("POST", "reload", Door.OPERATOR, PublicHandler.reload),
    ApiRoute("DELETE", "nodes/{node}", Door.OPERATOR, PublicHandler.forget_node),
    ApiRoute("POST", "replicas/{replica}/restart", Door.OPERATOR, PublicHandler.restart_replica),
    ApiRoute("POST", "nodes/{node}/cordon", Door.OPERATOR, PublicHandler.cordon),
    ApiRoute("POST", "nodes/{node}/uncordon", Door.OPERATOR, PublicHandler.uncordon),
    ApiRoute("POST", "nodes/{node}/drain", Door.OPERATOR, PublicHandler.drain),
    ApiRoute("POST", "fabric-tests", Door.OPERATOR, PublicHandler.fabric_test),
)


def match_route(method: str, route: str) -> tuple[ApiRoute, dict[str, str]] | None:
    for api_route in API_ROUTES:
        if api_route.method == method:
            params = api_route.match(route)
            if params is not None:
                return api_route, params
    return None


def parse_event_query(query: str, now: float) -> EventQuery:
    """`since=` a duration back from now (90m, 2h, 1d) or a time in seconds since the epoch;
    `after=` an event id (what is new since the last look); `node=`, `model=`, `limit=`."""
    from urllib.parse import parse_qs

    from llmgw.catalog.units import parse_since

    args = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    since = 0.0
    if text := args.get("since", "").strip():
        since = parse_since(text, now)
    try:
        after = int(args.get("after") or 0)
        limit = min(int(args.get("limit") or QUERY_LIMIT), QUERY_LIMIT)
    except ValueError:
        raise ValueError("after= and limit= take whole numbers") from None
    return EventQuery(since=since, after=after, node=args.get("node", ""), model=args.get("model", ""), limit=limit)
