"""TLS over trio streams: handshakes that tell the peer why they failed, and fetching the
certificate a server presents so a failure can be explained."""

from __future__ import annotations

import ssl

import trio

# Bound the best-effort sends and probes here: they only serve error messages.
_ALERT_SEND_TIMEOUT = 1.0
_PROBE_TIMEOUT = 5.0


async def send_pending_alert(stream: trio.SSLStream) -> bool:
    """Send the TLS alert OpenSSL queued when the handshake failed.

    trio.SSLStream raises BrokenResourceError on a failed handshake without flushing what
    OpenSSL wrote (trio 0.35, `_retry`), so the peer sees a bare EOF instead of "certificate
    expired" or "unknown CA". Reads trio's private outgoing buffer; does nothing if absent.
    """
    outgoing = getattr(stream, "_outgoing", None)
    if not isinstance(outgoing, ssl.MemoryBIO):
        return False
    data = outgoing.read()
    if not data:
        return False
    with trio.move_on_after(_ALERT_SEND_TIMEOUT):
        try:
            await stream.transport_stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
            return False
        return True
    return False


async def handshake(stream: trio.SSLStream) -> None:
    """`stream.do_handshake()`, and on failure let the peer know why before re-raising.

    With TLS 1.3 a client learns that the server refused its certificate only on its first
    read after the handshake: treat a BrokenResourceError there like a handshake failure and
    pass it to `explain_tls_error`.
    """
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError:
        await send_pending_alert(stream)
        raise


async def fetch_server_certificate(
    host: str, port: int, *, server_hostname: str | None = None
) -> bytes | None:
    """The DER certificate `host:port` presents, without verifying it; None if it cannot be had.

    For error messages only (the SANs of a certificate that failed the name check): nothing
    read here is trusted or used to authenticate.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with trio.move_on_after(_PROBE_TIMEOUT):
        try:
            tcp = await trio.open_tcp_stream(host, port)
        except OSError:
            return None
        async with tcp:
            stream = trio.SSLStream(tcp, ctx, server_hostname=server_hostname or host)
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError:
                return None
            return stream.getpeercert(binary_form=True)
    return None
