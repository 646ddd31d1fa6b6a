"""`llmgw ctl`: the operator's client of the public JSON API, plus local `cert`."""

from __future__ import annotations

import click

from llmgw.cli.cert import cert


@click.group()
def ctl() -> None:
    """Operator client: nodes, replicas, cert."""


ctl.add_command(cert)
