"""What a browser cannot forge from another site, required of every change to the fleet (issue 40).

A browser sends an installed client certificate to any site that asks for one, as it sends a
cookie, and the admin pages invite operator certificates into browsers: a page on another site
could submit a form to `/api/v1/nodes/NODE/drain` and the request would arrive with the
operator's certificate. What such a page can send without the server's consent (a CORS
preflight, which llmgw never grants) is a "simple" request: GET, HEAD or POST with a form or
`text/plain` body and no header of its own. So every mutating API call (POST, PUT, PATCH,
DELETE), whatever its credential, must carry

    Content-Type: application/json     a form cannot send it cross-site
    X-Llmgw-Request: 1                 nor any custom header (Django's and Rails' X-CSRF idea,
                                       without a token: the header's presence is the proof)

and must not say it comes from elsewhere: `Sec-Fetch-Site` other than `same-origin` or `none`
(a user typing a URL), or, from a browser without Fetch Metadata, an `Origin` that is not the
host the request was sent to. This is Go 1.25's `http.CrossOriginProtection` check for the
second part. `llmgw ctl` sends both headers and no Origin; the admin pages change nothing
through the API (their login form posts to /admin/login, which `cross_site` alone guards).

Pure: a request head in, a refusal (status and one line) or None out.
"""

from __future__ import annotations

import msgspec

from llmgw.web.http1 import Framing

REQUEST_HEADER = b"x-llmgw-request"
# What a client of the API sends on every change (llmgw.api_client does).
WRITE_HEADERS = {"content-type": "application/json", "x-llmgw-request": "1"}
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SEND = "send `Content-Type: application/json` and `X-Llmgw-Request: 1` (as `llmgw ctl` does)"


class Refusal(msgspec.Struct, frozen=True):
    status: int  # 403: forged or foreign; 415: the content type alone is wrong
    message: str  # the one line the caller reads
    why: str  # for the server's log line: what gave it away


def cross_site(head: Framing) -> str | None:
    """What says this request comes from another site's page, or None when nothing does."""
    fetch_site = head.get(b"sec-fetch-site")
    if fetch_site is not None:
        site = fetch_site.strip().lower()
        if site in (b"same-origin", b"none"):
            return None
        origin = head.get(b"origin")
        sent = f", from {_text(origin.strip(), 100)!r}" if origin else ""
        return f"Sec-Fetch-Site: {_text(site, 40)}{sent}"
    origin = head.get(b"origin")
    if origin is None:
        return None  # not a browser (curl, ctl), or one older than Origin on POST
    host = (head.get(b"host") or b"").strip().lower()
    text = _text(origin.strip(), 200)
    # An Origin is `scheme://host[:port]` (RFC 6454 §6.1), or `null` from a sandboxed or file: page.
    netloc = text.partition("://")[2].partition("/")[0].lower().encode("latin-1")
    if netloc and netloc == host:
        return None
    return f"Origin {text[:100]!r} is not this server ({_text(host, 100)!r})"


def check_write(method: str, head: Framing) -> Refusal | None:
    """A refusal for a mutating API call a browser could have been made to send, or None."""
    if method in SAFE_METHODS:
        return None
    foreign = cross_site(head)
    if foreign is not None:
        return Refusal(403, f"a change to the fleet from another site's page is refused ({foreign}): call the API "
                            f"directly and {SEND}", foreign)
    missing = []
    content_type = (head.get(b"content-type") or b"").split(b";")[0].strip().lower()
    if content_type != b"application/json":
        shown = _text(content_type, 60) or "none"
        missing.append(f"the content type was {shown!r}")
    if not (head.get(REQUEST_HEADER) or b"").strip():
        missing.append("X-Llmgw-Request was missing")
    if not missing:
        return None
    status = 415 if len(missing) == 1 and content_type != b"application/json" else 403
    return Refusal(status, f"a change to the fleet must show it is no forged browser request: {SEND}; "
                           f"{' and '.join(missing)}", "; ".join(missing))


def _text(value: bytes, limit: int) -> str:
    """A header's value as a log line or a refusal may quote it: printable ASCII, at most `limit`."""
    return "".join(c if " " <= c <= "~" else "?" for c in value[:limit].decode("latin-1"))
