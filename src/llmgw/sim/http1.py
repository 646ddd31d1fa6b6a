"""The minimal HTTP/1.1 server side the simulated engine needs. Pure: bytes in, bytes out.

Why not h11: measured on the 2-core dev box (bench/bench_sim_engine.py, 32 keep-alive
connections, fixed-response chat), the engine on h11 answered 8,100 requests/s at 124 µs of
CPU per request, and a profile put about half of that in h11 (`next_event`, header
normalisation, `send`). In the same bench a server that only runs h11 and writes a canned
answer costs ~100 µs a request; a bare trio server that finds the blank line and writes
canned bytes costs ~17 µs. The gateway benchmark runs this engine next to the gateway on two
cores at 2,500 requests/s, so every microsecond here is taken from the gateway. This module
parses only what the engine reads (request line, Content-Length, Transfer-Encoding: chunked,
Connection, Expect) and writes responses from byte templates; with it the engine costs
~26 µs a request (~37,000 requests/s on one core). tests/unit/test_sim_http1.py checks it
against h11 as the reference: requests h11 writes parse the same here, and responses written
here parse in h11.
"""

from __future__ import annotations

import http
import re

MAX_HEAD = 64 * 1024

REASONS: dict[int, bytes] = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")


class HttpError(Exception):
    """The request cannot be read; answer `status` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RequestHead:
    """What the engine needs from a request head."""

    __slots__ = (
        "chunked",
        "close",
        "content_length",
        "expect_continue",
        "http10",
        "method",
        "target",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        *,
        http10: bool = False,
        content_length: int = 0,
        chunked: bool = False,
        close: bool = False,
        expect_continue: bool = False,
    ) -> None:
        self.method = method
        self.target = target
        self.http10 = http10
        self.content_length = content_length
        self.chunked = chunked
        self.close = close  # the client asked for (or its HTTP version implies) one request only
        self.expect_continue = expect_continue

    @property
    def path(self) -> bytes:
        q = self.target.find(b"?")
        return self.target if q < 0 else self.target[:q]


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


def parse_request_head(raw: bytes) -> RequestHead:
    """Parse a head that ends with the blank line (as `find_head_end` delimits it)."""
    lines = raw.split(b"\r\n")
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
    content_length: int | None = None
    chunked = False
    close = http10
    expect = False
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep or not name or not _TOKEN.fullmatch(name):
            # also rejects obsolete line folding and whitespace before the colon (RFC 9112 §5)
            raise HttpError(400, "malformed header line")
        name = name.lower()
        value = value.strip(b" \t")
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
            chunked = True
        elif name == b"connection":
            tokens = {t.strip() for t in value.lower().split(b",")}
            if b"close" in tokens:
                close = True
            elif b"keep-alive" in tokens and http10:
                close = False
        elif name == b"expect" and value.lower() == b"100-continue":
            expect = True
    if chunked and content_length is not None:
        raise HttpError(400, "both Content-Length and Transfer-Encoding")
    return RequestHead(
        method,
        target,
        http10=http10,
        content_length=content_length or 0,
        chunked=chunked,
        close=close,
        expect_continue=expect and not http10,
    )


class ChunkedDecoder:
    """Incremental decoder of a chunked request body."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.done = False
        self._need = (
            -1
        )  # bytes of chunk data (plus its CRLF) still to read; -1: a size line is next
        self._trailers = False

    def feed(self, buf: bytearray) -> None:
        """Consume what it can from `buf` (in place); `done` once the last chunk and trailers are read."""
        while not self.done:
            if self._trailers:
                i = buf.find(b"\r\n")
                if i < 0:
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
                self._need = size
            if len(buf) < self._need + 2:
                return
            if buf[self._need : self._need + 2] != b"\r\n":
                raise HttpError(400, "chunk data not followed by CRLF")
            self.body += buf[: self._need]
            del buf[: self._need + 2]
            self._need = -1


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def response_head(
    status: int,
    *,
    content_type: bytes,
    content_length: int | None,
    date: bytes,
    close: bool = False,
    http10: bool = False,
) -> bytes:
    """A response head; `content_length=None` is a streamed body (chunked, or close-delimited on 1.0)."""
    out = [
        b"HTTP/1.1 %d %s\r\ndate: %s\r\nserver: uvicorn\r\ncontent-type: %s\r\n"
        % (status, REASONS.get(status, b"Unknown"), date, content_type)
    ]
    if content_length is not None:
        out.append(b"content-length: %d\r\n" % content_length)
    elif not http10:
        out.append(b"transfer-encoding: chunked\r\n")
    if close:
        out.append(b"connection: close\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never empty: an empty chunk would end the body)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""
