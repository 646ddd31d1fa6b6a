"""The engine's hand-rolled HTTP/1.1, checked against h11 as the reference implementation."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.sim import http1

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
    lambda s: s.strip("-")
)
VALUE = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=0, max_size=20
)
SKIP = {"content-length", "transfer-encoding", "connection", "expect", "host"}


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
    """Parse raw fed in pieces at split_at, as the engine's connection loop does."""
    pieces = [raw[i:j] for i, j in zip([0, *split_at], [*split_at, len(raw)], strict=True)]
    buf = bytearray()
    it = iter(pieces)
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
        while len(buf) < head.content_length:
            buf += next(it)
        body = bytes(buf[: head.content_length])
        del buf[: head.content_length]
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
    headers = [(k, v.strip()) for k, v in headers if k not in SKIP]
    chunks = None
    if chunked:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=4)))
        chunks = [body[i:j] for i, j in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        chunks = [c for c in chunks if c]
    raw = _client_bytes(method, path, headers, body, chunks)
    nxt = b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n"  # a pipelined request must be left alone
    split_at = sorted(set(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=6))))
    head, got_body, rest = _read(raw + nxt, split_at)
    assert head.method == method
    assert head.target == path
    assert head.path == path.split(b"?")[0]
    assert got_body == body
    assert rest == nxt
    assert not head.close and not head.http10

    # h11 as a server agrees on everything the engine reads
    server = h11.Connection(h11.SERVER)
    server.receive_data(raw)
    req = server.next_event()
    assert isinstance(req, h11.Request)
    assert (req.method, req.target) == (head.method, head.target)


@pytest.mark.parametrize(
    ("raw", "close", "http10"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", True, False),
        (b"GET / HTTP/1.1\r\nhost: x\r\nConnection: keep-alive, Upgrade\r\n\r\n", False, False),
        (b"GET / HTTP/1.0\r\n\r\n", True, True),
        (b"GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n", False, True),
    ],
)
def test_keep_alive_follows_the_version_and_connection_header(
    raw: bytes, close: bool, http10: bool
) -> None:
    head = http1.parse_request_head(raw)
    assert (head.close, head.http10) == (close, http10)


def test_expect_100_continue_is_seen() -> None:
    head = http1.parse_request_head(
        b"POST / HTTP/1.1\r\nExpect: 100-continue\r\ncontent-length: 3\r\n\r\n"
    )
    assert head.expect_continue and head.content_length == 3


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / FTP/1.0\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nno-colon-here\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost : x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: x\r\n folded\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ncontent-length: 1x\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n", 400),
    ],
)
def test_malformed_heads_are_refused_with_a_status(raw: bytes, status: int) -> None:
    with pytest.raises(http1.HttpError) as info:
        http1.parse_request_head(raw)
    assert info.value.status == status


def test_an_endless_head_is_refused() -> None:
    with pytest.raises(http1.HttpError) as info:
        http1.find_head_end(b"GET / HTTP/1.1\r\n" + b"x: y\r\n" * 20000)
    assert info.value.status == 431


@pytest.mark.parametrize("bad", [b"zz\r\n", b"3\r\nabcXY", b"-1\r\n"])
def test_bad_chunks_are_refused(bad: bytes) -> None:
    with pytest.raises(http1.HttpError):
        http1.ChunkedDecoder().feed(bytearray(bad))


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
        status, content_type=b"application/json", content_length=len(body), date=b"d", close=close
    )
    client.receive_data(head + body)
    resp = client.next_event()
    assert isinstance(resp, h11.Response) and resp.status_code == status
    got = b""
    while isinstance(ev := client.next_event(), h11.Data):
        got += ev.data
    assert isinstance(ev, h11.EndOfMessage) and got == body
    assert (client.their_state is h11.MUST_CLOSE) == close

    # a streamed (chunked) response, as the SSE path writes it
    client = h11.Connection(h11.CLIENT)
    client.send(
        h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")])
    )
    client.send(h11.EndOfMessage())
    stream = http1.response_head(
        200, content_type=b"text/event-stream", content_length=None, date=b"d"
    )
    stream += b"".join(http1.chunk(p) for p in pieces) + http1.LAST_CHUNK
    client.receive_data(stream)
    assert isinstance(client.next_event(), h11.Response)
    got = b""
    while isinstance(ev := client.next_event(), h11.Data):
        got += ev.data
    assert isinstance(ev, h11.EndOfMessage) and got == b"".join(pieces)
    assert client.their_state is h11.DONE
