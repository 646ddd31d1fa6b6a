"""`llmgw agent`: the node agent."""

from __future__ import annotations

import click


@click.command()
def agent() -> None:
    """Run the node agent (not built yet)."""
    raise click.ClickException("llmgw agent is not built yet")
