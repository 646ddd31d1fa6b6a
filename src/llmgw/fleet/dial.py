"""The agent's side of the fleet stream: dial out, open one Connect stream, keep it."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import trio

from llmgw.errors import UsageError
from llmgw.fleet.h2conn import ChannelClosed, FleetChannel, H2Connection
from llmgw.tls import explain_tls_error
from llmgw.tls.net import fetch_server_certificate
from llmgw.wire.messages import CONNECT_PATH, CONTENT_TYPE


class DialError(Exception):
    """The server could not be reached or refused the stream; the message says why."""


def parse_fleet_url(url: str, insecure: bool) -> tuple[str, str, int]:
    """`https://host:port` → (scheme, host, port); plain `http://` only with --insecure."""
    parts = urlsplit(url if "://" in url else f"https://{url}")
    if parts.scheme not in ("https", "http"):
        raise UsageError(f"fleet server URL {url!r}: scheme must be https (or http with --insecure)")
    if parts.scheme == "http" and not insecure:
        raise UsageError(f"fleet server URL {url!r} is plain h2c; pass --insecure to allow it, or use https")
    if not parts.hostname:
        raise UsageError(f"fleet server URL {url!r} has no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UsageError(f"fleet server URL {url!r} has a bad port") from None
    return parts.scheme, parts.hostname, port


async def _explain(exc: BaseException, host: str, port: int) -> str:
    """One line on why TLS failed; fetches the server's certificate to name its SANs."""
    peer_cert = await fetch_server_certificate(host, port)
    return explain_tls_error(exc, host, peer_cert=peer_cert)


@asynccontextmanager
async def dial(
    url: str,
    *,
    ssl_context: ssl.SSLContext | None,
    insecure: bool = False,
    max_message: int,
    headers: list[tuple[str, str]] | None = None,
    connect_timeout: float = 10.0,
    idle_timeout: float | None = None,
    path: str = CONNECT_PATH,
    unix_path: str = "",
) -> AsyncIterator[FleetChannel]:
    """One Connect stream to `url` (or, with `unix_path`, h2c over that local Unix socket: a
    gateway worker's way to its control plane, guarded by the socket file's permissions)."""
    scheme, host, port = ("http", "localhost", 0) if unix_path else parse_fleet_url(url, insecure)
    try:
        with trio.fail_after(connect_timeout):
            tcp: trio.SocketStream = (await trio.open_unix_socket(unix_path) if unix_path
                                      else await trio.open_tcp_stream(host, port))
    except trio.TooSlowError:
        raise DialError(f"cannot connect to {host}:{port}: timed out after {connect_timeout:g}s") from None
    except OSError as exc:
        where = unix_path or f"{host}:{port}"
        raise DialError(f"cannot connect to {where}: {exc.strerror or exc}") from None
    stream: trio.abc.Stream = tcp
    try:
        if scheme == "https":
            if ssl_context is None:
                ssl_context = ssl.create_default_context()
                ssl_context.set_alpn_protocols(["h2"])
            ssl_stream = trio.SSLStream(tcp, ssl_context, server_hostname=host)
            try:
                with trio.fail_after(connect_timeout):
                    await ssl_stream.do_handshake()
            except trio.TooSlowError:
                raise DialError(f"TLS handshake with {host}:{port} timed out") from None
            except (trio.BrokenResourceError, ssl.SSLError) as exc:
                raise DialError(f"TLS with {host}:{port} failed: {await _explain(exc, host, port)}") from None
            stream = ssl_stream
        conn = H2Connection(
            stream, client_side=True, max_message=max_message, peer=f"{host}:{port}", idle_timeout=idle_timeout
        )
        conn.start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.reader)
            nursery.start_soon(conn.writer)
            authority = f"{host}:{port}"
            try:
                with trio.fail_after(connect_timeout):
                    channel = await conn.open(
                        authority,
                        path,
                        [("content-type", CONTENT_TYPE), ("connect-protocol-version", "1"), *(headers or [])],
                        scheme,
                    )
            except trio.TooSlowError:
                raise DialError(f"{host}:{port} did not answer the Connect request in time") from None
            except ChannelClosed as exc:
                if scheme == "https" and conn.closed_exc is not None:
                    # TLS 1.3: a server that refuses our certificate says so on our first read.
                    why = explain_tls_error(conn.closed_exc, host)
                    raise DialError(f"TLS with {host}:{port} failed: {why}") from None
                raise DialError(f"{host}:{port} closed the connection: {exc.reason}") from None
            status = conn.response_headers.get(":status", "")
            if status != "200":
                raise DialError(
                    f"{host}:{port} answered HTTP {status} to the Connect request; is this an llmgw fleet port?")
            try:
                yield channel
            finally:
                with trio.CancelScope(shield=True):
                    if conn.closed_reason is None:
                        await conn.end_channel(channel)
                        await conn.goaway()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await stream.aclose()
