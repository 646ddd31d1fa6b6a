"""The client certificate a gateway worker verified, passed on to the control plane's doors.

With `gateway.workers > 1` and `public_tls`, a worker terminates the client's TLS and forwards
/api/v1, /admin and /metrics to the control plane over its Unix socket (`api.sock`), where the
viewer and operator doors (auth.py) decide. Those doors read the client certificate through
`getpeercert()`: the worker sends what its handshake verified (`getpeercert()`'s fields, as
JSON) in one header, and the control plane's handler on that socket alone turns it back into a
peer, so the same code decides on the same certificate as on a one-process server (its OU, its
CN, the deny list by serial).

The socket's mode (0600, this user only) is the worker's credential. A client cannot forge the
header: the worker drops any it sends and sets its own, and no other listener reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from llmgw.web.server import Handler, Request, Responder

PEER_HEADER = b"x-llmgw-peer-certificate"
ADDRESS_HEADER = b"x-llmgw-peer-address"  # the client's address, for the doors' refusal log lines
# The Host the client sent (the worker's request to the socket carries its own): a browser's Origin
# is compared with it (server/forgery.py), so a change from the server's own pages is told apart.
HOST_HEADER = b"x-llmgw-peer-host"
HEADERS = frozenset({PEER_HEADER, ADDRESS_HEADER, HOST_HEADER})  # set by the worker alone: dropped from a client's


class ForwardedPeer:
    """The verified client certificate's fields, as `ssl.SSLObject.getpeercert()` gave them."""

    __slots__ = ("_cert",)

    def __init__(self, cert: Mapping[str, Any]) -> None:
        self._cert = cert

    def getpeercert(self) -> Mapping[str, Any]:
        return self._cert


def peer_headers(request: Request) -> list[tuple[bytes, bytes]]:
    """The headers that carry this request's client address and verified certificate (if any)."""
    cert = request.tls.getpeercert() if request.tls is not None else None
    host = request.head.get(b"host")
    return [(ADDRESS_HEADER, request.peer.encode("latin-1", "replace"))] + (
        [(HOST_HEADER, host)] if host is not None else []) + (
        [(PEER_HEADER, msgspec.json.encode(cert))] if cert else [])


def trusting_forwarded_peers(handler: Handler) -> Handler:
    """`handler` as the api socket serves it: a request's peer is the certificate its worker verified."""

    async def handle(request: Request, responder: Responder) -> None:
        raw = request.head.get(PEER_HEADER)
        request.tls = None
        if address := request.head.get(ADDRESS_HEADER):
            request.peer = address.decode("latin-1")
        host = request.head.get(HOST_HEADER)
        request.head.headers = [(k, v) for k, v in request.head.headers if k != b"host"] + (
            [(b"host", host)] if host is not None else [])
        if raw:
            try:
                cert = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                cert = None
            if isinstance(cert, dict) and cert:
                request.tls = ForwardedPeer(cert)
        await handler(request, responder)

    return handle
