"""`llmgw sim node`: a fake sysfs tree and GPU inventory an agent can discover."""

from __future__ import annotations

import click


@click.command()
def node() -> None:
    """Write a simulated node (not built yet)."""
    raise click.ClickException("llmgw sim node is not built yet")
