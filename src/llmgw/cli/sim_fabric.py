"""`llmgw sim fabric`: a simulated fat-tree fabric as `ibnetdiscover` and `saquery SMIR` text."""

from __future__ import annotations

import os

import click

from llmgw.cli.render import console, output_option, print_json


@click.command()
@click.option("--nodes", "count", default=8, show_default=True, type=int,
              help="Number of nodes, named PREFIX1 … PREFIXN (ignored with --node-ids).")
@click.option("--node-prefix", default="node-", show_default=True, help="Node id prefix.")
@click.option("--node-ids", default="", help="Comma-separated node ids (the simulated nodes' --node-id).")
@click.option("--rails", default=4, show_default=True, type=int,
              help="Adapters per node (mlx5_0 …), one rail each: the sim node's --ib-ports.")
@click.option("--group-size", default=32, show_default=True, type=int, help="Nodes per rail group (one leaf per rail).")
@click.option("--spines", default=4, show_default=True, type=int, help="Spine switches (per pod with --core).")
@click.option("--core", default=0, show_default=True, type=int, help="Core switches; 0 = two tiers.")
@click.option("--groups-per-pod", default=4, show_default=True, type=int, help="Rail groups per pod (with --core).")
@click.option("--rate", default="4xNDR", show_default=True,
              help="Cable rate, as ibnetdiscover prints it (the sim node's --ib-rate 400 Gb/sec (4X NDR)).")
@click.option("--degrade", "degraded", multiple=True,
              help="NODE (its last adapter, as the sim node's --degraded 1) or NODE:mlx5_N: that cable trains at 1x.")
@click.option("--degrade-uplinks", default=0, show_default=True, type=int,
              help="The first N leaf-to-spine cables train at 1x.")
@click.option("--misrail", multiple=True, help="NODE: its first two adapters swap leaves (breaks rail alignment).")
@click.option("--no-standby", is_flag=True, help="Only the master subnet manager.")
@click.option("--failover", is_flag=True, help="The standby has become master; the old master is gone.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Write ibnetdiscover.txt, smir.txt and fabric.json here (default: ibnetdiscover text on stdout).")
@click.option("--print", "show", type=click.Choice(["ibnetdiscover", "smir"]), default="ibnetdiscover",
              show_default=True, help="Without --out: which text to print.")
@output_option
def fabric(count: int, node_prefix: str, node_ids: str, rails: int, group_size: int, spines: int, core: int,
           groups_per_pod: int, rate: str, degraded: tuple[str, ...], degrade_uplinks: int, misrail: tuple[str, ...],
           no_standby: bool, failover: bool, out_dir: str | None, show: str, output: str) -> None:
    """Generate a fat-tree fabric consistent with simulated nodes' GUIDs.

    \b
    llmgw sim fabric --nodes 8 --rails 4 --group-size 4 > topology.txt
    llmgw sim fabric --nodes 64 --core 2 --degrade node-3 --misrail node-5 --out /tmp/fabric
    llmgw ctl fabrics --file /tmp/fabric/ibnetdiscover.txt --sm /tmp/fabric/smir.txt
    """
    import msgspec

    from llmgw.errors import UsageError
    from llmgw.fsutil import atomic_write, ensure_dir
    from llmgw.sim.fabric import FabricSpec, generate

    width, _, speed = rate.partition("x")
    ids = [n.strip() for n in node_ids.split(",") if n.strip()] if node_ids else \
        [f"{node_prefix}{i}" for i in range(1, count + 1)]
    if count < 1 and not node_ids:
        raise UsageError(f"--nodes {count}: at least 1")
    spec = FabricSpec(nodes=ids, rails=rails, group_size=group_size, spines=spines, core=core,
                      groups_per_pod=groups_per_pod, width=f"{width}x", speed=speed, degraded=list(degraded),
                      degraded_uplinks=degrade_uplinks, misrail=list(misrail), no_standby=no_standby,
                      failover=failover)
    result = generate(spec)
    if out_dir is None:
        click.echo(result.ibnetdiscover if show == "ibnetdiscover" else result.smir, nl=False)
        return
    directory = ensure_dir(out_dir, 0o755)
    summary = {k: v for k, v in msgspec.to_builtins(result).items() if k not in ("ibnetdiscover", "smir")}
    atomic_write(os.path.join(directory, "ibnetdiscover.txt"), result.ibnetdiscover.encode())
    atomic_write(os.path.join(directory, "smir.txt"), result.smir.encode())
    atomic_write(os.path.join(directory, "fabric.json"), msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    if output == "json":
        print_json({"dir": str(directory), **summary})
        return
    tiers: dict[str, int] = {}
    for sw in result.switches:
        tiers[sw.tier] = tiers.get(sw.tier, 0) + 1
    console().print(f"wrote a simulated fabric in {directory}: {len(ids)} nodes × {rails} rails, "
                    + ", ".join(f"{n} {t}" for t, n in tiers.items())
                    + f"; master SM {result.master}")
