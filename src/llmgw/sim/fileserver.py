"""A small HTTP file server for tests, the benchmark and the demo: the agent's weight fetcher
meets it the way it meets a real one (an object store, an nginx, a mirror).

It answers GET and HEAD for files under one root with Content-Length, ETag and Last-Modified,
honours `Range: bytes=N-` / `bytes=N-M` (with `If-Range`), and can misbehave on purpose: cut
the connection after N body bytes, leave Content-Length out, announce more bytes than it sends,
ignore Range, serve slowly, or redirect. Every request it answers is recorded (method, path, Range,
If-Range, status), so a test asserts what the server really saw.

It runs on the project's one HTTP/1.1 server (llmgw.web.server) and sends file bytes with
sendfile(2) on plain TCP, so the benchmark's 2 GB over loopback measures the client, not this.
"""

from __future__ import annotations

import email.utils
import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from llmgw.errors import LlmgwError
from llmgw.netaddr import url_host
from llmgw.web.http1 import response_head
from llmgw.web.server import DropConnection, HttpServer, Request, Responder

LISTENING_PREFIX = "llmgw-sim-fileserver listening on"
SEND_PIECE = 1 << 20  # bytes per sendfile call: bounded steps, so one transfer never holds the loop
SLOW_TICK = 0.05  # seconds between pieces when serving slowly (--rate)


class FileServerOptions(msgspec.Struct, kw_only=True):
    root: str
    host: str = "127.0.0.1"
    port: int = 0
    # Cut the connection after this many body bytes (0: never), for the first `drops` responses.
    drop_after: int = 0
    drops: int = 1
    no_length: bool = False  # no Content-Length: the body ends when the connection closes
    extra_length: int = 0  # announce this many bytes more than the file has, then close (a lying server)
    ignore_range: bool = False  # answer every GET 200 with the whole file (a server without Range support)
    rate: float = 0.0  # bytes per second per response (0: as fast as the socket takes them)
    validator: str = "etag"  # etag | last-modified | none: what the server offers for If-Range
    # Request path -> Location: answered 302 (a CDN hand-off, a mirror, or a redirect into the network).
    redirects: dict[str, str] = {}


class SeenRequest(msgspec.Struct, frozen=True):
    method: str
    path: str
    range: str | None
    if_range: str | None
    status: int


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class FileServer:
    """The request handler; `seen` lists every request answered, oldest first."""

    def __init__(self, options: FileServerOptions, log: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.root = Path(options.root).resolve()
        self.seen: list[SeenRequest] = []
        self.changed = trio.Event()  # set (and replaced) whenever a request is recorded
        self._drops_left = options.drops
        self._log = log

    def _record(self, request: Request, status: int) -> None:
        entry = SeenRequest(request.method, request.path, request.header(b"range"), request.header(b"if-range"), status)
        self.seen.append(entry)
        if self._log is not None:
            self._log(f"{entry.method} {entry.path} range={entry.range or '-'} if-range={entry.if_range or '-'} "
                      f"-> {status}")
        self.changed.set()
        self.changed = trio.Event()

    async def __call__(self, request: Request, responder: Responder) -> None:
        if request.method not in ("GET", "HEAD"):
            await self._plain(request, responder, 405, "only GET and HEAD")
            return
        location = self.options.redirects.get(request.path)
        if location is not None:
            self._record(request, 302)
            await responder.respond(302, [(b"location", location.encode()), (b"content-type", b"text/plain")],
                                    b"moved\n")
            return
        path = self._resolve(request.path)
        if path is None:
            await self._plain(request, responder, 404, "not found")
            return
        if path.is_dir():
            await self._plain(request, responder, 403, "a directory")
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except PermissionError:
            await self._plain(request, responder, 403, "not readable")
            return
        except OSError:
            await self._plain(request, responder, 404, "not found")
            return
        try:
            await self._serve_file(request, responder, fd)
        finally:
            os.close(fd)

    def _resolve(self, url_path: str) -> Path | None:
        relative = url_path.lstrip("/")
        if not relative:
            return None
        candidate = (self.root / relative).resolve()
        if not candidate.is_relative_to(self.root) or not candidate.exists():
            return None
        return candidate

    async def _plain(self, request: Request, responder: Responder, status: int, text: str) -> None:
        self._record(request, status)
        await responder.respond(status, [(b"content-type", b"text/plain")], text.encode() + b"\n")

    def _validators(self, st: os.stat_result) -> tuple[str, str]:
        etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
        modified = email.utils.formatdate(st.st_mtime, usegmt=True)
        return etag, modified

    async def _serve_file(self, request: Request, responder: Responder, fd: int) -> None:
        o = self.options
        st = os.fstat(fd)
        size = st.st_size
        etag, modified = self._validators(st)
        headers = [(b"content-type", b"application/octet-stream"),
                   (b"accept-ranges", b"none" if o.ignore_range else b"bytes")]
        if o.validator == "etag":
            headers.append((b"etag", etag.encode()))
        if o.validator in ("etag", "last-modified"):
            headers.append((b"last-modified", modified.encode()))
        start, end = 0, size  # [start, end)
        status = 200
        wanted = request.header(b"range")
        if wanted is not None and not o.ignore_range:
            if_range = request.header(b"if-range")
            current = if_range is None or (o.validator == "etag" and if_range == etag) or (
                o.validator in ("etag", "last-modified") and if_range == modified)
            match = _RANGE.match(wanted.strip())
            if current and match is not None:
                first = int(match.group(1))
                last = int(match.group(2)) + 1 if match.group(2) else size
                if first >= size or last <= first:
                    self._record(request, 416)
                    await responder.respond(416, [(b"content-range", f"bytes */{size}".encode())], b"")
                    return
                start, end, status = first, min(last, size), 206
                headers.append((b"content-range", f"bytes {start}-{end - 1}/{size}".encode()))
        self._record(request, status)
        length = end - start
        cut = o.drop_after > 0 and self._drops_left > 0
        if cut:
            self._drops_left -= 1
        close = responder.close or o.no_length or o.extra_length > 0 or cut
        announced = None if o.no_length else length + o.extra_length
        head = response_head(status, headers, content_length=announced, close=close)
        if request.method == "HEAD":
            await responder.respond_prepared(status, head)
            raise DropConnection  # the head alone, then close (no body to frame on keep-alive)
        await responder.respond_prepared(status, head)
        send = length if not cut else min(length, o.drop_after)
        await self._send_body(responder, fd, start, send)
        if close:
            raise DropConnection  # end of the body (no length), a lie, or the cut

    async def _send_body(self, responder: Responder, fd: int, offset: int, count: int) -> None:
        rate = self.options.rate
        # The connection itself (its fd on plain TCP): the body goes out with sendfile, untouched.
        out = responder.chunked_body_sink().fd
        piece = SEND_PIECE if rate <= 0 else max(1, int(rate * SLOW_TICK))
        while count > 0:
            n = min(piece, count)
            if out is not None:
                sent = await _sendfile(out, fd, offset, n)
            else:
                data = os.pread(fd, n, offset)
                await responder.respond_prepared(200, data)
                sent = len(data)
            offset += sent
            count -= sent
            if rate > 0:
                await trio.sleep(SLOW_TICK)  # ok: --rate paces the body on purpose
            else:
                await trio.lowlevel.checkpoint()


async def _sendfile(out: int, fd: int, offset: int, count: int) -> int:
    """Up to `count` bytes of `fd` from `offset` to the socket `out`; raises DropConnection
    when the client went away."""
    while True:
        try:
            sent = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(out)
            continue
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                raise DropConnection from None
            raise
        if sent == 0:
            raise DropConnection  # the file shrank under us
        return sent


class FileServerHandle(msgspec.Struct):
    server: FileServer
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"


async def serve_files(options: FileServerOptions, *, log: Callable[[str], None] | None = None,
                      task_status: trio.TaskStatus[FileServerHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; `nursery.start` gets the handle (the bound address, what was seen)."""
    root = Path(options.root)
    if not await trio.Path(root).is_dir():
        raise FileServerError(f"--root {options.root}: not a directory")
    try:
        listeners = await trio.open_tcp_listeners(options.port, host=options.host)
    except OSError as exc:
        raise FileServerError(f"cannot listen on {options.host}:{options.port}: {exc.strerror or exc}") from None
    for extra in listeners[1:]:
        await extra.aclose()
    listeners = listeners[:1]
    host, port = listeners[0].socket.getsockname()[:2]
    files = FileServer(options, log)
    http = HttpServer(files)
    async with trio.open_nursery() as nursery:
        await nursery.start(http.serve, listeners)
        task_status.started(FileServerHandle(files, host, port))


class FileServerError(LlmgwError):
    """The server cannot start (bad root, port in use); the message is one line for people."""
