"""`llmgw sim …`: stand-ins for the hardware this machine lacks (GPUs, InfiniBand, vLLM)."""

from __future__ import annotations

import click

from llmgw.cli.sim_engine import engine
from llmgw.cli.sim_fabric import fabric
from llmgw.cli.sim_fileserver import fileserver
from llmgw.cli.sim_node import node


@click.group()
def sim() -> None:
    """Simulated engines and nodes, for tests and the demo on machines without GPUs."""


sim.add_command(engine)
sim.add_command(node)
sim.add_command(fileserver)
sim.add_command(fabric)
