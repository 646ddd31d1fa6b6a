"""The admin pages' routes on the public port (issue 15), behind the viewer door.

    /admin/                          the cluster: nodes, replicas, subnet managers, recent events
    /admin/nodes/{id}                one node: GPUs and NVLink, RDMA ports and error counters, shards
    /admin/fabrics/{id}              one fabric drawn on a canvas (static/fabric.js) from
                                     /api/v1/fabrics/{id}/topology and ports.json below
    /admin/fabrics/{id}/ports.json   every adapter's port state and byte counters (traffic particles)
    /admin/static/{name.hash.ext}    the pages' files, content-hashed, cached for a year
    /admin/login, /admin/logout      the login form: a token into an HttpOnly cookie

Every page is a read (GET/HEAD); the login form's POST only checks a token and sets the cookie,
and is refused when another site's page sent it (server/forgery.py's `cross_site`).
Access follows the public port's rules (server/auth.py): the viewer door, which a viewer or
operator token (header or the login cookie) or certificate opens, and a gateway API key does not.
With no credential configured the lab is open, as /api/v1 is. A browser without a credential
gets the login form where tokens are configured, else the refusal's one line.

HTML is never cached (`no-store`: it shows the fleet now); the static files are immutable under
their hashed names (assets.py). Every page carries a Content-Security-Policy that allows scripts
and styles from this origin only, no inline script, no framing.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import parse_qs, quote

import msgspec

from llmgw.server.admin import render
from llmgw.server.admin.traffic import ports_document
from llmgw.server.answers import send_error
from llmgw.server.auth import COOKIE, Auth, Door, Role, cookie_value
from llmgw.server.events import EventLog, EventQuery
from llmgw.server.forgery import cross_site
from llmgw.server.views import NodeDetail, ReadModel
from llmgw.web.assets import IMMUTABLE, PREFIX, Assets
from llmgw.web.server import Request, Responder

log = logging.getLogger("llmgw.admin")

EVENTS_SHOWN = 25
COOKIE_LIFETIME = 12 * 3600  # seconds: a working day, then the form again
HTML = (b"content-type", b"text/html; charset=utf-8")
CSP = (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                   b"connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
NO_STORE = (b"cache-control", b"no-store")
PAGE_HEADERS = [HTML, NO_STORE, CSP, (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"same-origin")]
_json = msgspec.json.Encoder()


class AdminPages:
    def __init__(self, *, reads: ReadModel, auth: Auth, assets: Assets, events: EventLog | None = None,
                 tls: bool = False) -> None:
        self.reads = reads
        self.auth = auth
        self.assets = assets
        self.events = events
        self.tls = tls  # the public port speaks TLS: the cookie is Secure

    async def __call__(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path.startswith(PREFIX):
            await self.static(request, responder)
            return
        if path == "/admin":
            await responder.respond(308, [(b"location", b"/admin/"), NO_STORE], b"")
            return
        if path == "/admin/login":
            await self.login(request, responder)
            return
        if path == "/admin/logout":
            await self.logout(request, responder)
            return
        if request.method not in ("GET", "HEAD"):
            await self.page(responder, 405, render.refusal_page(self.assets.url, 405, "the admin pages only read"),
                            [(b"allow", b"GET, HEAD")])
            return
        verdict = self.auth.check(Door.VIEWER, request)
        if not verdict.ok:
            await self.refuse(request, responder, verdict.status, verdict.message)
            return
        parts = path[len("/admin/"):].split("/")
        now = time.monotonic()
        if parts == [""]:
            await self.cluster(responder, now)
        elif len(parts) == 2 and parts[0] == "nodes" and parts[1]:
            await self.node(responder, parts[1], now)
        elif len(parts) == 2 and parts[0] == "fabrics" and parts[1]:
            await self.fabric(responder, parts[1])
        elif len(parts) == 3 and parts[0] == "fabrics" and parts[2] == "ports.json":
            await self.ports(responder, parts[1], now)
        else:
            await self.page(responder, 404, render.refusal_page(self.assets.url, 404, f"no admin page {path}"))

    async def page(self, responder: Responder, status: int, text: str,
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await responder.respond(status, [*PAGE_HEADERS, *(headers or [])], text.encode())

    # -- pages ------------------------------------------------------------------------------------------

    def _fabric_ids(self) -> list[str]:
        return [f["id"] for f in self.reads.fabrics()]

    async def cluster(self, responder: Responder, now: float) -> None:
        wall = time.time()
        fabrics = [d for d in (self.reads.fabric(f["id"]) for f in self.reads.fabrics()) if d is not None]
        events = []
        if self.events is not None:
            events = await self.events.query(EventQuery(since=wall - 86400, limit=EVENTS_SHOWN))
        text = render.cluster_page(self.reads.nodes(now), self.reads.replicas(now), fabrics, events[-EVENTS_SHOWN:],
                                   wall, self.assets.url)
        await self.page(responder, 200, text)

    async def node(self, responder: Responder, node_id: str, now: float) -> None:
        node = self.reads.node(node_id, now)
        if not isinstance(node, NodeDetail):
            await self.page(responder, 404, render.refusal_page(self.assets.url, 404, f"no node {node_id!r}"))
            return
        text = render.node_page(node, self.reads.replicas(now), self._fabric_ids(), self.assets.url)
        await self.page(responder, 200, text)

    async def fabric(self, responder: Responder, fabric_id: str) -> None:
        fabrics = self._fabric_ids()
        if fabric_id not in fabrics:
            await self.page(responder, 404, render.refusal_page(
                self.assets.url, 404, f"no fabric {fabric_id!r} (known: {', '.join(fabrics) or 'none yet'})"))
            return
        await self.page(responder, 200, render.fabric_page(fabric_id, fabrics, self.assets.url))

    async def ports(self, responder: Responder, fabric_id: str, now: float) -> None:
        topology = self.reads.fabric_topology(fabric_id)
        if topology is None:
            await responder.respond(404, [(b"content-type", b"application/json"), NO_STORE],
                                    b'{"error": {"message": "no topology for this fabric yet", "code": "not_found"}}')
            return
        nodes = {a["node"] for a in topology.get("adapters", []) if a.get("node")}
        details = {n: d for n in sorted(nodes) if isinstance(d := self.reads.node(n, now), NodeDetail)}
        doc = ports_document(topology, details, time.time())
        await responder.respond(200, [(b"content-type", b"application/json"), NO_STORE], _json.encode(doc))

    async def static(self, request: Request, responder: Responder) -> None:
        asset = self.assets.lookup(request.path)
        if asset is None or request.method not in ("GET", "HEAD"):
            await responder.respond(404, [(b"content-type", b"text/plain; charset=utf-8"), NO_STORE],
                                    b"no such file (an old version's name? reload the page)\n")
            return
        await responder.respond(200, [(b"content-type", asset.content_type), (b"cache-control", IMMUTABLE),
                                      (b"x-content-type-options", b"nosniff")], asset.body)

    # -- access ---------------------------------------------------------------------------------------

    async def refuse(self, request: Request, responder: Responder, status: int, message: str) -> None:
        """A browser without a credential gets the login form where tokens can be typed; the pages'
        scripts (ports.json) get the API's JSON error, whose one line fabric.js shows."""
        creds = self.auth.creds
        if request.path.endswith(".json"):
            headers = [(b"www-authenticate", b'Bearer realm="llmgw viewer"')] if status == 401 else []
            await send_error(responder, status, message, "unauthorized" if status == 401 else "forbidden",
                             [NO_STORE, *headers])
            return
        if status == 401 and (creds.operator_tokens or creds.viewer_tokens):
            # Say why when something was presented: a token, the cookie, or a client certificate
            # (a node's or a revoked one would otherwise meet a bare form, with no word of it).
            presented = (request.head.get(b"authorization") is not None or cookie_value(request) is not None
                         or (request.tls is not None and bool(request.tls.getpeercert())))
            await self.page(responder, 401, render.login_page(self.assets.url, error=message if presented else "",
                                                              next_path=_safe_next(request.path)))
            return
        await self.page(responder, status, render.refusal_page(self.assets.url, status, message))

    async def login(self, request: Request, responder: Responder) -> None:
        if request.method in ("GET", "HEAD"):
            args = parse_qs(request.query)
            await self.page(responder, 200, render.login_page(self.assets.url,
                                                              next_path=_safe_next(args.get("next", [""])[-1])))
            return
        if request.method != "POST":
            await self.page(responder, 405, render.refusal_page(self.assets.url, 405, "the login form is GET or POST"),
                            [(b"allow", b"GET, HEAD, POST")])
            return
        if (foreign := cross_site(request.head)) is not None:  # another site signing this browser in (forgery.py)
            self.auth.refused(Door.VIEWER, request, f"a login form sent from another site ({foreign})")
            await self.page(responder, 403, render.refusal_page(
                self.assets.url, 403, f"a login from another site's page is refused ({foreign}): use this server's own "
                "login form"))
            return
        form = parse_qs(request.body.decode("utf-8", errors="replace"), max_num_fields=8)
        token = form.get("token", [""])[-1].strip()
        next_path = _safe_next(form.get("next", [""])[-1])
        role = self.auth.token_role(token) if _cookie_safe(token) else Role.NONE
        if role < Role.VIEWER:
            error = ("a gateway API key opens only /v1: these pages need a viewer or operator token"
                     if role is Role.CLIENT else "the token was refused: its sha256 is in neither api.viewer_tokens "
                     "nor api.operator_tokens")
            self.auth.check(Door.VIEWER, request)  # counted and logged as a refusal, without the secret
            await self.page(responder, 401, render.login_page(self.assets.url, error=error, next_path=next_path))
            return
        secure = "; Secure" if self.tls else ""
        cookie = f"{COOKIE}={token}; Path=/; Max-Age={COOKIE_LIFETIME}; HttpOnly; SameSite=Strict{secure}"
        log.info("admin login from %s with a %s token", request.peer, role.name.lower())
        await responder.respond(303, [(b"location", quote(next_path, safe="/").encode()), NO_STORE,
                                      (b"set-cookie", cookie.encode())], b"")

    async def logout(self, request: Request, responder: Responder) -> None:
        secure = "; Secure" if self.tls else ""
        await responder.respond(303, [(b"location", b"/admin/login"), NO_STORE,
                                      (b"set-cookie",
                                       f"{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict{secure}".encode())],
                                b"")


def _cookie_safe(token: str) -> bool:
    """A token that can stand in a Set-Cookie header as it is (RFC 6265 cookie-octets)."""
    return 0 < len(token) <= 512 and all(0x21 <= ord(c) <= 0x7E and c not in '",;\\' for c in token)


def _safe_next(path: str) -> str:
    """Where the form returns to: a path of these pages only (never another site)."""
    return path if path.startswith("/admin/") and "//" not in path and "\\" not in path else "/admin/"


def package_assets(package: str = "llmgw.server.admin", folder: str = "static") -> Assets:
    """The files of a package's folder (the admin pages' static/), read once at start: the I/O
    that keeps llmgw.web.assets pure."""
    from importlib import resources

    root = resources.files(package) / folder
    return Assets({entry.name: entry.read_bytes() for entry in root.iterdir()
                   if entry.is_file() and not entry.name.startswith(".")})
