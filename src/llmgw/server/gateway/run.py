"""The `llmgw gateway` main: bind, follow the control plane, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import functools
import logging
import signal
import socket

import trio

from llmgw.errors import UsageError
from llmgw.server.gateway.worker import Follow, GatewayWorker, reuseport_socket

log = logging.getLogger("llmgw.gateway")


async def run_gateway(*, control_plane: str | None, listen: str, cert: str | None, key: str | None, ca: str | None,
                      name: str, insecure: bool, worker: int | None, feed_socket: str, metrics_listen: str = "") -> None:
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
        sock = bind_socket(listen, "gateway port", "--listen")
        gw = GatewayWorker(name or socket.gethostname(), Follow(url=control_plane, ssl_context=ssl_context, insecure=insecure),
                           local=False)
    metrics_socks = [bind_socket(metrics_listen, "metrics listener", "--metrics-listen")] if metrics_listen else []
    settle_garbage_collector()
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(gw.serve, [sock], metrics_socks=metrics_socks))
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("gateway %s: received %s", gw.name, signal.Signals(signum).name)
                break
        if gw.http is not None:
            grace = float(gw.gateway.settings.shutdown_grace)
            await gw.http.drain(grace)
        nursery.cancel_scope.cancel()
    with trio.CancelScope(shield=True):
        await gw.gateway.aclose()
