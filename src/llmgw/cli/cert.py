"""`llmgw ctl cert`: the cluster's internal CA and certificate issuance, on local files."""

from __future__ import annotations

import click


@click.group()
def cert() -> None:
    """Issue and inspect certificates from the cluster's own CA (not built yet)."""
