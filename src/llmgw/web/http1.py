"""HTTP/1.1 framing for the public port, the upstream pool and the simulated engine. Pure:
bytes in, values out.

Why not h11 (or hypercorn above it): measured on the 2-core dev box, hypercorn serving a
trivial ASGI app used ~460 µs of CPU per request (2,150 requests/s at 32 connections, one
core saturated), over the gateway's whole budget of 300 µs per proxied request; h11 alone
cost ~106-124 µs per request in the simulated engine against ~37 µs for the whole engine on
this module (bench/bench_sim_engine.py). The gateway parses requests and upstream responses
on every call, so it uses this minimal framing: request/status line, headers as a list plus
the few it acts on (Content-Length, Transfer-Encoding, Connection, Expect), chunked coding.

Measured per request head (timeit, min of runs, same process): 2.1 µs for the 3-header
head of bench_sim_engine and 4.5 µs for a 9-header OpenAI-client head, the same as the
simulated engine's former copy that kept no header list and checked less; control
characters are found with one translate() over the block, and a plain loop beats
comprehensions and regular expressions here on Python 3.11 (findall alone took 2.5 µs).
It is strict where leniency lets two parsers disagree about where a message ends (request
smuggling, response splitting): bare CR or LF, control characters in values, whitespace
before the colon, obsolete line folding and chunk sizes Python's int() would read but
RFC 9112 does not ("+a", "0x1f", "1_0") are refused. tests/unit/test_http1.py checks this
module against h11 as the reference implementation.
"""

from __future__ import annotations

import http
import re

MAX_HEAD = 64 * 1024
MAX_HEADERS = 128
MAX_CHUNK_LINE = 4096

REASONS: dict[int, bytes] = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_TCHAR = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_REQUEST_LINE = re.compile(rb"(%s+) ([\x21-\x7e]+) HTTP/1\.([01])\r\n" % _TCHAR)
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?\r\n")
# Bytes allowed in header lines (what translate() deletes to find the others): all but
# the control characters, HTAB excepted (RFC 9110 §5.5).
_FIELD_BYTES = bytes(b for b in range(256) if b == 9 or (b >= 0x20 and b != 0x7F))
_TOKEN_BYTES = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[\t\x20-\x7e\x80-\xff]*)?")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"

# Header names the framing acts on -> a small code for the dispatch in _parse_fields.
_CONTENT_LENGTH, _TRANSFER_ENCODING, _CONNECTION, _EXPECT, _HOST = 1, 2, 3, 4, 5
_SPECIAL = {
    b"content-length": _CONTENT_LENGTH,
    b"transfer-encoding": _TRANSFER_ENCODING,
    b"connection": _CONNECTION,
    b"expect": _EXPECT,
    b"host": _HOST,
}


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
        # Framing's fields set here rather than through super().__init__(): one call less
        # on every request
        self.headers = []
        self.content_length = None
        self.chunked = False
        self.close = False
        self.expect_continue = False
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
    __slots__ = ("http10", "status")

    def __init__(self, status: int, http10: bool = False) -> None:
        self.headers = []  # Framing's fields, without the call (as RequestHead)
        self.content_length = None
        self.chunked = False
        self.close = False
        self.expect_continue = False
        self.status = status
        self.http10 = http10

    @property
    def has_body(self) -> bool:
        """False for the statuses that never carry a body (1xx, 204, 304; RFC 9112 §6.3)."""
        return self.status >= 200 and self.status not in (204, 304)


def find_head_end(buf: bytes | bytearray, start: int = 0) -> int:
    """Index just past the blank line ending the head, -1 if not all here; raises if too long.

    `start`: how much of `buf` an earlier call already scanned without finding the end (its
    length then): the search resumes 3 bytes before it (the blank line may straddle the two
    reads), so a head that trickles in costs one pass over its bytes, not one per read. A
    64 KiB head sent a byte at a time cost 2.0 s of CPU rescanning from 0 (issue 9);
    `HeadScanner` keeps `start` for a caller and counts the bytes it scanned."""
    begin = start - 3 if start > 3 else 0
    i = buf.find(b"\r\n\r\n", begin)
    if i >= 0:
        if i > MAX_HEAD:
            raise HttpError(431, "request head too large")
        return i + 4
    if len(buf) > MAX_HEAD:
        raise HttpError(431, "request head too large")
    # Not ended yet: a blank line of bare LFs ends a head for a lenient reader, but not for us,
    # so without this a head of LF-ended lines waited out the header timeout (issue 41, item 6).
    # Outside a CRLF CRLF, "\n\n" and "\n\r\n" only come from a line ended by LF alone.
    if buf.find(b"\n\n", begin) >= 0 or buf.find(b"\n\r\n", begin) >= 0:
        raise HttpError(400, "head lines must end with CRLF, not a bare LF (RFC 9112 section 2.2)")
    return -1


class HeadScanner:
    """`find_head_end` that remembers where it stopped, for a buffer that only grows until the
    head is taken off its front (then `reset`). `scanned`: bytes examined over its life, the
    work a slow client can make us do (bounded by ~1× what it sent, plus 3 per read)."""

    __slots__ = ("pos", "scanned")

    def __init__(self) -> None:
        self.pos = 0
        self.scanned = 0

    def find(self, buf: bytes | bytearray) -> int:
        pos = self.pos
        end = find_head_end(buf, pos)
        begin = pos - 3 if pos > 3 else 0
        self.scanned += (end if end >= 0 else len(buf)) - begin
        self.pos = 0 if end >= 0 else len(buf)
        return end

    def reset(self) -> None:
        self.pos = 0


# Header lines already parsed, line -> (name, value): a client sends the same lines on every
# request (host, user-agent, content-type, the OpenAI SDK's nine x-stainless-* lines) and an engine
# the same server and content-type lines on every answer. A line found here passed every check
# below before (its bytes alone decide them) and is checked for control characters with its block
# all the same; what differs per request (content-length, date) is parsed as always. Bounded: lines
# of at most _SEEN_LINE bytes, emptied at _SEEN_MAX entries. Only the headers named in _KEPT (and
# the SDKs' x-stainless-* lines) are kept: a deny list of credential names missed x-api-key, Azure's
# api-key and whatever a deployment invents, and kept lines live in the process's memory. Measured
# (timeit, issue 17) on 500 heads each: the OpenAI Python SDK's 16-line request head 10.3 -> 5.7 µs,
# vLLM's 4-line response head (date and content-length varying) 4.2 -> 3.0 µs.
_SEEN: dict[bytes, tuple[bytes, bytes]] = {}
_SEEN_MAX = 4096
_SEEN_LINE = 256
_KEPT = frozenset({b"host", b"user-agent", b"accept", b"accept-encoding", b"accept-language", b"content-type",
                   b"connection", b"cache-control", b"server", b"x-accel-buffering", b"transfer-encoding",
                   b"keep-alive", b"vary", b"openai-organization", b"openai-project"})


def _parse_fields(raw: bytes, start: int, msg: Framing, http10: bool, bad: int) -> int:
    """Header lines of raw[start:] (which ends with the blank line) into msg; the number of
    Host lines (a request's rule, RFC 9112 §3.2, is checked by its caller).

    Control characters are looked for in the whole block at once (one translate() in C, the
    CRLFs that end lines being the only ones allowed); names are checked the same way, a
    line at a time. A plain loop: in Python 3.11 it beats comprehensions and map() here. One
    loop that also acts on the framing headers, and `Connection: keep-alive` (what engines and
    nginx send) without splitting it into a set: 3.7 -> 2.8 µs for nginx's 5-header response
    (timeit, issue 17)."""
    close = http10
    hosts = 0
    # not raw[start:-4]: compiled by mypyc (llmgw.hotpath), a bytes slice whose start is
    # past its end raises SystemError instead of giving b"" (a head with no header lines)
    end = len(raw) - 4
    block = raw[start:end] if start < end else b""
    if block:
        lines = block.split(b"\r\n")
        if len(lines) > MAX_HEADERS:
            raise HttpError(431, "too many header fields")
        if block.translate(None, _FIELD_BYTES) != b"\r\n" * (len(lines) - 1):
            raise HttpError(bad, "control character in a header line")
        append = msg.headers.append
        special = _SPECIAL
        seen = _SEEN
        content_length: int | None = None
        for line in lines:
            field = seen.get(line)
            if field is None:
                name, sep, value = line.partition(b":")
                if not sep or not name or name.translate(None, _TOKEN_BYTES):
                    # also rejects obsolete line folding and whitespace before the colon (RFC 9112 §5)
                    raise HttpError(bad, "malformed header line")
                field = (name.lower(), value.strip(b" \t"))
                if len(line) <= _SEEN_LINE and (field[0] in _KEPT or field[0].startswith(b"x-stainless-")):
                    if len(seen) >= _SEEN_MAX:
                        seen.clear()
                    seen[line] = field
            append(field)
            name, value = field
            kind = special.get(name)
            if kind is None:
                continue
            if kind == _CONTENT_LENGTH:
                if not value.isdigit() or len(value) > 18:
                    raise HttpError(bad, "bad Content-Length")
                n = int(value)
                if content_length is not None and content_length != n:
                    raise HttpError(bad, "conflicting Content-Length headers")
                content_length = n
            elif kind == _TRANSFER_ENCODING:
                if value.lower() != b"chunked" or msg.chunked:
                    raise HttpError(501 if bad == 400 else bad, "only chunked transfer coding is supported")
                msg.chunked = True
            elif kind == _HOST:
                hosts += 1
            elif kind == _CONNECTION:
                lowered = value.lower()
                if lowered == b"keep-alive":
                    if http10:
                        close = False
                    continue
                tokens = {t.strip() for t in lowered.split(b",")}
                if b"close" in tokens:
                    close = True
                elif b"keep-alive" in tokens and http10:
                    close = False
            elif value.lower() == b"100-continue":
                msg.expect_continue = not http10
        if msg.chunked and content_length is not None:
            raise HttpError(bad, "both Content-Length and Transfer-Encoding")
        msg.content_length = content_length
    msg.close = close
    return hosts


def _whole_head(raw: bytes | bytearray, status: int) -> bytes:
    if type(raw) is not bytes:
        raw = bytes(raw)
    if not raw.endswith(b"\r\n\r\n"):
        raise HttpError(status, "incomplete message head")
    return raw


def parse_request_head(raw: bytes | bytearray) -> RequestHead:
    """Parse a head that ends with the blank line (as `find_head_end` delimits it)."""
    raw = _whole_head(raw, 400)
    m = _REQUEST_LINE.match(raw)
    if m is None:
        line = raw[: raw.find(b"\r\n")]
        parts = line.split(b" ")
        if (len(parts) == 3 and re.fullmatch(rb"HTTP/\d(\.\d)?", parts[2])
                and parts[2] not in (b"HTTP/1.1", b"HTTP/1.0")):
            raise HttpError(505, "HTTP version not supported")
        raise HttpError(400, "malformed request line")
    method, target, minor = m.groups()
    http10 = minor == b"0"
    head = RequestHead(method, target, http10)
    hosts = _parse_fields(raw, m.end(), head, http10, 400)
    if hosts != 1 and (hosts > 1 or not http10):
        # RFC 9112 §3.2: a server MUST answer 400 to an HTTP/1.1 request without a Host line and
        # to any request with more than one (two could route one way and be logged another).
        raise HttpError(400, "more than one Host header" if hosts else "missing Host header")
    return head


def parse_response_head(raw: bytes | bytearray) -> ResponseHead:
    """Parse an upstream's response head; errors are 502 (the upstream is at fault)."""
    raw = _whole_head(raw, 502)
    m = _STATUS_LINE.match(raw)
    if m is None:
        line = raw[: raw.find(b"\r\n")][:80]
        raise HttpError(502, f"malformed status line {line!r}")
    http10 = m.group(1) == b"0"
    head = ResponseHead(int(m.group(2)), http10)
    _parse_fields(raw, m.end(), head, http10, 502)
    return head


def response_head(
    status: int,
    headers: Headers | tuple[tuple[bytes, bytes], ...] = (),
    *,
    content_length: int | None = None,
    chunked: bool = False,
    close: bool = False,
) -> bytes:
    """A response head; with neither `content_length` nor `chunked` the body ends at close."""
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
    """One chunk of a chunked body; empty data gives b"" (an empty chunk would end the body)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


def _chunk_size(line: bytes, status: int) -> int:
    m = _CHUNK_SIZE.fullmatch(line)
    if m is None:
        raise HttpError(status, "bad chunk size line")
    return int(m.group(1), 16)


class ChunkedDecoder:
    """Incremental decoder of a chunked body; `limit` bounds the decoded size (413 beyond)."""

    def __init__(self, limit: int | None = None, *, status: int = 400) -> None:
        self.body = bytearray()
        self.done = False
        self.limit = limit
        self.status = status  # the status of a framing error: 400 for requests, 502 upstream
        self._need = -1  # bytes of chunk data still to read; -1: a size line is next
        self._trailers = -1  # bytes of trailers read so far; -1: not in the trailers

    def feed(self, buf: bytearray) -> None:
        """Consume what it can from `buf` (in place); `done` once the last chunk and trailers are read."""
        while not self.done:
            if self._trailers >= 0:
                i = buf.find(b"\r\n")
                if i < 0:
                    if self._trailers + len(buf) > MAX_HEAD:
                        raise HttpError(self.status, "trailers too large")
                    return
                self._trailers += i + 2
                if self._trailers > MAX_HEAD:
                    raise HttpError(self.status, "trailers too large")
                if bytes(buf[:i]).translate(None, _FIELD_BYTES):
                    raise HttpError(self.status, "control character in a trailer line")
                del buf[: i + 2]
                if i == 0:
                    self.done = True
                continue
            if self._need < 0:
                i = buf.find(b"\r\n")
                if i < 0:
                    if len(buf) > MAX_CHUNK_LINE:
                        raise HttpError(self.status, "bad chunk size line")
                    return
                size = _chunk_size(bytes(buf[:i]), self.status)
                del buf[: i + 2]
                if size == 0:
                    self._trailers = 0
                    continue
                if self.limit is not None and len(self.body) + size > self.limit:
                    raise HttpError(413, f"body over the limit of {self.limit} bytes")
                self._need = size
            if len(buf) < self._need + 2:
                if len(buf) > self._need and buf[self._need] != 13:  # b"\r"
                    raise HttpError(self.status, "chunk data not followed by CRLF")
                return
            if buf[self._need : self._need + 2] != b"\r\n":
                raise HttpError(self.status, "chunk data not followed by CRLF")
            self.body += buf[: self._need]
            del buf[: self._need + 2]
            self._need = -1


_SIZE_LINE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3


class ChunkedScanner:
    """Finds where a chunked body ends without copying it, so the gateway can relay an
    engine's chunked stream byte for byte (the framing is already right for the client).

    `scan(data)` returns the number of bytes of `data` that belong to the body (all of it
    until the terminating chunk and trailers are seen); `done` then says the body ended.
    `chunks` counts data chunks seen (one per SSE event from vLLM, for metrics). Framing
    that a client could read differently (a bad size, data not followed by CRLF, bare LF)
    raises HttpError(502): relaying it would hand the client a stream it cannot parse.
    """

    __slots__ = ("_line", "_need", "_state", "_trailers", "chunks", "done", "first_data")

    def __init__(self) -> None:
        self._state = _SIZE_LINE
        self._need = 0  # bytes of data left (state _DATA), or of its CRLF (state _DATA_END)
        self._line = bytearray()  # a size or trailer line split across reads
        self._trailers = 0
        self.done = False
        self.chunks = 0
        self.first_data = False

    def scan(self, data: bytes) -> int:
        end = len(data)
        if self._state == _SIZE_LINE and not self._line:
            # Hot path: exactly one whole data chunk (see the loop's fast path for the checks).
            nl = data.find(b"\r\n", 0, 18)
            if nl > 0:
                size_hex = data[:nl]
                try:
                    size = int(size_hex, 16)
                except ValueError:
                    size = 0
                if size and nl + 4 + size == end and data.endswith(b"\r\n") and b"%x" % size == size_hex:
                    self.chunks += 1
                    self.first_data = True
                    return end
        pos = 0
        while pos < end and not self.done:
            state = self._state
            if state == _SIZE_LINE and not self._line:
                # Fast path: a whole data chunk at pos (an engine writes one SSE event per
                # chunk; a read holds one or a few). The size must read back as written by
                # "%x": no sign, prefix, "_" or padding that int() would accept; anything
                # else takes the strict path below.
                nl = data.find(b"\r\n", pos, pos + 18)
                if nl > pos:
                    size_hex = data[pos:nl]
                    try:
                        size = int(size_hex, 16)
                    except ValueError:
                        size = 0
                    stop = nl + 4 + size
                    if size and stop <= end and data.startswith(b"\r\n", stop - 2) and b"%x" % size == size_hex:
                        self.chunks += 1
                        self.first_data = True
                        pos = stop
                        continue
            elif state == _DATA:
                take = min(self._need, end - pos)
                pos += take
                self._need -= take
                if self._need == 0:
                    self._state, self._need = _DATA_END, 2
                continue
            elif state == _DATA_END:
                expected = 13 if self._need == 2 else 10  # CR, then LF
                if data[pos] != expected:
                    raise HttpError(502, "bad chunk framing from upstream: data not followed by CRLF")
                pos += 1
                self._need -= 1
                if self._need == 0:
                    self._state = _SIZE_LINE
                continue
            # a line: size line or trailer line, ended by CRLF
            nl = data.find(b"\n", pos, end)
            if nl < 0:
                self._line += data[pos:end]
                if len(self._line) > MAX_CHUNK_LINE:
                    raise HttpError(502, "bad chunk framing from upstream: line too long")
                pos = end
                break
            self._line += data[pos:nl]
            pos = nl + 1
            line = bytes(self._line)
            self._line.clear()
            if not line.endswith(b"\r") or b"\r" in line[:-1]:
                raise HttpError(502, "bad chunk framing from upstream: bare CR or LF")
            line = line[:-1]
            if state == _TRAILER:
                if line.translate(None, _FIELD_BYTES):
                    raise HttpError(502, "bad chunk framing from upstream: control character in a trailer")
                self._trailers += len(line) + 2
                if self._trailers > MAX_HEAD:
                    raise HttpError(502, "bad chunk framing from upstream: trailers too large")
                if not line:
                    self.done = True
                continue
            size = _chunk_size(line, 502)
            if size == 0:
                self._state = _TRAILER
            else:
                self.chunks += 1
                self.first_data = True
                self._state, self._need = _DATA, size
        return pos
