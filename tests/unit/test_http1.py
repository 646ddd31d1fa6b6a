"""llmgw.web.http1, the hand-rolled HTTP/1.1 framing, checked against h11 as the reference.

Used by the public port (requests), the upstream pool (responses, chunked relay) and the
simulated engine; the process-level behaviour is in tests/unit/test_web_*.py and tests/e2e.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.web import http1

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCXYZ-", min_size=1, max_size=12).filter(
    lambda s: s.strip("-")
)
VALUE = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=0, max_size=20
)
SKIP = {"content-length", "transfer-encoding", "connection", "expect", "host"}


def _split(raw: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted({c for c in cuts if 0 < c < len(raw)})
    return [raw[i:j] for i, j in zip([0, *cuts], [*cuts, len(raw)], strict=True)]


# ---- requests -------------------------------------------------------------------------------


def _client_bytes(
    method: bytes,
    target: bytes,
    headers: list[tuple[str, str]],
    body: bytes | None,
    chunks: list[bytes] | None,
) -> bytes:
    """What a real client (h11) writes for this request."""
    conn = h11.Connection(h11.CLIENT)
    hdrs = [("host", "x"), *headers]
    if chunks is not None:
        hdrs.append(("transfer-encoding", "chunked"))
    elif body is not None:
        hdrs.append(("content-length", str(len(body))))
    out = conn.send(h11.Request(method=method, target=target, headers=hdrs))
    for piece in chunks or ([body] if body else []):
        out += conn.send(h11.Data(data=piece))
    out += conn.send(h11.EndOfMessage())
    return out


def _read(raw: bytes, split_at: list[int]) -> tuple[http1.RequestHead, bytes, bytes]:
    """Parse raw fed in pieces at split_at, as a server's connection loop does."""
    it = iter(_split(raw, split_at))
    buf = bytearray()
    while (end := http1.find_head_end(buf)) < 0:
        buf += next(it)
    head = http1.parse_request_head(bytes(buf[:end]))
    del buf[:end]
    if head.chunked:
        dec = http1.ChunkedDecoder()
        dec.feed(buf)
        while not dec.done:
            buf += next(it)
            dec.feed(buf)
        body = bytes(dec.body)
    else:
        n = head.content_length or 0
        while len(buf) < n:
            buf += next(it)
        body = bytes(buf[:n])
        del buf[:n]
    return head, body, bytes(buf) + b"".join(it)


@given(
    method=st.sampled_from([b"GET", b"POST", b"PUT"]),
    path=st.from_regex(rb"\A/[a-z0-9/_.-]{0,20}(\?[a-z=&0-9]{0,10})?\Z"),
    headers=st.lists(st.tuples(TOKEN, VALUE), max_size=5),
    body=st.binary(max_size=300),
    chunked=st.booleans(),
    data=st.data(),
)
def test_requests_a_real_client_writes_parse_the_same(
    method: bytes,
    path: bytes,
    headers: list[tuple[str, str]],
    body: bytes,
    chunked: bool,
    data: st.DataObject,
) -> None:
    headers = [(k, v.strip(" ")) for k, v in headers if k.lower() not in SKIP]
    chunks = None
    if chunked:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=4)))
        chunks = [c for c in _split(body, cuts) if c]
    raw = _client_bytes(method, path, headers, body, chunks)
    nxt = b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n"  # a pipelined request must be left alone
    split_at = data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=6))
    head, got_body, rest = _read(raw + nxt, split_at)
    assert head.method == method
    assert head.target == path
    assert head.path == path.split(b"?")[0]
    assert head.query == (path.split(b"?", 1)[1] if b"?" in path else b"")
    assert got_body == body
    assert rest == nxt
    assert not head.close and not head.http10
    assert head.chunked == chunked

    # h11 as a server agrees on the request line and on every header (names lower-cased,
    # values stripped), in order
    server = h11.Connection(h11.SERVER)
    server.receive_data(raw)
    req = server.next_event()
    assert isinstance(req, h11.Request)
    assert (req.method, req.target) == (head.method, head.target)
    assert list(req.headers) == head.headers
    assert head.get(b"host") == b"x"


HEADER_BYTES = st.binary(max_size=40).map(lambda b: b) | st.text(
    alphabet="aZ-:; \t\r\n\x00\x01\x7f\x80\xff(@", max_size=30
).map(lambda s: s.encode("latin-1"))


@given(block=st.lists(HEADER_BYTES, min_size=1, max_size=4))
def test_whatever_is_accepted_h11_accepts_and_reads_the_same(block: list[bytes]) -> None:
    """Never more lenient than the reference: a head this parser takes, h11 takes too,
    with the same headers (leniency is how two parsers come to disagree on a message)."""
    raw = b"GET / HTTP/1.1\r\nhost: x\r\n" + b"\r\n".join(block) + b"\r\n\r\n"
    if http1.find_head_end(raw) != len(raw):
        return  # a blank line inside: the head ends earlier, not what this test is about
    try:
        head = http1.parse_request_head(raw)
    except http1.HttpError:
        return
    server = h11.Connection(h11.SERVER)
    server.receive_data(raw)
    req = server.next_event()
    assert isinstance(req, h11.Request), req
    assert list(req.headers) == head.headers


@pytest.mark.parametrize(
    ("raw", "close", "http10"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", True, False),
        (b"GET / HTTP/1.1\r\nhost: x\r\nConnection: keep-alive, Upgrade\r\n\r\n", False, False),
        (b"GET / HTTP/1.0\r\n\r\n", True, True),
        (b"GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n", False, True),
        (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", False, False),
    ],
)
def test_keep_alive_follows_the_version_and_connection_header(
    raw: bytes, close: bool, http10: bool
) -> None:
    head = http1.parse_request_head(raw)
    assert (head.close, head.http10) == (close, http10)


def test_expect_100_continue_is_seen_on_http11_only() -> None:
    head = http1.parse_request_head(
        b"POST / HTTP/1.1\r\nhost: x\r\nExpect: 100-continue\r\ncontent-length: 3\r\n\r\n"
    )
    assert head.expect_continue and head.content_length == 3
    head = http1.parse_request_head(
        b"POST / HTTP/1.0\r\nExpect: 100-continue\r\ncontent-length: 3\r\n\r\n"
    )
    assert not head.expect_continue


def test_header_values_keep_their_case_and_names_are_lower_cased() -> None:
    head = http1.parse_request_head(
        b"GET / HTTP/1.1\r\nAuthorization:  Bearer AbC \t\r\nX-Empty:\r\nhost: x\r\n\r\n"
    )
    assert head.headers == [(b"authorization", b"Bearer AbC"), (b"x-empty", b""), (b"host", b"x")]
    assert head.get(b"authorization") == b"Bearer AbC"
    assert head.get(b"missing") is None
    assert head.content_length is None and not head.chunked


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTP/1.2\r\n\r\n", 505),
        (b"GET / FTP/1.0\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\n\r\n", 400),
        (b"GET  / HTTP/1.1\r\n\r\n", 400),
        (b"GET /\x7f HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nno-colon-here\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n: no name\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost : x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: x\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nx-a: 1\nx-b: 2\r\n\r\n", 400),  # bare LF
        (b"GET / HTTP/1.1\r\nx-a: 1\rx-b: 2\r\n\r\n", 400),  # bare CR
        (b"GET / HTTP/1.1\r\nx-a: a\x00b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nx-a: a\x1bb\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nx-\x80: a\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ncontent-length: 1x\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ncontent-length: -1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ncontent-length: " + b"9" * 5000 + b"\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: x\r\n", 400),  # not a whole head
    ],
)
def test_malformed_heads_are_refused_with_a_status(raw: bytes, status: int) -> None:
    if b"\r\nhost:" not in raw.lower():  # each case refused for its own fault, not for a missing Host
        raw = raw.replace(b"\r\n", b"\r\nhost: x\r\n", 1)
    with pytest.raises(http1.HttpError) as info:
        http1.parse_request_head(raw)
    assert info.value.status == status
    assert "Host header" not in str(info.value)


def test_same_content_length_twice_is_one_length() -> None:
    head = http1.parse_request_head(
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nContent-Length: 2\r\n\r\n"
    )
    assert head.content_length == 2


def test_an_endless_head_or_too_many_fields_are_refused() -> None:
    with pytest.raises(http1.HttpError) as info:
        http1.find_head_end(b"GET / HTTP/1.1\r\n" + b"x: y\r\n" * 20000)
    assert info.value.status == 431
    with pytest.raises(http1.HttpError) as info:
        http1.find_head_end(b"GET / HTTP/1.1\r\n" + b"x: y\r\n" * 20000 + b"\r\n")
    assert info.value.status == 431
    many = b"GET / HTTP/1.1\r\n" + b"x: y\r\n" * (http1.MAX_HEADERS + 1) + b"\r\n"
    with pytest.raises(http1.HttpError) as info:
        http1.parse_request_head(many)
    assert info.value.status == 431
    assert http1.find_head_end(b"GET / HTTP/1.1\r\nx: y\r\n") == -1


# ---- chunked request bodies ------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        b"zz\r\n",
        b"3\r\nabcXY",
        b"3\r\nab",  # the data so far is fine: not an error yet (see below)
        b"-1\r\n",
        b"+3\r\nabc\r\n",
        b"0x3\r\nabc\r\n",
        b"1_0\r\n",
        b" 3\r\nabc\r\n",
        b"3" * 5000,
        b"0\r\nx: \x00\r\n\r\n",
    ],
)
def test_bad_chunks_are_refused(bad: bytes) -> None:
    dec = http1.ChunkedDecoder()
    if bad == b"3\r\nab":
        dec.feed(bytearray(bad))
        assert not dec.done
        with pytest.raises(http1.HttpError):
            dec.feed(bytearray(b"3\r\nabcd"))
        return
    with pytest.raises(http1.HttpError) as info:
        dec.feed(bytearray(bad))
    assert info.value.status == 400


def test_chunk_extensions_and_trailers_are_read_and_skipped() -> None:
    buf = bytearray(b"3;name=value\r\nabc\r\nA \r\n0123456789\r\n0\r\nx-trailer: 1\r\n\r\nNEXT")
    dec = http1.ChunkedDecoder()
    dec.feed(buf)
    assert dec.done and dec.body == b"abc0123456789" and buf == b"NEXT"


def test_a_chunked_body_over_the_limit_is_413_before_its_data_arrives() -> None:
    dec = http1.ChunkedDecoder(limit=10)
    buf = bytearray(b"6\r\nabcdef\r\n")
    dec.feed(buf)
    assert dec.body == b"abcdef"
    with pytest.raises(http1.HttpError) as info:
        dec.feed(bytearray(b"5\r\n"))  # 11 bytes in all: refused on the size line alone
    assert info.value.status == 413
    dec = http1.ChunkedDecoder(limit=10)
    buf = bytearray(b"a\r\n0123456789\r\n0\r\n\r\n")
    dec.feed(buf)
    assert dec.done and len(dec.body) == 10  # exactly the limit is allowed


def test_a_decoder_for_upstream_bodies_says_502() -> None:
    with pytest.raises(http1.HttpError) as info:
        http1.ChunkedDecoder(status=502).feed(bytearray(b"zz\r\n"))
    assert info.value.status == 502


# ---- responses ------------------------------------------------------------------------------


def _h11_response(
    status: int,
    headers: list[tuple[str, str]],
    pieces: list[bytes],
    *,
    framing: str,
    trailers: list[tuple[str, str]] | None = None,
) -> bytes:
    """What a real server (h11) writes: framing is length, chunked or close (HTTP/1.0 peer)."""
    server = h11.Connection(h11.SERVER)
    version = "1.0" if framing == "close" else "1.1"
    req = f"GET / HTTP/{version}\r\nhost: x\r\n\r\n".encode()
    server.receive_data(req)
    assert isinstance(server.next_event(), h11.Request)
    server.next_event()
    hdrs = list(headers)
    if framing == "length":
        hdrs.append(("content-length", str(sum(map(len, pieces)))))
    elif framing == "chunked":
        hdrs.append(("transfer-encoding", "chunked"))
    out = server.send(h11.Response(status_code=status, headers=hdrs))
    for p in pieces:
        out += server.send(h11.Data(data=p))
    out += server.send(h11.EndOfMessage(headers=trailers or []))
    return out


@given(
    status=st.sampled_from([200, 201, 400, 404, 429, 500, 503]),
    headers=st.lists(st.tuples(TOKEN, VALUE), max_size=4),
    pieces=st.lists(st.binary(max_size=40), max_size=5),
    framing=st.sampled_from(["length", "chunked", "close"]),
    split=st.lists(st.integers(1, 400), max_size=5),
)
def test_responses_a_real_server_writes_parse_the_same(
    status: int,
    headers: list[tuple[str, str]],
    pieces: list[bytes],
    framing: str,
    split: list[int],
) -> None:
    headers = [(k, v.strip(" ")) for k, v in headers if k.lower() not in SKIP | {"date", "server"}]
    raw = _h11_response(status, headers, pieces, framing=framing)
    end = http1.find_head_end(raw)
    head = http1.parse_response_head(raw[:end])
    assert head.status == status and head.has_body
    for name, value in headers:
        assert (name.lower().encode(), value.encode()) in head.headers
    body = raw[end:]
    if framing == "length":
        assert head.content_length == len(body) and not head.chunked and not head.close
        assert body == b"".join(pieces)
    elif framing == "chunked":
        assert head.chunked and head.content_length is None and not head.close
        buf = bytearray()
        dec = http1.ChunkedDecoder(status=502)
        for piece in _split(body + b"HTTP/1.1 200 OK", split):
            buf += piece
            dec.feed(buf)
        assert dec.done and bytes(dec.body) == b"".join(pieces)
        assert bytes(buf) == b"HTTP/1.1 200 OK"
    else:
        assert head.close and not head.chunked and head.content_length is None
        assert body == b"".join(pieces)


def test_http10_status_lines_and_no_body_statuses() -> None:
    head = http1.parse_response_head(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert head.http10 and head.close and head.content_length == 2
    head = http1.parse_response_head(
        b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\n"
    )
    assert not head.close
    for status in (100, 204, 304):
        assert not http1.parse_response_head(b"HTTP/1.1 %d X\r\n\r\n" % status).has_body
    head = http1.parse_response_head(b"HTTP/1.1 200\r\n\r\n")  # the reason phrase is optional
    assert head.status == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/2 200 OK\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 200 O\x00K\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\nb\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n",
    ],
)
def test_malformed_response_heads_are_502(raw: bytes) -> None:
    with pytest.raises(http1.HttpError) as info:
        http1.parse_response_head(raw)
    assert info.value.status == 502


@given(
    status=st.sampled_from([200, 400, 404, 500, 503]),
    body=st.binary(max_size=200),
    close=st.booleans(),
    pieces=st.lists(st.binary(min_size=0, max_size=50), max_size=5),
)
def test_responses_written_here_parse_in_h11(
    status: int, body: bytes, close: bool, pieces: list[bytes]
) -> None:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    head = http1.response_head(
        status, [(b"content-type", b"application/json")], content_length=len(body), close=close
    )
    client.receive_data(head + body)
    resp = client.next_event()
    assert isinstance(resp, h11.Response) and resp.status_code == status
    assert (b"content-type", b"application/json") in list(resp.headers)
    got = b""
    while isinstance(ev := client.next_event(), h11.Data):
        got += ev.data
    assert isinstance(ev, h11.EndOfMessage) and got == body
    assert (client.their_state is h11.MUST_CLOSE) == close

    # a streamed (chunked) response, as the SSE path writes it; empty pieces write nothing
    client = h11.Connection(h11.CLIENT)
    client.send(
        h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")])
    )
    client.send(h11.EndOfMessage())
    stream = http1.response_head(200, [(b"content-type", b"text/event-stream")], chunked=True)
    stream += b"".join(http1.chunk(p) for p in pieces) + http1.LAST_CHUNK
    client.receive_data(stream)
    assert isinstance(client.next_event(), h11.Response)
    got = b""
    while isinstance(ev := client.next_event(), h11.Data):
        got += ev.data
    assert isinstance(ev, h11.EndOfMessage) and got == b"".join(pieces)
    assert client.their_state is h11.DONE


@given(
    headers=st.lists(st.tuples(TOKEN, VALUE), max_size=4),
    body=st.binary(max_size=100),
)
def test_requests_written_here_parse_in_h11(headers: list[tuple[str, str]], body: bytes) -> None:
    hdrs = [(k.lower().encode(), v.strip(" ").encode()) for k, v in headers if k.lower() not in SKIP]
    raw = http1.request_head(b"POST", b"/v1/x?y=1", [(b"host", b"e:1"), *hdrs], len(body)) + body
    server = h11.Connection(h11.SERVER)
    server.receive_data(raw)
    req = server.next_event()
    assert isinstance(req, h11.Request)
    assert (req.method, req.target) == (b"POST", b"/v1/x?y=1")
    assert list(req.headers)[: len(hdrs) + 1] == [(b"host", b"e:1"), *hdrs]
    data = server.next_event()
    got = data.data if isinstance(data, h11.Data) else b""
    assert got == body


def test_an_empty_chunk_is_never_written() -> None:
    assert http1.chunk(b"") == b""
    assert http1.chunk(b"hello") == b"5\r\nhello\r\n"


# ---- ChunkedScanner: where a relayed chunked body ends ---------------------------------------


def _h11_chunked_body(pieces: list[bytes], trailers: list[tuple[str, str]]) -> bytes:
    raw = _h11_response(200, [], pieces, framing="chunked", trailers=trailers)
    return raw[http1.find_head_end(raw) :]


TRAILERS = st.lists(st.tuples(TOKEN.filter(lambda t: t.lower() not in SKIP), VALUE.map(str.strip)), max_size=2)


@given(
    pieces=st.lists(st.binary(min_size=0, max_size=300), max_size=8),
    trailers=TRAILERS,
    cuts=st.lists(st.integers(0, 3000), max_size=12),
    after=st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n\r\n", b"5\r\nextra\r\n"]),
)
def test_any_chunked_body_h11_writes_split_anywhere_scans_to_exactly_its_end(
    pieces: list[bytes], trailers: list[tuple[str, str]], cuts: list[int], after: bytes
) -> None:
    body = _h11_chunked_body(pieces, trailers)
    scanner = http1.ChunkedScanner()
    taken = b""
    rest = b""
    for part in _split(body + after, cuts):
        if scanner.done:
            rest += part
            continue
        used = scanner.scan(part)
        assert 0 <= used <= len(part)
        assert used == len(part) or scanner.done  # only the end of the body stops a scan short
        taken += part[:used]
        rest += part[used:]
    assert scanner.done
    assert taken == body and rest == after
    assert scanner.chunks == sum(1 for p in pieces if p)
    assert scanner.first_data == any(pieces)


@given(
    pieces=st.lists(st.binary(min_size=1, max_size=50), min_size=1, max_size=5),
    size_text=st.sampled_from(["{:X}", "0{:x}", "{:x} ", "{:x};ext=1", "{:x} ;ext"]),
)
def test_valid_but_unusual_size_lines_take_the_strict_path(pieces: list[bytes], size_text: str) -> None:
    body = b"".join(
        size_text.format(len(p)).encode() + b"\r\n" + p + b"\r\n" for p in pieces
    ) + b"0\r\n\r\n"
    scanner = http1.ChunkedScanner()
    for p in pieces:  # one chunk per read, as an engine writes them
        frame = size_text.format(len(p)).encode() + b"\r\n" + p + b"\r\n"
        assert scanner.scan(frame) == len(frame)
    assert scanner.scan(b"0\r\n\r\n") == 5 and scanner.done
    whole = http1.ChunkedScanner()
    assert whole.scan(body) == len(body) and whole.done and whole.chunks == len(pieces)


@pytest.mark.parametrize(
    "bad",
    [
        b"zz\r\n",
        b"+5\r\nhello\r\n",
        b"0x5\r\nhello\r\n",
        b"5_\r\nhello\r\n",
        b"1_0\r\n0123456789abcdef\r\n",
        b" 5\r\nhello\r\n",
        b"-5\r\nhello\r\n",
        b"5\nhello\r\n",  # bare LF after the size
        b"5\r\nhelloXY",  # data not followed by CRLF
        b"5\r\nhello\rX",
        b"5\r\nhello\n\r",
        b"5\r\nhello\r\n0\r\nx: y\n\r\n",  # bare LF in the trailers
        b"5\r\nhello\r\n0\r\n\n",
        b"f" * 5000,  # an endless size line
    ],
)
def test_the_scanner_rejects_bad_framing(bad: bytes) -> None:
    # whole, and a byte at a time (the state carried between reads must catch it too)
    with pytest.raises(http1.HttpError) as info:
        http1.ChunkedScanner().scan(bad)
    assert info.value.status == 502
    scanner = http1.ChunkedScanner()
    with pytest.raises(http1.HttpError):
        for i in range(len(bad)):
            scanner.scan(bad[i : i + 1])


def test_the_scanner_counts_chunks_and_sees_the_first_data() -> None:
    scanner = http1.ChunkedScanner()
    assert scanner.scan(b"5\r\nhello\r\n") == 10
    assert scanner.chunks == 1 and scanner.first_data and not scanner.done
    two = b"1\r\na\r\n2\r\nbc\r\n"
    assert scanner.scan(two) == len(two) and scanner.chunks == 3
    assert scanner.scan(b"0\r\n\r\nleftover") == 5
    assert scanner.done
    assert scanner.scan(b"more") == 0  # nothing after the end belongs to the body


def test_the_scanner_rejects_control_characters_in_trailers() -> None:
    with pytest.raises(http1.HttpError):
        http1.ChunkedScanner().scan(b"0\r\nx: a\x00b\r\n\r\n")


def test_head_scanner_resumes_a_head_fed_a_byte_at_a_time() -> None:
    """Issue 9 item 8: a 64 KiB head arriving a byte per read is scanned once, not once per
    read (the old rescan-from-0 examined ~2 billion bytes for it). Counts work, not time."""
    head = b"GET / HTTP/1.1\r\n" + b"x-pad: " + b"a" * (http1.MAX_HEAD - 32) + b"\r\n\r\n"
    assert http1.MAX_HEAD - 64 < len(head) <= http1.MAX_HEAD
    scanner = http1.HeadScanner()
    buf = bytearray()
    for i in range(len(head) - 1):
        buf.append(head[i])
        assert scanner.find(buf) == -1
    buf.append(head[-1])
    assert scanner.find(buf) == len(head)
    # One pass plus the 3-byte overlap per read: linear in what the client sent.
    assert scanner.scanned <= 4 * len(head), scanner.scanned
    # The blank line straddling two reads is still found, and the scanner starts over after.
    scanner = http1.HeadScanner()
    buf = bytearray(b"GET / HTTP/1.1\r\nhost: x\r\n\r")
    assert scanner.find(buf) == -1
    buf += b"\nGET /next HTTP/1.1\r\n"
    assert scanner.find(buf) == len(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    del buf[: len(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")]
    assert scanner.find(buf) == -1 and scanner.pos == len(buf)


def test_find_head_end_resume_agrees_with_a_full_scan() -> None:
    raw = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nrest"
    for cut in range(len(raw) + 1):
        first = http1.find_head_end(raw[:cut])
        if first >= 0:
            assert first == raw.index(b"\r\n\r\n") + 4
            continue
        assert http1.find_head_end(raw, cut) == raw.index(b"\r\n\r\n") + 4


def test_header_lines_seen_before_parse_as_they_did_and_the_memo_stays_bounded() -> None:
    """http1._SEEN keeps lines that parsed (a client's and an engine's repeat on every message):
    the second parse of a head gives what the first gave, a line with a control character is
    refused whatever was kept, credentials are not kept, and the memo never outgrows its bound."""
    heads = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw:8080\r\nUser-Agent: OpenAI/Python 1.54.0\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer sk-secret\r\nX-Api-Key: sk-secret-2\r\n"
        b"Api-Key: sk-secret-3\r\nX-Stainless-Lang: python\r\nContent-Length: 12\r\n\r\n",
        b"GET / HTTP/1.0\r\nConnection: keep-alive\r\nX-Pad:   spaced \t\r\n\r\n",
    ]
    for raw in heads:
        first, again = http1.parse_request_head(raw), http1.parse_request_head(raw)
        assert (again.headers, again.content_length, again.close, again.chunked) == \
               (first.headers, first.content_length, first.close, first.chunked)
    assert not any(b"sk-secret" in line for line in http1._SEEN)  # no credential header, whatever its name
    assert b"X-Stainless-Lang: python" in http1._SEEN and b"Host: gw:8080" in http1._SEEN
    with pytest.raises(http1.HttpError):
        http1.parse_request_head(b"GET / HTTP/1.1\r\nHost: gw:8080\r\nX-Bad: a\x01b\r\n\r\n")
    for i in range(http1._SEEN_MAX + 10):
        http1.parse_request_head(b"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: client/%d\r\n\r\n" % i)
    assert len(http1._SEEN) <= http1._SEEN_MAX


@pytest.mark.parametrize("head", [
    b"GET / HTTP/1.1\nhost: x\n\n",  # every line ended by LF alone
    b"GET / HTTP/1.1\r\nhost: x\n\r\n",  # the last field's line by LF, then the blank line
])
def test_a_head_of_bare_lf_lines_is_a_400_at_once_not_a_wait(head: bytes) -> None:
    with pytest.raises(http1.HttpError) as info:
        http1.find_head_end(head)
    assert info.value.status == 400 and "CRLF" in str(info.value)
    scanner = http1.HeadScanner()  # the same when the blank line comes in a later read
    assert scanner.find(head[:-1]) == -1
    with pytest.raises(http1.HttpError):
        scanner.find(head)


def test_a_head_still_arriving_is_not_mistaken_for_bare_lf() -> None:
    head = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    scanner = http1.HeadScanner()
    for cut in range(1, len(head)):
        assert scanner.find(head[:cut]) == -1, cut
    assert scanner.find(head) == len(head)


@pytest.mark.parametrize(("raw", "error"), [
    (b"GET / HTTP/1.1\r\n\r\n", "missing Host header"),
    (b"GET / HTTP/1.1\r\nuser-agent: x\r\n\r\n", "missing Host header"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n", "more than one Host header"),
    (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", "more than one Host header"),
])
def test_a_request_has_one_host_line(raw: bytes, error: str) -> None:
    """RFC 9112 §3.2: 400 for an HTTP/1.1 request without Host and for any with two; HTTP/1.0
    may leave it out. Memoized Host lines are counted as well (the second parse is the memo's)."""
    for _ in range(2):
        with pytest.raises(http1.HttpError) as info:
            http1.parse_request_head(raw)
        assert (info.value.status, str(info.value)) == (400, error)
    assert http1.parse_request_head(b"GET / HTTP/1.0\r\n\r\n").method == b"GET"
    assert http1.parse_request_head(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").get(b"host") == b"a"
