"""What `llmgw ctl` hands its subcommands through click's context: the API client, made on first
use (`ctx.obj["api"]`, set by the `ctl` group from --server, --token and the TLS files).

Here rather than in cli/ctl.py so that a subcommand's module (doctor, fabrics) needs nothing of
the group that imports it: `api` lived in ctl.py, and ctl.py imports them (issue 42's circle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # httpx: imported only when a command calls the server
    from llmgw.api_client import ApiClient


def api(ctx: click.Context) -> ApiClient:
    """The API client of the `ctl` group this command runs under."""
    client: ApiClient = ctx.obj["api"]()
    return client
