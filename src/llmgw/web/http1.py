"""HTTP/1.1 framing for the public port and the upstream pool. Pure: bytes in, values out.

Why not h11 (or hypercorn above it): measured on the 2-core dev box, hypercorn serving a
trivial ASGI app used ~460 µs of CPU per request (2,150 requests/s at 32 connections, one
core saturated), over the gateway's whole budget of 300 µs per proxied request; h11 alone
cost ~124 µs per request in the simulated engine against ~28 µs for this kind of parser
(bench/bench_sim_engine.py). The gateway parses requests and upstream responses on every
call, so it uses this minimal framing: request/status line, headers as a list plus the few
it acts on (Content-Length, Transfer-Encoding, Connection, Expect), chunked coding.
tests/unit/test_http1.py checks it against h11 as the reference implementation.
"""

from __future__ import annotations

import http
import re

MAX_HEAD = 64 * 1024
MAX_HEADERS = 128

REASONS: dict[int, bytes] = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})(?: .*)?")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


class HttpError(Exception):
    """The message cannot be read; a server answers `status` and closes the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Headers = list[tuple[bytes, bytes]]  # lower-case names, values as sent


class Framing:
    """The headers that decide how a message body is delimited and the connection reused."""

    __slots__ = ("chunked", "close", "content_length", "expect_continue", "headers")

    def __init__(self) -> None:
        self.headers: Headers = []
        self.content_length: int | None = None
        self.chunked = False
        self.close = False
        self.expect_continue = False

    def get(self, name: bytes, default: bytes | None = None) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return default


class RequestHead(Framing):
    __slots__ = ("http10", "method", "target")

    def __init__(self, method: bytes, target: bytes, http10: bool) -> None:
        super().__init__()
        self.method = method
        self.target = target
        self.http10 = http10

    @property
    def path(self) -> bytes:
        q = self.target.find(b"?")
        return self.target if q < 0 else self.target[:q]

    @property
    def query(self) -> bytes:
        q = self.target.find(b"?")
        return b"" if q < 0 else self.target[q + 1 :]


class ResponseHead(Framing):
    __slots__ = ("status",)

    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status


def find_head_end(buf: bytes | bytearray) -> int:
    """Index just past the blank line ending the head, -1 if not all here; raises if too long."""
    i = buf.find(b"\r\n\r\n")
    if i >= 0:
        if i > MAX_HEAD:
            raise HttpError(431, "request head too large")
        return i + 4
    if len(buf) > MAX_HEAD:
        raise HttpError(431, "request head too large")
    return -1


def _parse_fields(lines: list[bytes], msg: Framing, http10: bool) -> None:
    content_length: int | None = None
    close = http10
    if len(lines) > MAX_HEADERS + 2:
        raise HttpError(431, "too many header fields")
    headers = msg.headers
    for line in lines:
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep or not name or not _TOKEN.fullmatch(name):
            # also rejects obsolete line folding and whitespace before the colon (RFC 9112 §5)
            raise HttpError(400, "malformed header line")
        name = name.lower()
        value = value.strip(b" \t")
        headers.append((name, value))
        if name == b"content-length":
            if not value.isdigit():
                raise HttpError(400, "bad Content-Length")
            n = int(value)
            if content_length is not None and content_length != n:
                raise HttpError(400, "conflicting Content-Length headers")
            content_length = n
        elif name == b"transfer-encoding":
            if value.lower() != b"chunked":
                raise HttpError(501, "only chunked transfer coding is supported")
            msg.chunked = True
        elif name == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            if b"close" in tokens:
                close = True
            elif b"keep-alive" in tokens and http10:
                close = False
        elif name == b"expect" and value.lower() == b"100-continue":
            msg.expect_continue = not http10
    if msg.chunked and content_length is not None:
        raise HttpError(400, "both Content-Length and Transfer-Encoding")
    msg.content_length = content_length
    msg.close = close


def parse_request_head(raw: bytes | bytearray) -> RequestHead:
    """Parse a head that ends with the blank line (as `find_head_end` delimits it)."""
    lines = bytes(raw).split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if version == b"HTTP/1.1":
        http10 = False
    elif version == b"HTTP/1.0":
        http10 = True
    elif version.startswith(b"HTTP/"):
        raise HttpError(505, "HTTP version not supported")
    else:
        raise HttpError(400, "malformed request line")
    if not _TOKEN.fullmatch(method) or not _TARGET.fullmatch(target):
        raise HttpError(400, "malformed request line")
    head = RequestHead(method, target, http10)
    _parse_fields(lines[1:], head, http10)
    return head


def parse_response_head(raw: bytes | bytearray) -> ResponseHead:
    lines = bytes(raw).split(b"\r\n")
    match = _STATUS.fullmatch(lines[0])
    if match is None:
        raise HttpError(502, f"malformed status line {lines[0][:80]!r}")
    http10 = lines[0].startswith(b"HTTP/1.0")
    head = ResponseHead(int(match.group(1)))
    _parse_fields(lines[1:], head, http10)
    return head


def response_head(
    status: int,
    headers: Headers | list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    *,
    content_length: int | None = None,
    chunked: bool = False,
    close: bool = False,
) -> bytes:
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b"Unknown"))]
    for name, value in headers:
        parts.append(name + b": " + value + b"\r\n")
    if content_length is not None:
        parts.append(b"content-length: %d\r\n" % content_length)
    elif chunked:
        parts.append(b"transfer-encoding: chunked\r\n")
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def request_head(method: bytes, target: bytes, headers: Headers, content_length: int | None) -> bytes:
    parts = [method + b" " + target + b" HTTP/1.1\r\n"]
    for name, value in headers:
        parts.append(name + b": " + value + b"\r\n")
    if content_length is not None:
        parts.append(b"content-length: %d\r\n" % content_length)
    parts.append(b"\r\n")
    return b"".join(parts)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class ChunkedDecoder:
    """Incremental decoder of a chunked body; `limit` bounds the decoded size (413 beyond)."""

    def __init__(self, limit: int | None = None) -> None:
        self.body = bytearray()
        self.done = False
        self.limit = limit
        self._need = -1  # bytes of chunk data still to read; -1: a size line is next
        self._trailers = False

    def feed(self, buf: bytearray) -> None:
        """Consume what it can from `buf` (in place); `done` once the last chunk and trailers are read."""
        while not self.done:
            if self._trailers:
                i = buf.find(b"\r\n")
                if i < 0:
                    if len(buf) > MAX_HEAD:
                        raise HttpError(400, "trailers too large")
                    return
                line = bytes(buf[:i])
                del buf[: i + 2]
                if not line:
                    self.done = True
                continue
            if self._need < 0:
                i = buf.find(b"\r\n")
                if i < 0:
                    if len(buf) > 1024:
                        raise HttpError(400, "bad chunk size line")
                    return
                size_text = bytes(buf[:i]).split(b";", 1)[0].strip()
                del buf[: i + 2]
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise HttpError(400, "bad chunk size") from None
                if size < 0:
                    raise HttpError(400, "bad chunk size")
                if size == 0:
                    self._trailers = True
                    continue
                if self.limit is not None and len(self.body) + size > self.limit:
                    raise HttpError(413, f"body over the limit of {self.limit} bytes")
                self._need = size
            if len(buf) < self._need + 2:
                return
            if buf[self._need : self._need + 2] != b"\r\n":
                raise HttpError(400, "chunk data not followed by CRLF")
            self.body += buf[: self._need]
            del buf[: self._need + 2]
            self._need = -1


class ChunkedScanner:
    """Finds where a chunked body ends without copying it, so the gateway can relay an
    engine's chunked stream byte for byte (the framing is already right for the client).

    `scan(data)` returns the number of bytes of `data` that belong to the body (all of it
    until the terminating chunk and trailers are seen); `done` then says the body ended.
    `chunks` counts data chunks seen (one per SSE event from vLLM, for metrics).
    """

    __slots__ = ("_line", "_need", "_state", "chunks", "done", "first_data")

    def __init__(self) -> None:
        self._state = 0  # 0 size line, 1 data, 2 data CRLF, 3 trailers
        self._need = 0
        self._line = bytearray()
        self.done = False
        self.chunks = 0
        self.first_data = False

    def scan(self, data: bytes) -> int:
        end = len(data)
        if self._state == 0 and not self._line:
            # Fast path: exactly one whole data chunk, as an engine writes one SSE event.
            nl = data.find(b"\r\n", 0, 18)
            if nl > 0:
                try:
                    size = int(data[:nl], 16)
                except ValueError:
                    size = -1
                if size > 0 and nl + 2 + size + 2 == end and data.endswith(b"\r\n"):
                    self.chunks += 1
                    self.first_data = True
                    return end
        pos = 0
        while pos < end and not self.done:
            if self._state == 1:
                take = min(self._need, end - pos)
                pos += take
                self._need -= take
                if self._need == 0:
                    self._state, self._need = 2, 2
                continue
            if self._state == 2:
                take = min(self._need, end - pos)
                pos += take
                self._need -= take
                if self._need == 0:
                    self._state = 0
                continue
            # a line: size line (state 0) or trailer line (state 3)
            nl = data.find(b"\n", pos, end)
            if nl < 0:
                self._line += data[pos:end]
                if len(self._line) > 4096:
                    raise HttpError(502, "bad chunk framing from upstream")
                pos = end
                break
            self._line += data[pos:nl]
            pos = nl + 1
            line = bytes(self._line).rstrip(b"\r")
            self._line.clear()
            if self._state == 3:
                if not line:
                    self.done = True
                continue
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpError(502, "bad chunk size from upstream") from None
            if size == 0:
                self._state = 3
            else:
                self.chunks += 1
                self.first_data = True
                self._state, self._need = 1, size
        return pos
