"""Lingering closes: an answer the client can read before the connection goes."""

from __future__ import annotations

import trio

LINGER_SECONDS = 2.0
LINGER_BYTES = 4 * 1024 * 1024


async def answer_plain_on_tls(tcp: trio.SocketStream, data: bytes) -> None:
    """A plain-HTTP request on a TLS port is answered in plain text, as nginx does ("400 The
    plain HTTP request was sent to HTTPS port"): the client reads why and what to do, not
    "empty reply from server". The mirror of the ClientHello check in llmgw.web.server. Its write
    side is shut first and what else it sent is read and dropped briefly: closing with the
    request unread would reset the connection before the client reads the answer."""
    with trio.move_on_after(LINGER_SECONDS):
        try:
            await tcp.send_all(data)
            await tcp.send_eof()
            dropped = 0
            while dropped < LINGER_BYTES and (data := await tcp.receive_some(65536)):
                dropped += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
