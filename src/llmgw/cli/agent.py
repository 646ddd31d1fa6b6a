"""`llmgw agent`: the node agent."""

from __future__ import annotations

import click

from llmgw.cli.logs import setup_logging


@click.command()
@click.option("-c", "--config", "config_path", envvar="LLMGW_AGENT_CONFIG", type=click.Path(dir_okay=False),
              help="Agent config (YAML). [env: LLMGW_AGENT_CONFIG]")
@click.option("--server", "server_url", envvar="LLMGW_FLEET_URL",
              help="Fleet URL of the server, https://HOST:PORT. [env: LLMGW_FLEET_URL]")
@click.option("--node-id", envvar="LLMGW_NODE_ID", help="Node id (default: the host name). [env: LLMGW_NODE_ID]")
@click.option("--work-dir", envvar="LLMGW_WORK_DIR", help="Directory for engine state and logs. [env: LLMGW_WORK_DIR]")
@click.option("--insecure", is_flag=True,
              help="Allow a plain h2c server URL (http://), without TLS (labs and tests only).")
@click.option("--stop-engines-on-exit", is_flag=True,
              help="On SIGTERM/SIGINT stop this node's engines too (default: they keep serving and the next agent "
                   "adopts them).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.pass_context
def agent(ctx: click.Context, config_path: str | None, server_url: str | None, node_id: str | None,
          work_dir: str | None, insecure: bool, stop_engines_on_exit: bool, log_level: str) -> None:
    """Run the node agent: dial the server, register, heartbeat, run engines.

    Flags and LLMGW_* variables override the config file.
    """
    import trio

    from llmgw.agent.run import run_agent
    from llmgw.catalog import load_agent_config, override

    cfg = load_agent_config(config_path)
    cfg = override(cfg, {"server": server_url, "node_id": node_id, "work_dir": work_dir})
    setup_logging(ctx.obj.get("debug", False), log_level)
    trio.run(lambda: run_agent(cfg, insecure=insecure, stop_engines_on_exit=stop_engines_on_exit))
