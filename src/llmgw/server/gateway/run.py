"""The `llmgw gateway` main: bind, follow the control plane, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import functools
import logging
import signal
import socket

import trio

from llmgw.errors import UsageError
from llmgw.server.gateway.worker import Follow, GatewayWorker, reuseport_socket
from llmgw.tls.context import ServerTls

log = logging.getLogger("llmgw.gateway")


async def run_gateway(*, control_plane: str | None, listen: str, cert: str | None, key: str | None, ca: str | None,
                      name: str, insecure: bool, worker: int | None, feed_socket: str, metrics_listen: str = "",
                      public_tls: tuple[str, str, str] = ("", "", "")) -> None:
    """`public_tls`: the client port's certificate, key and client CA files (a gateway on another
    machine; the server's own workers take the server's public_tls from the feed)."""
    from llmgw.server.app import bind_socket, settle_garbage_collector, split_hostport

    if worker is not None:
        # One of the server's own workers: its public port, shared with the others.
        if not feed_socket:
            raise UsageError("--worker needs --feed-socket (the server starts its workers itself)")
        host, port = split_hostport(listen, "public port", "--listen")
        try:
            sock = reuseport_socket(host, port)
        except OSError as exc:
            raise UsageError(f"gateway worker-{worker} cannot listen on {listen}: {exc.strerror or exc}") from None
        gw = GatewayWorker(f"worker-{worker}", Follow(unix_path=feed_socket), local=True)
    else:
        if not control_plane:
            raise UsageError("llmgw gateway needs --control-plane URL (the server's fleet port, https://HOST:PORT)")
        ssl_context = None
        if not control_plane.startswith("http://"):
            if not (cert and key and ca):
                raise UsageError("following over TLS needs --cert, --key (from `llmgw ctl cert gateway NAME`) and --ca; "
                                 "or an http:// URL with --insecure in a lab")
            from llmgw.tls import client_context

            ssl_context = client_context(ca, cert, key, alpn=("h2",))
        from llmgw.fleet import parse_fleet_url

        parse_fleet_url(control_plane, insecure)  # a bad URL is one line now, not a retry loop
        tls = client_port_tls(*public_tls)
        sock = bind_socket(listen, "gateway port", "--listen", listen=False)  # listens once it can serve
        gw = GatewayWorker(name or certificate_name(cert) or socket.gethostname(), Follow(url=control_plane, ssl_context=ssl_context, insecure=insecure),
                           local=False, public_tls=tls)
    metrics_socks = [bind_socket(metrics_listen, "metrics listener", "--metrics-listen")] if metrics_listen else []
    settle_garbage_collector()
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(gw.serve, [sock], metrics_socks=metrics_socks))
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    await reload_tls(gw)
                    continue
                log.info("gateway %s: received %s", gw.name, signal.Signals(signum).name)
                break
        if gw.http is not None:
            grace = float(gw.gateway.settings.shutdown_grace)
            await gw.http.drain(grace)
        nursery.cancel_scope.cancel()
    with trio.CancelScope(shield=True):
        await gw.gateway.aclose()


def certificate_name(cert: str | None) -> str:
    """The CN of the gateway certificate, the name the control plane knows this gateway by (its
    metrics label, `ctl gateways`), so that its own log lines and answers say the same one."""
    if not cert:
        return ""
    from llmgw.tls.info import common_name, load_certificate

    return common_name(load_certificate(cert).subject) or ""


def client_port_tls(cert: str, key: str, ca: str) -> ServerTls | None:
    """The client port's TLS from --public-tls-cert/-key/-ca, built as the server builds its
    public port's (tls.context.server_context); a bad file is one line (UsageError, exit 2)."""
    if not (cert or key or ca):
        return None
    if not (cert and key):
        missing = "--public-tls-key" if cert else "--public-tls-cert"
        raise UsageError(f"TLS on the client port needs --public-tls-cert and --public-tls-key; {missing} is missing")
    return ServerTls(cert, key, ca)


async def reload_tls(gw: GatewayWorker) -> None:
    """SIGHUP: read the client port's certificate files again, as the server does on reload."""
    tls = gw.public_tls
    if gw.local or tls is None:
        log.info("gateway %s: SIGHUP: nothing to re-read (%s)", gw.name,
                 "the server's reloads reach its workers on the feed" if gw.local else "no --public-tls-cert")
        return
    try:
        changed = await trio.to_thread.run_sync(tls.reload)
    except UsageError as exc:
        log.error("gateway %s: SIGHUP: %s; the running certificate stays", gw.name, exc)
        return
    log.info("gateway %s: SIGHUP: %s", gw.name, f"client port certificate re-read from {tls.cert} (new handshakes use it)"
             if changed else "the client port's certificate files are unchanged")
