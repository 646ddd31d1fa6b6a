"""What a browser cannot forge from another site (server/forgery.py, issue 40 finding 1), as values.

The attack itself, through the real port, is in tests/e2e/test_operator_auth.py; this is the rule's
table: which heads pass, which are refused, with which status and line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.server.forgery import check_write, cross_site
from llmgw.web.http1 import RequestHead

GOOD = {b"content-type": b"application/json", b"x-llmgw-request": b"1", b"host": b"10.0.0.5:8443"}


def head(headers: dict[bytes, bytes], method: bytes = b"POST") -> RequestHead:
    h = RequestHead(method, b"/api/v1/reload", False)
    h.headers = list(headers.items())
    return h


@pytest.mark.parametrize("extra", [
    {},  # ctl: no Origin, no Fetch Metadata
    {b"content-type": b"application/json; charset=utf-8"},
    {b"origin": b"https://10.0.0.5:8443"},  # the server's own page
    {b"origin": b"https://10.0.0.5:8443", b"sec-fetch-site": b"same-origin"},
    {b"sec-fetch-site": b"none"},  # typed by the user, not sent by a page
])
def test_a_genuine_change_passes(extra: dict[bytes, bytes]) -> None:
    assert check_write("POST", head({**GOOD, **extra})) is None


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
def test_reads_are_not_asked(method: str) -> None:
    assert check_write(method, head({b"content-type": b"text/plain"}, method.encode())) is None


@pytest.mark.parametrize(("extra", "status", "words"), [
    # the attack: a cross-site text/plain form, which a browser sends with Fetch Metadata
    ({b"content-type": b"text/plain", b"x-llmgw-request": b"", b"sec-fetch-site": b"cross-site",
      b"origin": b"https://evil.example"}, 403, "Sec-Fetch-Site: cross-site"),
    ({b"sec-fetch-site": b"same-site"}, 403, "Sec-Fetch-Site: same-site"),  # a sibling host is another page too
    ({b"origin": b"https://evil.example"}, 403, "Origin 'https://evil.example' is not this server"),
    ({b"origin": b"https://10.0.0.5:9999"}, 403, "is not this server"),  # another port is another origin
    ({b"origin": b"null"}, 403, "Origin 'null'"),  # a sandboxed frame or a file: page
    ({b"content-type": b"text/plain"}, 415, "the content type was 'text/plain'"),
    ({b"content-type": b"application/x-www-form-urlencoded"}, 415, "application/x-www-form-urlencoded"),
    ({b"x-llmgw-request": b""}, 403, "X-Llmgw-Request was missing"),
    ({b"content-type": b"", b"x-llmgw-request": b" "}, 403, "the content type was 'none' and X-Llmgw-Request"),
])
def test_what_a_page_could_send_is_refused(extra: dict[bytes, bytes], status: int, words: str) -> None:
    refusal = check_write("DELETE", head({**GOOD, **extra}))
    assert refusal is not None and refusal.status == status
    assert words in refusal.message and words.split(" and ")[0] in refusal.why
    assert "`Content-Type: application/json` and `X-Llmgw-Request: 1`" in refusal.message  # what to send
    assert "\n" not in refusal.message


def test_without_a_host_no_origin_is_ours() -> None:
    assert cross_site(head({b"origin": b"http://a"})) is not None


@given(st.dictionaries(st.sampled_from([b"origin", b"sec-fetch-site", b"content-type", b"x-llmgw-request", b"host"]),
                       st.binary(max_size=40)))
def test_arbitrary_heads_never_raise(headers: dict[bytes, bytes]) -> None:
    refusal = check_write("PATCH", head(headers))
    assert refusal is None or refusal.status in (403, 415)


def test_what_a_refusal_quotes_of_a_header_is_printable() -> None:
    refusal = check_write("POST", head({**GOOD, b"sec-fetch-site": b"cross\x1b]0;x\x07", b"origin": b"http://e\x1b[2J"}))
    assert refusal is not None and "\x1b" not in refusal.message and "\x07" not in refusal.why
    assert "Sec-Fetch-Site: cross?]0;x?" in refusal.why
