"""`llmgw sim node`: a fake sysfs tree and GPU inventory an agent can discover."""

from __future__ import annotations

import os

import click

from llmgw.cli.render import console, make_table, output_option, print_json


@click.command()
@click.option(
    "--dir",
    "directory",
    required=True,
    type=click.Path(file_okay=False),
    help="Node directory to write (sys/, gpus.json, agent.yaml).",
)
@click.option(
    "--node-id",
    default="",
    help="Node id for agent.yaml and for the GUIDs/LIDs.  [default: the directory's name]",
)
@click.option("--gpus", default=8, show_default=True, type=int, help="Number of GPUs.")
@click.option(
    "--gpu-name",
    default="NVIDIA H100 80GB HBM3",
    show_default=True,
    help="GPU name, as NVML reports it.",
)
@click.option(
    "--gpu-memory-mib", default=81559, show_default=True, type=int, help="Memory per GPU in MiB."
)
@click.option(
    "--nvlink",
    default="nv18",
    show_default=True,
    help="'nv<N>': every GPU pair joined by N NVLinks (NVSwitch); 'none'.",
)
@click.option(
    "--ib-ports", default=4, show_default=True, type=int, help="InfiniBand HCAs (one port each)."
)
@click.option(
    "--ib-rate",
    default="400 Gb/sec (4X NDR)",
    show_default=True,
    help="InfiniBand port rate, as sysfs prints it.",
)
@click.option(
    "--roce-ports", default=0, show_default=True, type=int, help="RoCE (Ethernet link layer) HCAs."
)
@click.option(
    "--roce-rate",
    default="200 Gb/sec (4X HDR)",
    show_default=True,
    help="RoCE port rate, as sysfs prints it.",
)
@click.option(
    "--degraded",
    default=0,
    show_default=True,
    type=int,
    help="Make the last N InfiniBand ports degraded (1X width, error counters).",
)
@click.option("--server", default="", help="Server URL to put in agent.yaml.")
@click.option("--force", is_flag=True, help="Replace a simulated node already in --dir.")
@output_option
def node(
    directory: str,
    node_id: str,
    gpus: int,
    gpu_name: str,
    gpu_memory_mib: int,
    nvlink: str,
    ib_ports: int,
    ib_rate: str,
    roce_ports: int,
    roce_rate: str,
    degraded: int,
    server: str,
    force: bool,
    output: str,
) -> None:
    """Write a simulated node: fake sysfs, GPU inventory and an agent config.

    \b
    llmgw sim node --dir /tmp/node-1
    llmgw agent --config /tmp/node-1/agent.yaml
    """
    from llmgw.sim.node import NodeSpec, write_node

    spec = NodeSpec(
        node_id=node_id or os.path.basename(os.path.abspath(directory)),
        gpus=gpus,
        gpu_name=gpu_name,
        gpu_memory_mib=gpu_memory_mib,
        nvlink=nvlink,
        ib_ports=ib_ports,
        ib_rate=ib_rate,
        roce_ports=roce_ports,
        roce_rate=roce_rate,
        degraded=degraded,
        server=server,
    )
    result = write_node(directory, spec, force=force)
    if output == "json":
        print_json(result)
        return
    out = console()
    out.print(f"wrote simulated node {result.node_id} in {result.dir}")
    out.print(f"  agent config  {result.agent_config}")
    out.print(f"  sysfs         {result.sysfs_root}")
    out.print(
        f"  GPUs          {result.gpus_file}: {result.gpus} × {result.gpu_name}, NVLink {result.nvlink}"
    )
    if result.ports:
        rows = [
            (
                f"{p.device}/{p.port}",
                "IB" if p.link_layer == "InfiniBand" else "RoCE",
                p.rate,
                p.netdev,
                p.lid or "-",
                p.node_guid,
                "degraded" if p.degraded else "",
            )
            for p in result.ports
        ]
        out.print(make_table(("PORT", "LINK", "RATE", "NETDEV", "LID", "NODE GUID", ""), rows))
