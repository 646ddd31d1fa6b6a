"""`llmgw gateway`: a gateway worker on its own, following a control plane (or one of the server's
own workers, started by the server with --worker)."""

from __future__ import annotations

import click

from llmgw.cli.logs import setup_logging


@click.command()
@click.option("--control-plane", "control_plane", envvar="LLMGW_CONTROL_PLANE", metavar="URL",
              help="The server's fleet port, https://HOST:PORT (http:// only with --insecure). "
                   "[env: LLMGW_CONTROL_PLANE]")
@click.option("--listen", envvar="LLMGW_LISTEN", default="127.0.0.1:8080", show_default=True,
              help="HOST:PORT to serve /v1 and /healthz on (once the control plane has sent the first "
                   "configuration). [env: LLMGW_LISTEN]")
@click.option("--metrics-listen", envvar="LLMGW_METRICS_LISTEN", default="", metavar="HOST:PORT",
              help="Serve this gateway's /metrics here (never on the client port: they name engine addresses; "
                   "the control plane's /metrics shows them too). [env: LLMGW_METRICS_LISTEN]")
@click.option("--cert", envvar="LLMGW_GATEWAY_CERT", type=click.Path(dir_okay=False),
              help="Gateway certificate (from `llmgw ctl cert gateway NAME`). [env: LLMGW_GATEWAY_CERT]")
@click.option("--key", envvar="LLMGW_GATEWAY_KEY", type=click.Path(dir_okay=False),
              help="Its private key. [env: LLMGW_GATEWAY_KEY]")
@click.option("--ca", envvar="LLMGW_CA", type=click.Path(dir_okay=False),
              help="The CA certificate that signed the server's. [env: LLMGW_CA]")
@click.option("--public-tls-cert", envvar="LLMGW_PUBLIC_TLS_CERT", type=click.Path(dir_okay=False), metavar="FILE",
              help="Serve the client port over TLS with this certificate (as the server's public_tls.cert; "
                   "re-read on SIGHUP). [env: LLMGW_PUBLIC_TLS_CERT]")
@click.option("--public-tls-key", envvar="LLMGW_PUBLIC_TLS_KEY", type=click.Path(dir_okay=False), metavar="FILE",
              help="Its private key (mode 0600; as public_tls.key). [env: LLMGW_PUBLIC_TLS_KEY]")
@click.option("--public-tls-ca", envvar="LLMGW_PUBLIC_TLS_CA", type=click.Path(dir_okay=False), metavar="FILE",
              help="Client certificates, when a client presents one, must come from this CA (as public_tls.ca; "
                   "/v1 itself takes API keys). [env: LLMGW_PUBLIC_TLS_CA]")
@click.option("--name", default="", help="Name in this gateway's log and answers, and in the control plane's metrics "
              "when it follows without a certificate (--insecure); a certificate's name always wins there "
              "(default: the certificate's name, or the host).")
@click.option("--insecure", is_flag=True, help="Follow over plain h2c, without TLS (labs and tests only).")
@click.option("--worker", type=int, default=None, hidden=True, help="Internal: the server's worker INDEX.")
@click.option("--feed-socket", default="", hidden=True, help="Internal: the control plane's Unix socket.")
@click.option("--parent-fd", type=int, default=None, hidden=True,
              help="Internal: a pipe from the server; EOF on it (the server is gone) stops the worker.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.pass_context
def gateway(ctx: click.Context, control_plane: str | None, listen: str, cert: str | None, key: str | None,
            ca: str | None, name: str, insecure: bool, worker: int | None, feed_socket: str, log_level: str,
            metrics_listen: str, public_tls_cert: str | None, public_tls_key: str | None,
            public_tls_ca: str | None, parent_fd: int | None) -> None:
    """Serve the OpenAI-compatible gateway alone, following a control plane.

    Gateway capacity then grows past one machine behind any L4 load balancer: every such
    process keeps its own balancer, breakers and admission, and serves with the last
    endpoint set it had while the control plane is away.

    --cert, --key and --ca are its credentials towards the control plane;
    --public-tls-* serve its own client port over TLS, as public_tls does on the server.
    """
    import trio

    from llmgw.server.gateway.run import run_gateway

    setup_logging(ctx.obj.get("debug", False), log_level)
    trio.run(lambda: run_gateway(control_plane=control_plane, listen=listen, cert=cert, key=key, ca=ca, name=name,
                                 insecure=insecure, worker=worker, feed_socket=feed_socket,
                                 metrics_listen=metrics_listen, parent_fd=parent_fd,
                                 public_tls=(public_tls_cert or "", public_tls_key or "", public_tls_ca or "")))
