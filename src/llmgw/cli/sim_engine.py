"""`llmgw sim engine`: an OpenAI-compatible server that behaves like vLLM."""

from __future__ import annotations

import click


@click.command()
def engine() -> None:
    """Run a simulated engine (not built yet)."""
    raise click.ClickException("llmgw sim engine is not built yet")
