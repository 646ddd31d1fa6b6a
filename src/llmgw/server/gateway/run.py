"""The `llmgw gateway` main: bind, follow the control plane, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import stat

import trio

from llmgw.errors import LlmgwError, UsageError
from llmgw.runtime import settle_garbage_collector
from llmgw.server.gateway.worker import Follow, GatewayWorker, reuseport_socket
from llmgw.tls.context import ServerTls
from llmgw.web.listen import bind_socket, split_hostport
from llmgw.wire.gateway import NOT_OWN_WORKER

log = logging.getLogger("llmgw.gateway")


async def run_gateway(*, control_plane: str | None, listen: str, cert: str | None, key: str | None, ca: str | None,
                      name: str, insecure: bool, worker: int | None, feed_socket: str, metrics_listen: str = "",
                      public_tls: tuple[str, str, str] = ("", "", ""), parent_fd: int | None = None) -> None:
    """`public_tls`: the client port's certificate, key and client CA files (a gateway on another
    machine; the server's own workers take the server's public_tls from the feed). `parent_fd`: a
    pipe's read end whose EOF says the server that started this worker is gone (llmgw.server
    .gateway.workers); the worker then stops as on SIGTERM."""
    if worker is not None:
        # One of the server's own workers: its public port, shared with the others.
        if not feed_socket:
            raise UsageError("--worker needs --feed-socket (the server starts its workers itself)")
        if parent_fd is not None:
            try:
                if not stat.S_ISFIFO(os.fstat(parent_fd).st_mode):
                    raise UsageError(f"--parent-fd {parent_fd} is not a pipe")
                os.set_blocking(parent_fd, False)
            except OSError as exc:
                raise UsageError(f"--parent-fd {parent_fd}: {exc.strerror or exc}") from None
        host, port = split_hostport(listen, "public port", "--listen")
        try:
            sock = reuseport_socket(host, port)
        except OSError as exc:
            raise UsageError(f"gateway worker-{worker} cannot listen on {listen}: {exc.strerror or exc}") from None
        # Popped: what this worker starts (nothing today) does not inherit it.
        gw = GatewayWorker(f"worker-{worker}", Follow(unix_path=feed_socket), local=True,
                           worker_key=os.environ.pop("LLMGW_WORKER_KEY", ""))
    else:
        if not control_plane:
            raise UsageError("llmgw gateway needs --control-plane URL (the server's fleet port, https://HOST:PORT)")
        ssl_context = None
        if not control_plane.startswith("http://"):
            if not (cert and key and ca):
                raise UsageError("following over TLS needs --cert, --key (from `llmgw ctl cert gateway NAME`) "
                                 "and --ca; or an http:// URL with --insecure in a lab")
            from llmgw.tls import client_context

            ssl_context = client_context(ca, cert, key, alpn=("h2",))
        from llmgw.fleet import parse_fleet_url

        parse_fleet_url(control_plane, insecure)  # a bad URL is one line now, not a retry loop
        tls = client_port_tls(*public_tls)
        sock = bind_socket(listen, "gateway port", "--listen", listen=False)  # listens once it can serve
        gw = GatewayWorker(name or certificate_name(cert) or socket.gethostname(),
                           Follow(url=control_plane, ssl_context=ssl_context, insecure=insecure),
                           local=False, public_tls=tls)
    metrics_socks = [bind_socket(metrics_listen, "metrics listener", "--metrics-listen")] if metrics_listen else []
    settle_garbage_collector()
    async with trio.open_nursery() as nursery:
        # Watched from the start: a worker whose server dies before the first config exits too.
        nursery.start_soon(functools.partial(gw.serve, [sock], metrics_socks=metrics_socks))
        why = await until_stopped(gw, parent_fd)
        if gw.http is not None:
            grace = float(gw.gateway.settings.shutdown_grace)
            await gw.http.drain(grace)
        nursery.cancel_scope.cancel()
    with trio.CancelScope(shield=True):
        await gw.gateway.aclose()
    if why == "disowned":  # not when it was refused while it drained (its server gone, the next one's socket)
        raise LlmgwError(f"gateway {gw.name}: the control plane refused this worker: {NOT_OWN_WORKER}")


async def until_stopped(gw: GatewayWorker, parent_fd: int | None) -> str:
    """Until SIGTERM or SIGINT (SIGHUP re-reads TLS files), the server that started this worker
    is gone, or the control plane refused it as not its own; says which came first."""
    server_pid = os.getppid()
    reasons: list[str] = []
    async with trio.open_nursery() as nursery:

        def stop(why: str) -> None:
            reasons.append(why)
            nursery.cancel_scope.cancel()

        async def signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as received:
                async for signum in received:
                    if signum == signal.SIGHUP:
                        await reload_tls(gw)
                        continue
                    log.info("gateway %s: received %s", gw.name, signal.Signals(signum).name)
                    break
            stop("signal")

        async def parent() -> None:
            assert parent_fd is not None
            await parent_gone(parent_fd)
            log.warning("gateway %s: the server that started it (pid %d) is gone; exiting (a new server starts "
                        "its own workers)", gw.name, server_pid)
            stop("parent")

        async def disowned() -> None:
            await gw.disowned.wait()
            stop("disowned")

        nursery.start_soon(signals)
        nursery.start_soon(disowned)
        if parent_fd is not None:
            nursery.start_soon(parent)
    return reasons[0]


async def parent_gone(fd: int) -> None:
    """Returns at EOF on `fd`: the pipe's write end, which only the server holds, closed with the
    server however it ended (kill -9 too). Nothing is ever written on it."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            if not os.read(fd, 64):
                return
        except BlockingIOError:
            continue


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
    log.info("gateway %s: SIGHUP: %s", gw.name,
             f"client port certificate re-read from {tls.cert} (new handshakes use it)"
             if changed else "the client port's certificate files are unchanged")
