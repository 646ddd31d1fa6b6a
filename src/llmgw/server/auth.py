"""Who is calling on the public port, and what that identity may do there.

Three doors, each with its own credential (Kubernetes, Nomad and Envoy keep reads of cluster
state behind authentication too; a client that may only chat must learn nothing of the fleet):

    client    /v1/*                    a gateway API key (gateway.api_keys); open when none is set
    viewer    GET /api/v1/*, /metrics  a viewer or operator credential, once any credential is set
    operator  /api/v1 mutations        an operator credential (api.operator_tokens, OU=operators)

A credential is a bearer token whose sha256 is in the config (never the token itself), or a
client certificate from the public port's CA whose OU says its kind: `operators` and `viewers`
count here, `nodes` never does (a node's certificate opens the fleet port only). A gateway API
key opens the client door alone. With no credential configured at all the lab is open: reads
always, mutations too under --insecure; the server says so at start.

Refusals are counted in `llmgw_auth_failures_total{door}` and logged without the secret
(at most one line per door per second, with the count of lines held back). The client door is
the gateway's own (llmgw.server.gateway.apikeys, which a gateway worker uses alone); `Auth` keeps
one of it and adds the other two.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

import msgspec

from llmgw.catalog.schema import ServerConfig
from llmgw.server.forgery import check_write
from llmgw.server.gateway import apikeys
from llmgw.server.gateway.apikeys import (
    ClientDoor,
    Refusals,
    bearer_digest,
    digests,
    known,
    secret_digest,
)
from llmgw.tls.build import OPERATOR_OU, VIEWER_OU
from llmgw.tls.identity import HasPeerCert, peer_common_name, peer_kind, peer_units
from llmgw.web.server import Request

log = logging.getLogger("llmgw.auth")


class Door(enum.StrEnum):
    """Where a request knocks; also the label of `llmgw_auth_failures_total`."""

    CLIENT = apikeys.CLIENT
    VIEWER = "viewer"
    OPERATOR = "operator"


class Role(enum.IntEnum):
    """What a presented credential is. Operators may do what viewers may; API keys are apart."""

    NONE = 0
    CLIENT = 1
    VIEWER = 2
    OPERATOR = 3


class Identity(msgspec.Struct, frozen=True):
    role: Role
    # How logs name the caller, never the secret: "operator token sha256:1a2b3c4d…".
    who: str
    # What was presented, for the refusal's hint: "token", "certificate" or "" (nothing).
    presented: str = ""


class Verdict(msgspec.Struct, frozen=True):
    ok: bool
    who: str = ""
    status: int = 200  # 401: no credential for this door; 403: a credential that may not do this
    message: str = ""  # the one line the caller reads


# The admin pages' login form keeps the token in this cookie (HttpOnly, SameSite=Strict, Secure
# under TLS: server/admin/pages.py). It counts at the viewer door only, so a page another site
# opens can never make a change with it, whatever the browser sends.
COOKIE = "llmgw_admin"


def cookie_value(request: Request, name: str = COOKIE) -> bytes | None:
    """One cookie's value from the request's Cookie header (RFC 6265 §4.2: `a=b; c=d`)."""
    header = request.head.get(b"cookie")
    if not header:
        return None
    want = name.encode()
    for part in header.split(b";"):
        key, eq, value = part.strip().partition(b"=")
        if eq and key == want:
            return value.strip().strip(b'"')
    return None


def cookie_digest(request: Request) -> str | None:
    value = cookie_value(request)
    return secret_digest(value) if value else None


def _named(request: Request) -> str:
    return repr(peer_common_name(request.tls) if request.tls is not None else None)


def _kind_of(request: Request) -> str:
    """What the refused client certificate is, for the hint: "a gateway certificate", say."""
    kind = peer_kind(request.tls) if request.tls is not None else None
    return f"a {kind} certificate" if kind else "no llmgw client kind in its OU"


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """The credentials a server config accepts."""

    api_keys: frozenset[str] = frozenset()
    operator_tokens: frozenset[str] = frozenset()
    viewer_tokens: frozenset[str] = frozenset()
    # A TLS public port with a CA asks for client certificates: operator and viewer ones count.
    client_certs: bool = False
    metrics_open: bool = False
    insecure: bool = False

    @classmethod
    def from_config(cls, cfg: ServerConfig, *, insecure: bool) -> Credentials:
        public_tls = cfg.public_tls
        return cls(
            api_keys=digests(cfg.gateway.api_keys),
            operator_tokens=digests(cfg.api.operator_tokens),
            viewer_tokens=digests(cfg.api.viewer_tokens),
            client_certs=bool(public_tls and public_tls.cert and public_tls.ca),
            metrics_open=cfg.api.metrics == "open",
            insecure=insecure,
        )

    @property
    def any(self) -> bool:
        return bool(self.api_keys or self.operator_tokens or self.viewer_tokens or self.client_certs)

    @property
    def readers(self) -> bool:
        """Whether anyone can hold a viewer or operator credential here."""
        return bool(self.operator_tokens or self.viewer_tokens or self.client_certs)


class Auth:
    """The public port's credential checks: one place, one digest check, one set of hints."""

    def __init__(self, cfg: ServerConfig, *, insecure: bool, count: Callable[[str], None] = lambda door: None,
                 clock: Callable[[], float] = time.monotonic,
                 revoked: Callable[[HasPeerCert], bool] = lambda peer: False) -> None:
        self.insecure = insecure
        self._revoked = revoked  # the deny list (tls.deny_list): a revoked certificate is nobody
        # Every door's refusals, counted and logged alike; the client door is the gateway's own
        # (llmgw.server.gateway.apikeys), which its workers and remote gateways use alone.
        self._refusals = Refusals(count, clock)
        self.client_door = ClientDoor(cfg.gateway.api_keys, refusals=self._refusals)
        self.creds = Credentials.from_config(cfg, insecure=insecure)
        self._public_tls = bool(cfg.public_tls and cfg.public_tls.cert)
        self._notes = self.notes(public_tls=self._public_tls)

    def announce(self) -> None:
        """Log what an operator should know about the doors (at start, once the ports listen)."""
        for note in self._notes:
            log.warning("%s", note)

    def configure(self, cfg: ServerConfig) -> None:
        """Take the credentials of a reloaded config; a warning that is new is logged."""
        self.creds = Credentials.from_config(cfg, insecure=self.insecure)
        self.client_door.configure(cfg.gateway.api_keys)
        notes = self.notes(public_tls=self._public_tls)
        for note in notes:
            if note not in self._notes:
                log.warning("%s", note)
        self._notes = notes

    def notes(self, *, public_tls: bool) -> list[str]:
        """What an operator should know about the doors at start."""
        creds = self.creds
        out = []
        if not creds.any:
            mutations = ("and so are changes (--insecure)" if creds.insecure
                         else "changes are refused until an operator credential is configured")
            out.append("no credential is configured (gateway.api_keys, api.viewer_tokens, api.operator_tokens, "
                       "public_tls.ca): reads of /api/v1 and /metrics are open to anyone who reaches the port, "
                       + mutations)
        elif not creds.readers:
            out.append("gateway.api_keys is set but no viewer or operator credential is: nobody can read /api/v1 "
                       "or change the fleet (set api.viewer_tokens or api.operator_tokens)")
        tokens = [name for name, held in (("api.operator_tokens", creds.operator_tokens),
                                          ("api.viewer_tokens", creds.viewer_tokens),
                                          ("gateway.api_keys", creds.api_keys)) if held]
        if tokens and not public_tls:
            out.append(f"{', '.join(tokens)} configured but the public port has no TLS (public_tls): bearer tokens "
                       "cross the network in cleartext unless a TLS proxy fronts this port")
        if creds.any and creds.metrics_open:
            out.append("api.metrics: open: /metrics answers anyone who reaches the port")
        return out

    @property
    def metrics_open(self) -> bool:
        return self.creds.metrics_open or not self.creds.any

    # -- who is calling ------------------------------------------------------------------------------

    def token_role(self, token: str) -> Role:
        """What a token typed into the admin login form is (never logged, never kept but hashed)."""
        digest = secret_digest(token.strip().encode())
        creds = self.creds
        if known(digest, creds.operator_tokens):
            return Role.OPERATOR
        if known(digest, creds.viewer_tokens):
            return Role.VIEWER
        return Role.CLIENT if known(digest, creds.api_keys) else Role.NONE

    def identify(self, request: Request, *, cookie: bool = False) -> Identity:
        """The strongest credential the request presents (a token, a client certificate, both).
        `cookie`: the admin login cookie counts too (reads only: the viewer door)."""
        creds = self.creds
        best = Identity(Role.NONE, "anyone")
        digest = bearer_digest(request)
        if digest is None and cookie:
            digest = cookie_digest(request)
        if digest is not None:
            tag = f"sha256:{digest[:8]}…"
            if known(digest, creds.operator_tokens):
                best = Identity(Role.OPERATOR, f"operator token {tag}", "token")
            elif known(digest, creds.viewer_tokens):
                best = Identity(Role.VIEWER, f"viewer token {tag}", "token")
            elif known(digest, creds.api_keys):
                best = Identity(Role.CLIENT, f"API key {tag}", "token")
            else:
                best = Identity(Role.NONE, "a token that matches no credential", "token")
        if request.tls is not None and request.tls.getpeercert():
            name = peer_common_name(request.tls)
            units = peer_units(request.tls)
            if self._revoked(request.tls):
                cert = Identity(Role.NONE, f"certificate {name!r} (revoked)", "certificate")
            elif OPERATOR_OU in units:
                cert = Identity(Role.OPERATOR, f"operator certificate {name!r}", "certificate")
            elif VIEWER_OU in units:
                cert = Identity(Role.VIEWER, f"viewer certificate {name!r}", "certificate")
            else:
                kind = "/".join(units) or "no OU"
                cert = Identity(Role.NONE, f"certificate {name!r} ({kind})", "certificate")
            if cert.role > best.role or (best.role is Role.NONE and not best.presented):
                best = cert
        return best

    # -- the doors -------------------------------------------------------------------------------------

    def client(self, request: Request) -> bool:
        """The gateway's door: an API key when keys are configured (llmgw.server.gateway.apikeys)."""
        return self.client_door.allows(request)

    def check(self, door: Door, request: Request) -> Verdict:
        """May this request pass `door` (viewer or operator)? A refusal carries its one line."""
        if door is Door.CLIENT:
            return Verdict(True, "client") if self.client(request) else Verdict(
                False, status=401, message="Incorrect or missing API key: send `Authorization: Bearer <key>`")
        creds = self.creds
        ident = self.identify(request, cookie=door is Door.VIEWER)
        if door is Door.VIEWER:
            if ident.role >= Role.VIEWER:
                return Verdict(True, ident.who)
            if not creds.any:
                return Verdict(True, "anyone (no credential configured)")
            verdict = Verdict(False, status=401, message=self._viewer_hint(ident, request))
        else:
            if ident.role is Role.OPERATOR:
                return Verdict(True, ident.who)
            if creds.insecure and not creds.any:
                return Verdict(True, "anyone (--insecure and no credentials configured)")
            if ident.role is Role.VIEWER:
                verdict = Verdict(False, status=403, message=(
                    f"{ident.who} may read the fleet but not change it: this call needs an "
                    "operator credential (a token in api.operator_tokens or `llmgw ctl cert operator NAME`)"))
            else:
                verdict = Verdict(False, status=401, message=self._operator_hint(ident, request))
        self.refused(door, request, ident.who if ident.presented else "no credential")
        return verdict

    def forged(self, request: Request, who: str) -> Verdict | None:
        """A refusal for a change a browser could have been made to send from another site
        (forgery.py), whoever `who` is; counted and logged at the operator door. None: genuine."""
        refusal = check_write(request.method, request.head)
        if refusal is None:
            return None
        self.refused(Door.OPERATOR, request, f"{who}, but {refusal.why}")
        return Verdict(False, status=refusal.status, message=refusal.message)

    def refused(self, door: Door, request: Request, what: str) -> None:
        """Count a refusal at `door` and log it (throttled) with `what` was presented, never a secret."""
        self._refusals.refused(door.value, request, what)

    # -- hints: what to do, in one line ------------------------------------------------------------

    def _ways(self, kind: str, lists: str) -> str:
        creds = self.creds
        tokens = creds.operator_tokens or (kind == "viewer" and creds.viewer_tokens)
        ways = []
        if tokens:
            ways.append(f"--token (or LLMGW_TOKEN) with a token whose sha256 is in {lists}")
        if creds.client_certs:
            article = "an" if kind[0] in "aeiou" else "a"
            ways.append(f"{article} {kind} certificate (`llmgw ctl cert {kind} NAME`) passed with --cert and --key "
                        "over the TLS public port")
        return ", or ".join(ways)

    def _revoked_hint(self, request: Request) -> str:
        if request.tls is None or not self._revoked(request.tls):
            return ""
        return (f"the client certificate {peer_common_name(request.tls)!r} is revoked (tls.deny_list); "
                "ask for a new one (`llmgw ctl cert operator|viewer NAME`)")

    def _viewer_hint(self, ident: Identity, request: Request) -> str:
        creds = self.creds
        if not creds.readers:
            return ("reading the fleet needs a viewer or operator credential and none is configured on this server: "
                    "put a token's sha256 (`llmgw ctl hash-secret`) in api.viewer_tokens or api.operator_tokens and "
                    "pass the token with --token or LLMGW_TOKEN")
        if ident.role is Role.CLIENT:
            return "a gateway API key opens only /v1: reading the fleet needs a viewer or operator credential"
        if ident.presented == "token":
            return ("the token was refused: its sha256 is in neither api.viewer_tokens nor api.operator_tokens "
                    "(hash it with `llmgw ctl hash-secret`)")
        if ident.presented == "certificate" and (revoked := self._revoked_hint(request)):
            return revoked
        if ident.presented == "certificate":
            return (f"the client certificate {_named(request)} is neither a viewer nor an operator certificate "
                    f"({_kind_of(request)}); issue one "
                    "with `llmgw ctl cert viewer NAME` and pass it with --cert and --key")
        return "reading the fleet needs a viewer or operator credential: " + self._ways(
            "viewer", "api.viewer_tokens or api.operator_tokens")

    def _operator_hint(self, ident: Identity, request: Request) -> str:
        creds = self.creds
        if not creds.operator_tokens and not creds.client_certs:
            return ("no operator credential is configured on this server: put a token's sha256 "
                    "(`llmgw ctl hash-secret`) in api.operator_tokens and pass the token with --token or "
                    "LLMGW_TOKEN, or set public_tls (cert, key, ca) and use an operator certificate")
        if ident.role is Role.CLIENT:
            return "a gateway API key opens only /v1: this call needs an operator credential"
        if ident.presented == "token":
            return ("the operator token was refused: its sha256 is not in api.operator_tokens "
                    "(hash it with `llmgw ctl hash-secret`)")
        if ident.presented == "certificate" and (revoked := self._revoked_hint(request)):
            return revoked
        if ident.presented == "certificate":
            return (f"the client certificate {_named(request)} is not an operator certificate ({_kind_of(request)}); "
                    "issue one with `llmgw ctl cert operator NAME` and pass it with --cert and --key")
        return "this call needs an operator credential: " + self._ways("operator", "api.operator_tokens")
