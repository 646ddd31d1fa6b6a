"""`llmgw server`: control plane and gateway."""

from __future__ import annotations

import click

from llmgw.cli.logs import setup_logging


@click.command()
@click.option("-c", "--config", "config_path", envvar="LLMGW_SERVER_CONFIG", type=click.Path(dir_okay=False),
              help="Server config (YAML). [env: LLMGW_SERVER_CONFIG]")
@click.option("--listen", envvar="LLMGW_LISTEN",
              help="Public port HOST:PORT (gateway, API, metrics). [env: LLMGW_LISTEN]")
@click.option("--fleet-listen", envvar="LLMGW_FLEET_LISTEN",
              help="Fleet port HOST:PORT (agents). [env: LLMGW_FLEET_LISTEN]")
@click.option("--admin-listen", envvar="LLMGW_ADMIN_LISTEN",
              help="Separate operator door HOST:PORT for /api/v1 and /metrics; the public port then serves "
                   "clients only. [env: LLMGW_ADMIN_LISTEN]")
@click.option("--state-dir", envvar="LLMGW_STATE_DIR", help="Directory for the server's state. [env: LLMGW_STATE_DIR]")
@click.option("--insecure", is_flag=True, help="Serve the fleet port as plain h2c, without TLS (labs and tests only).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.pass_context
def server(ctx: click.Context, config_path: str | None, listen: str | None, fleet_listen: str | None,
           admin_listen: str | None, state_dir: str | None, insecure: bool, log_level: str) -> None:
    """Run the control plane and the OpenAI-compatible gateway.

    Flags and LLMGW_* variables override the config file.
    """
    import trio

    from llmgw.catalog import load_server_config, override
    from llmgw.server.app import run_server

    overrides = {"listen": listen, "fleet_listen": fleet_listen, "admin_listen": admin_listen, "state_dir": state_dir}
    cfg = override(load_server_config(config_path), overrides)
    setup_logging(ctx.obj.get("debug", False), log_level)
    trio.run(lambda: run_server(cfg, insecure=insecure, config_path=config_path, overrides=overrides))
