"""`llmgw demo`: a server and simulated nodes on loopback, as real processes."""

from __future__ import annotations

import signal

import click


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True,
              help="Public port (gateway, API).")
@click.option("--fleet-port", type=click.IntRange(1, 65535), default=8443, show_default=True,
              help="Fleet port (agents).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback address to use.")
@click.option("--nodes", type=click.IntRange(1, 16), default=2, show_default=True, help="Simulated nodes.")
@click.option("--gpus", type=click.IntRange(4, 16), default=8, show_default=True, help="GPUs per simulated node.")
@click.option("--dir", "work_dir", type=click.Path(file_okay=False),
              help="Keep the demo's files here (default: a new temp dir).")
@click.option("--insecure", is_flag=True, help="Run the fleet port as plain h2c instead of mutual TLS.")
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="Seconds to wait for replicas to be ready.")
def demo(port: int, fleet_port: int, host: str, nodes: int, gpus: int, work_dir: str | None, insecure: bool,
         timeout: float) -> None:
    """Run a whole fleet on loopback: a server, simulated GPU nodes, agents, engines.

    Prints one line per step, then the gateway URL and commands to try. Ctrl-C stops
    everything it started.
    """
    import trio

    from llmgw.demo import DemoOptions, run_demo

    opts = DemoOptions(host=host, port=port, fleet_port=fleet_port, nodes=nodes, gpus=gpus, dir=work_dir,
                       tls=not insecure, timeout=timeout)

    def say(line: str) -> None:
        click.echo(line)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
            await run_demo(opts, say)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _cancel_on_signal(scope: object) -> None:
    """Ctrl-C or SIGTERM: a clean stop (the demo's cleanup runs), not a KeyboardInterrupt."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()  # type: ignore[attr-defined]
            return
