"""`llmgw demo`: a server and simulated nodes on loopback, as real processes."""

from __future__ import annotations

import click


@click.command()
def demo() -> None:
    """Run a whole fleet on loopback (not built yet)."""
    raise click.ClickException("llmgw demo is not built yet")
