"""`llmgw ctl rollout status MODEL`: follow a model's rolling replacement after a reload."""

from __future__ import annotations

import time
from typing import Any

import click

from llmgw.cli import complete
from llmgw.cli.render import output_option, print_json, say
from llmgw.errors import LlmgwError
from llmgw.safetext import terminal_text

POLL_INTERVAL = 0.5  # seconds between two looks


class RolloutHalted(LlmgwError):
    exit_code = 1


def rollout_cell(ro: dict[str, Any] | None) -> str:
    """The ROLLOUT column of `ctl models`."""
    if not ro:
        return "-"
    if ro["state"] == "halted":
        return f"halted: {ro['note']}"
    if ro["state"] == "rolling":
        return f"rolling {ro['replaced']}/{ro['total']} ({ro['what']}): {ro['note']}"
    return f"done {ro['replaced']}/{ro['total']} ({ro['what']})"


@click.group()
def rollout() -> None:
    """Rolling replacement: a reload that changes what a model's replicas run (engine, source,
    args, env, GPUs, profile order) replaces them one at a time, the new one ready first."""


@rollout.command()
@click.argument("model", shell_complete=complete.MODELS)
@click.option("--timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds to follow it before giving up (the rollout goes on server-side).")
@click.option("-w/-W", "--watch/--no-watch", default=True, show_default=True, help="Follow until it ends.")
@output_option
@click.pass_context
def status(ctx: click.Context, model: str, timeout: float, watch: bool, output: str) -> None:
    """Follow MODEL's rollout until it is done (exit 0) or halted (exit 1, with the reason).

    \b
    llmgw ctl reload && llmgw ctl rollout status llama-3.1-8b-instruct
    """
    client = ctx.obj["api"]()
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        found = next((m for m in client.get("/api/v1/models") if m["name"] == model), None)
        if found is None:
            raise LlmgwError(f"no model {model!r} in the catalog (llmgw ctl models lists them)")
        ro = found.get("rollout")
        line = f"{model}: {found['ready']}/{found['replicas']} ready; " + (rollout_cell(ro) if ro else "no rollout")
        if output != "json" and line != last:
            say(line)
            last = line
        state = ro["state"] if ro else "done"
        if state == "halted":
            _json(found, output)
            raise RolloutHalted(f"rollout of {model} halted: {terminal_text(ro['note'] if ro else '')}; "
                                "the old replicas serve on (fix the profile and reload to roll again)")
        if state == "done" or not watch:
            _json(found, output)
            return
        if time.monotonic() > deadline:
            _json(found, output)
            raise RolloutHalted(f"rollout of {model}: still rolling after {timeout:g}s "
                                f"({terminal_text(ro['note'] if ro else '')})")
        time.sleep(POLL_INTERVAL)  # ok: polling the server for progress


def _json(found: dict[str, Any], output: str) -> None:
    if output == "json":
        print_json(found)  # escapes control characters a hostile server could send
