"""`llmgw server`: control plane and gateway."""

from __future__ import annotations

import click


@click.command()
def server() -> None:
    """Run the control plane and gateway (not built yet)."""
    raise click.ClickException("llmgw server is not built yet")
