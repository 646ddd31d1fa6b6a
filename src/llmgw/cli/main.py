"""The `llmgw` command: one entry point for server, agent, ctl, sim and demo."""

from __future__ import annotations

import os
import sys

import click

from llmgw import __version__
from llmgw.errors import LlmgwError, unwrap


def _version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from llmgw import hotpath

    click.echo(f"llmgw {__version__}, {hotpath.summary()}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version,
              help="Show the version, and whether the gateway's hot path is compiled, and exit.")
@click.option("--debug", is_flag=True, envvar="LLMGW_DEBUG", help="Show tracebacks and debug logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Run LLM inference engines across a fleet of GPU nodes behind one gateway.

    \b
    llmgw server   control plane and OpenAI-compatible gateway
    llmgw gateway  the gateway alone, following a control plane
    llmgw agent    node agent (dials out to the server; no SSH)
    llmgw ctl      operator client: nodes, models, doctor, drain, fabric-test, cert, ...
    llmgw sim      simulated engines and nodes for machines without GPUs
    llmgw demo     a whole fleet on loopback
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _register() -> None:
    from llmgw.cli.agent import agent
    from llmgw.cli.ctl import ctl
    from llmgw.cli.demo import demo
    from llmgw.cli.gateway import gateway
    from llmgw.cli.server import server
    from llmgw.cli.sim import sim

    for command in (server, gateway, agent, ctl, sim, demo):
        cli.add_command(command)


_register()


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("LLMGW_DEBUG", "") not in ("", "0", "false")


def _safe(exc: BaseException) -> str:
    """An error's text for the terminal: it may quote the server (a halted rollout's note, why a
    drain is stuck: a node's words), so no control character gets through; its own lines stay."""
    from llmgw.safetext import terminal_text

    return "\n".join(terminal_text(line) for line in str(exc).split("\n"))


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            cli.main(args=args, prog_name="llmgw", standalone_mode=False)
        except BaseExceptionGroup as group:
            raise unwrap(group) from None
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "llmgw"
        click.echo(f"llmgw: error: {exc.format_message()} (see `{where} --help`)", err=True)
        sys.exit(getattr(exc.ctx.command, "usage_exit_code", exc.exit_code) if exc.ctx is not None else exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"llmgw: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except LlmgwError as exc:
        if _debug_requested(args):
            raise
        click.echo(f"llmgw: error: {_safe(exc)}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # `llmgw ctl nodes | head`: the reader went away; that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    sys.exit(0)
