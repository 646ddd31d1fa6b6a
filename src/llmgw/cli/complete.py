"""Dynamic shell completion: `llmgw ctl drain g<TAB>` offers the nodes the server knows, as
`kubectl drain <TAB>` does.

Each argument that names something on the server gets a click `shell_complete` callback from
here. A TAB asks one read-only GET (PATHS in `llmgw.cli.candidates`) with the server, token and
certificate the command itself would use (its --server/--token/--cert/--key/--ca, typed or from
LLMGW_*), under one deadline for the whole exchange (TIMEOUT, 0.5 s: the issue allows 1 s for
the TAB, and the process takes 0.15-0.7 s to start), and keeps the answer TTL seconds in a file
under the user's cache directory, so a burst of TABs asks once. Any failure (no server, a refused credential, a
hung server, a broken answer, an unwritable cache) offers nothing and prints nothing: a
completion never shows an error and never hangs a shell.

It stays off the command's import path: stdlib http.client and ssl, imported at the first TAB
(httpx and cryptography would double the 0.15 s a completion takes to start).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from llmgw.cli import candidates as pure

Pick = Callable[[click.Context, list[dict[str, Any]]], list[str]]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw" / "complete"


def _ctl_context(ctx: click.Context) -> click.Context | None:
    found: click.Context | None = ctx
    while found is not None and not ("server" in found.params and "token" in found.params):
        found = found.parent
    return found


def _ctl_params(ctx: click.Context) -> dict[str, Any]:
    """The `llmgw ctl` group's options as this command line sets them (typed, else LLMGW_*, else
    the default): click parsed them before calling us, without running the group's callback."""
    found = _ctl_context(ctx)
    params = dict(found.params) if found is not None else {}
    params.setdefault("server", os.environ.get("LLMGW_SERVER") or "http://127.0.0.1:8080")
    for name, env in (("token", "LLMGW_TOKEN"), ("cert_file", "LLMGW_CERT"), ("key_file", "LLMGW_KEY"),
                      ("ca_file", "LLMGW_CA")):
        if params.get(name) is None:
            params[name] = os.environ.get(env) or None
    return params


def within(seconds: float, ask: Callable[[], Any]) -> Any:
    """`ask()`'s value if it returns within `seconds`, else None: it runs in a daemon thread that
    is waited for that long and then left behind (the process exits right after a TAB). A hard
    bound whatever blocks, a resolver included; socket timeouts alone restart with every byte a
    trickling server sends, and do not cover name resolution."""
    import threading

    result: list[Any] = []

    def run() -> None:
        with contextlib.suppress(BaseException):  # nothing reaches the terminal, even from a thread
            result.append(ask())

    thread = threading.Thread(target=run, name="llmgw-complete", daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def fetch(params: dict[str, Any], path: str, timeout: float = pure.TIMEOUT) -> Any:
    """One GET of `path` on the server `params` names: the parsed JSON; None when the server
    refuses (any status but 200) or the credential may not be sent; raises when the exchange fails."""
    import http.client
    import json
    from urllib.parse import urlsplit

    server = str(params["server"]).rstrip("/")
    url = urlsplit(server if "://" in server else f"http://{server}")
    token, cert, key, ca = params.get("token"), params.get("cert_file"), params.get("key_file"), params.get("ca_file")
    if not url.hostname or not pure.may_ask(url.scheme, url.hostname, credential=bool(token or cert),
                                             insecure=bool(params.get("insecure"))):
        return None
    conn: http.client.HTTPConnection
    if url.scheme == "https":
        import ssl

        context = ssl.create_default_context(cafile=ca or None)
        if cert and key:
            context.load_cert_chain(cert, key)
        conn = http.client.HTTPSConnection(url.hostname, url.port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        headers = {"user-agent": "llmgw-ctl-complete", "accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        conn.request("GET", url.path.rstrip("/") + path, headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            return None
        body = response.read(pure.MAX_BODY + 1)
    finally:
        conn.close()
    if len(body) > pure.MAX_BODY:
        return None
    return json.loads(body)


def _read_cache(path: Path) -> tuple[bool, list[dict[str, Any]] | None]:
    try:
        with open(path, "rb") as fh:
            return pure.decode(fh.read(pure.MAX_BODY), time.time())
    except OSError:
        return False, None


def _write_cache(path: Path, data: bytes) -> None:
    """Atomically (a temporary file beside it, then a rename) and private (0600 in a 0700
    directory: the names of a fleet are not for other users). No fsync: a lost entry is a miss."""
    import tempfile

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def records(ctx: click.Context, kind: str) -> list[dict[str, Any]] | None:
    """The reduced answer for `kind`, from the cache while fresh, else asked once and kept."""
    params = _ctl_params(ctx)
    path = pure.PATHS[kind]
    name = pure.cache_key(str(params["server"]), path, token=params.get("token"), cert=params.get("cert_file"),
                          key=params.get("key_file"), ca=params.get("ca_file"))
    cached = cache_dir() / f"{name}.json"
    fresh, found = _read_cache(cached)
    if fresh:
        return found
    answer = within(pure.TIMEOUT, lambda: fetch(params, path))
    found = None if answer is None else pure.reduce(kind, answer)
    with contextlib.suppress(OSError):
        _write_cache(cached, pure.encode(found, time.time()))
    return found


@contextlib.contextmanager
def _silent() -> Iterator[None]:
    """Nothing reaches the terminal from a completion: a warning or a stray write goes nowhere."""
    stderr = sys.stderr
    sys.stderr = io.StringIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stderr = stderr


class Names:
    """A `shell_complete` callback offering names of `kind` the server knows; `pick` chooses
    among them with what is typed already (fabric-test's B, logs' ranks). `what` is the man
    pages' sentence (tools/gendocs.py)."""

    def __init__(self, kind: str, what: str, pick: Pick | None = None) -> None:
        self.kind = kind
        self.what = what
        self.asks_server = True
        self.pick: Pick = pick or (lambda _ctx, found: pure.names(found))

    def __call__(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
        try:
            with _silent():
                found = records(ctx, self.kind)
                return [] if found is None else pure.matching(self.pick(ctx, found), incomplete)
        except BaseException:  # a TAB never fails, whatever happened (Ctrl-C included)
            return []


def _server_named(ctx: click.Context) -> bool:
    """Whether the command line or LLMGW_SERVER names a server: `ctl cert` works without one, and
    a TAB there must not wait on a default address nobody chose."""
    found = _ctl_context(ctx)
    source = found.get_parameter_source("server") if found is not None else None
    return source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)


class CertNames:
    """`ctl cert` names from the local CA directory (--dir or LLMGW_CA_DIR): the names it issued
    certificates to, of `kind` (all kinds: revoke). Read from the issue records, no server."""

    def __init__(self, kind: str | None, what: str, server: Names | None = None) -> None:
        self.kind = kind
        self.what = what
        self.server = server  # also these names from the server, when --server or LLMGW_SERVER names one
        self.asks_server = server is not None

    def __call__(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
        try:
            with _silent():
                found = self._names(ctx)
        except BaseException:  # a TAB never fails
            found = []
        if self.server is not None and _server_named(ctx):
            found += self.server(ctx, param, incomplete)
        return pure.matching(found, incomplete)

    def _names(self, ctx: click.Context) -> list[str]:
        import json

        directory = ctx.params.get("ca_dir") or os.environ.get("LLMGW_CA_DIR")
        if not directory:
            return []
        out: list[object] = []
        for path in sorted((Path(directory) / "issued").glob("*.json"))[:pure.MAX_CANDIDATES * 4]:
            try:
                record = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and (self.kind is None or record.get("kind") == self.kind):
                out.append(record.get("common_name"))
        return sorted(n for n in out if isinstance(n, str) and pure.safe(n))


def _typed(ctx: click.Context, name: str) -> str | None:
    """An argument typed before the option being completed. `logs R --shard <TAB>`: click's parse
    stops at the option still without its value and leaves R in ctx.args, unassigned."""
    value = ctx.params.get(name)
    return value if isinstance(value, str) else (ctx.args[0] if ctx.args else None)


NODES = Names("nodes", "the nodes the server knows")
FABRIC_A = Names("nodes", "the nodes that share a fabric with another node",
                 lambda _ctx, found: pure.fabric_peers(found, None))
FABRIC_B = Names("nodes", "the other nodes that share a fabric with NODE_A",
                 lambda ctx, found: pure.fabric_peers(found, ctx.params.get("node_a")))
REPLICAS = Names("replicas", "the replicas the server runs")
RANKS = Names("replicas", "the ranks of the replica's shards",
              lambda ctx, found: pure.ranks(found, _typed(ctx, "name")))
LOG_TARGETS = Names("replicas", "the models with replicas, each followed by its replicas",
                    lambda _ctx, found: pure.log_targets(found))
MODELS = Names("models", "the models in the server's catalog")
FABRICS = Names("fabrics", "the fabrics the server knows")
GATEWAYS = Names("gateways", "the gateways that follow the server")
