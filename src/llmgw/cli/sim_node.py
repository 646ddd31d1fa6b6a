"""`llmgw sim node`: a fake sysfs tree and GPU inventory an agent can discover; `set-port`
changes a port's state under a running agent."""

from __future__ import annotations

import os

import click

from llmgw.cli.render import console, make_table, output_option, print_json, say
from llmgw.sim.profiles import BASE, PROFILES


@click.group(invoke_without_command=True)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    help="Node directory to write (sys/, gpus.json, agent.yaml).",
)
@click.option(
    "--node-id",
    default="",
    help="Node id for agent.yaml and for the GUIDs/LIDs.  [default: the directory's name]",
)
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    help="A real box: GPUs, NVLink matrix, adapters and GID tables (flags below override it).",
)
@click.option("--gpus", type=int, help="Number of GPUs.  [default: 8]")
@click.option("--gpu-name", help="GPU name, as NVML reports it.  [default: NVIDIA H100 80GB HBM3]")
@click.option("--gpu-memory-mib", type=int, help="Memory per GPU in MiB.  [default: 81559]")
@click.option(
    "--nvlink",
    help="'nv<N>': every GPU pair joined by N NVLinks (NVSwitch); 'pairs-nv<N>': bridges "
    "joining GPUs 0-1, 2-3, ...; 'none'.  [default: nv18]",
)
@click.option("--ib-ports", type=int, help="InfiniBand HCAs (one port each).  [default: 4]")
@click.option("--ib-rate", help="InfiniBand port rate, as sysfs prints it.  [default: 400 Gb/sec (4X NDR)]")
@click.option("--roce-ports", type=int, help="RoCE (Ethernet link layer) HCAs.  [default: 0]")
@click.option("--roce-rate", help="RoCE port rate, as sysfs prints it.  [default: 200 Gb/sec (4X HDR)]")
@click.option(
    "--degraded",
    default=0,
    show_default=True,
    type=int,
    help="Make the last N InfiniBand ports degraded (1X width, error counters).",
)
@click.option(
    "--absent-adapter",
    "absent",
    multiple=True,
    help="Declare this adapter in the agent's fabric although the node has none (repeatable).",
)
@click.option(
    "--init-port",
    "init_ports",
    multiple=True,
    help="Leave this adapter's port in INIT, as without a subnet manager (repeatable).",
)
@click.option("--ib-fabric", default="ib", show_default=True, help="Name of the InfiniBand fabric agent.yaml declares.")
@click.option("--roce-fabric", default="roce", show_default=True, help="Name of the RoCE fabric agent.yaml declares.")
@click.option("--server", default="", help="Server URL to put in agent.yaml.")
@click.option("--fabric", "fabric_dir", default="", type=click.Path(file_okay=False),
              help="A `llmgw sim fabric --out` directory: stand-in ibnetdiscover and saquery in bin/ print it.")
@click.option("--bandwidth", "bandwidth", multiple=True, metavar="DEV=GBPS",
              help="Gb/s the stand-in ib_write_bw measures through this adapter (repeatable; "
                   "default 96 %% of its rate): a slow rail for `ctl fabric-test`.")
@click.option("--force", is_flag=True, help="Replace a simulated node already in --dir.")
@output_option
@click.pass_context
def node(
    ctx: click.Context,
    directory: str | None,
    node_id: str,
    profile: str | None,
    gpus: int | None,
    gpu_name: str | None,
    gpu_memory_mib: int | None,
    nvlink: str | None,
    ib_ports: int | None,
    ib_rate: str | None,
    roce_ports: int | None,
    roce_rate: str | None,
    degraded: int,
    absent: tuple[str, ...],
    init_ports: tuple[str, ...],
    ib_fabric: str,
    roce_fabric: str,
    server: str,
    fabric_dir: str,
    bandwidth: tuple[str, ...],
    force: bool,
    output: str,
) -> None:
    """Write a simulated node: fake sysfs, GPU inventory and an agent config.

    \b
    llmgw sim node --dir /tmp/node-1 --profile dgx-h100
    llmgw agent --config /tmp/node-1/agent.yaml
    llmgw sim node set-port /tmp/node-1 mlx5_2 1 down
    """
    if ctx.invoked_subcommand is not None:
        return
    if not directory:
        raise click.UsageError("Missing option '--dir'.")
    from llmgw.sim.node import NodeSpec, write_node

    chosen: dict[str, object] = {**BASE, **PROFILES.get(profile or "", {})}
    given = {"gpus": gpus, "gpu_name": gpu_name, "gpu_memory_mib": gpu_memory_mib, "nvlink": nvlink,
             "ib_ports": ib_ports, "ib_rate": ib_rate, "roce_ports": roce_ports, "roce_rate": roce_rate}
    chosen.update({key: value for key, value in given.items() if value is not None})
    spec = NodeSpec(
        node_id=node_id or os.path.basename(os.path.abspath(directory)),
        degraded=degraded,
        server=server,
        absent=list(absent),
        init_ports=list(init_ports),
        ib_fabric=ib_fabric,
        roce_fabric=roce_fabric,
        **chosen,  # type: ignore[arg-type]
        fabric=fabric_dir,
        bandwidth=_bandwidths(bandwidth),
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
                "degraded" if p.degraded else ("INIT" if p.device in spec.init_ports else ""),
            )
            for p in result.ports
        ]
        out.print(make_table(("PORT", "LINK", "RATE", "NETDEV", "LID", "NODE GUID", ""), rows))
    for name in spec.absent:
        out.print(f"  {name} is declared in agent.yaml's fabrics but absent")


def _bandwidths(items: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        device, sep, figure = item.partition("=")
        try:
            out[device] = float(figure)
        except ValueError:
            raise click.BadParameter(f"{item!r}: write it DEV=GBPS, like mlx5_2=150",
                                     param_hint="--bandwidth") from None
        if not sep or not device:
            raise click.BadParameter(f"{item!r}: write it DEV=GBPS, like mlx5_2=150", param_hint="--bandwidth")
    return out


@node.command("set-port")
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("device")
@click.argument("port", type=click.IntRange(min=1))
@click.argument("state", type=click.Choice(["up", "down", "init", "polling", "armed", "active"]))
@click.option("--rate", default="", metavar="RATE",
              help="The rate the link trained at, as sysfs prints it: '100 Gb/sec (1X NDR)' for a cable at 1x.")
def set_port_command(directory: str, device: str, port: int, state: str, rate: str) -> None:
    """Change a simulated port's state (the running agent notices on its next heartbeat).

    \b
    down: DOWN (Disabled), a port switched off; polling: DOWN (Polling), no cable;
    init: INIT (LinkUp), no subnet manager; up/active: ACTIVE (LinkUp).
    """
    from llmgw.sim.node import set_port

    line = set_port(directory, device, port, state, rate)
    say(f"{device}/{port} in {directory}: {line}")


@node.command("set-pcie")
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("device")
@click.option("--speed", type=click.Choice(["2.5", "5", "8", "16", "32", "64"]),
              help="GT/s the link trained at (8: gen3).")
@click.option("--width", type=click.Choice(["1", "2", "4", "8", "16", "32"]), help="Lanes it trained at.")
@click.option("--max-speed", type=click.Choice(["2.5", "5", "8", "16", "32", "64"]),
              help="GT/s the card and slot could do.")
@click.option("--max-width", type=click.Choice(["1", "2", "4", "8", "16", "32"]), help="Lanes the card could use.")
def set_pcie_command(directory: str, device: str, speed: str | None, width: str | None, max_speed: str | None,
                     max_width: str | None) -> None:
    """Change the PCIe link a simulated HCA trained at (sysfs device/current_link_speed, _width,
    max_link_speed, max_link_width); an agent started afterwards reports it.

    \b
    llmgw sim node set-pcie /tmp/node-1 mlx5_0 --speed 8 --width 8    # an x8 gen3 slot
    """
    from llmgw.sim.pcie import set_pcie

    line = set_pcie(directory, device, None if speed is None else float(speed), None if width is None else int(width),
                    None if max_speed is None else float(max_speed), None if max_width is None else int(max_width))
    say(f"{device} in {directory}: PCIe {line}")


@node.command("set-gpu")
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("index", type=click.IntRange(min=0))
@click.option("--health", type=click.Choice(["ok", "error", "lost"]), help="What NVML says of the GPU.")
@click.option("--ecc", type=click.IntRange(min=0), help="Uncorrected ECC errors since the driver loaded.")
@click.option("--xid", type=click.IntRange(min=0), help="The last Xid event (79: fallen off the bus; 0: none).")
@click.option("--nvlink-down", type=click.IntRange(min=0), help="NVLink links of this GPU that are down.")
@click.option("--remap-pending/--no-remap-pending", default=None, help="A row remap waits for the next GPU reset.")
@click.option("--remap-failure/--no-remap-failure", default=None, help="A row remap failed (no spare row left).")
@click.option("--retired-pages", type=click.IntRange(min=0),
              help="Pages retired (a board before row remapping: it then reports no row remapper).")
@click.option("--retired-pending/--no-retired-pending", default=None, help="A retired page waits for a driver reload.")
@click.option("--throttle", "throttle", multiple=True, metavar="REASON",
              help="An active clock event reason (repeatable): hw_slowdown, hw_thermal, hw_power_brake, "
                   "sw_thermal, sw_power_cap, gpu_idle, ...; 'none' clears them.")
@click.option("--temperature", type=click.IntRange(min=0), help="GPU temperature, °C.")
@click.option("--slowdown-temp", type=click.IntRange(min=0), help="The card's slowdown temperature, °C.  [89]")
@click.option("--shutdown-temp", type=click.IntRange(min=0), help="The card's shutdown temperature, °C.  [92]")
@click.option("--pcie-gen", type=click.IntRange(1, 6), help="The PCIe generation the link trained at.  [5]")
@click.option("--pcie-width", type=click.IntRange(1, 32), help="The PCIe lanes the link trained at.  [16]")
@click.option("--utilization", type=click.IntRange(0, 100), help="GPU utilisation, %.")
@click.option("--persistence/--no-persistence", default=None, help="Persistence mode.")
@click.option("--ecc-mode", type=click.Choice(["on", "off"]), help="ECC mode now.")
@click.option("--ecc-pending", type=click.Choice(["on", "off"]), help="ECC mode after the next reset.")
@click.option("--fabric-state", type=click.Choice(["none", "not_started", "in_progress", "completed"]),
              help="The NVSwitch fabric's state (none: no NVSwitches).")
@click.option("--fabric-status", type=click.IntRange(min=0),
              help="NVML's return code for the fabric's setup (0: success).")
def set_gpu_command(directory: str, index: int, health: str | None, ecc: int | None, xid: int | None,
                    nvlink_down: int | None, remap_pending: bool | None, remap_failure: bool | None,
                    retired_pages: int | None, retired_pending: bool | None, throttle: tuple[str, ...],
                    temperature: int | None, slowdown_temp: int | None, shutdown_temp: int | None,
                    pcie_gen: int | None, pcie_width: int | None, utilization: int | None,
                    persistence: bool | None, ecc_mode: str | None, ecc_pending: str | None,
                    fabric_state: str | None, fabric_status: int | None) -> None:
    """Make a simulated GPU go bad, or well again (the running agent reports it on its next heartbeat).

    \b
    llmgw sim node set-gpu /tmp/node-1 3 --xid 79
    llmgw sim node set-gpu /tmp/node-1 3 --remap-pending --throttle hw_thermal --pcie-width 8
    llmgw sim node set-gpu /tmp/node-1 3 --xid 0 --ecc 0 --nvlink-down 0 --health ok
    """
    from llmgw.sim.gpu_faults import set_gpu

    events = None if not throttle else [] if throttle == ("none",) else list(throttle)
    gpu = set_gpu(directory, index, health=health, ecc=ecc, xid=xid, nvlink_down=nvlink_down,
                  remap_pending=remap_pending, remap_failed=remap_failure, retired_pages=retired_pages,
                  retired_pending=retired_pending, clock_events=events, temperature_c=temperature,
                  slowdown_c=slowdown_temp, shutdown_c=shutdown_temp, pcie_gen=pcie_gen, pcie_width=pcie_width,
                  utilization_pct=utilization, persistence=persistence,
                  ecc_enabled=None if ecc_mode is None else ecc_mode == "on",
                  ecc_pending=None if ecc_pending is None else ecc_pending == "on",
                  fabric_state=None if fabric_state is None else "" if fabric_state == "none" else fabric_state,
                  fabric_status=fabric_status)
    remap = "remap failed" if gpu.remap_failed else "remap pending" if gpu.remap_pending else "no remap pending"
    say(f"GPU {gpu.index} in {directory}: {gpu.health}, {gpu.ecc_uncorrected} uncorrected ECC errors, "
        f"Xid {gpu.xid or 'none'}, {gpu.nvlink_down} NVLink links down, {remap}, "
        f"clock events {', '.join(gpu.clock_events) or 'none'}, {gpu.temperature_c} °C, "
        f"PCIe Gen{gpu.pcie_gen} x{gpu.pcie_width}, persistence {'on' if gpu.persistence else 'off'}, "
        f"ECC {'on' if gpu.ecc_enabled else 'off'} (pending {'on' if gpu.ecc_pending else 'off'})")


@node.command("set-versions")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--driver", help="The NVIDIA driver version NVML reports (550.54.15).")
@click.option("--cuda", help="The CUDA version the driver supports, as nvidia-smi prints it (12.4).")
@click.option("--vbios", help="Every GPU's VBIOS version (96.00.A5.00.1A).")
@click.option("--hca-fw", "hca_fw", help="Every HCA's firmware, as sysfs fw_ver prints it (28.39.1002).")
@click.option("--ofed", help="MLNX_OFED's mlx5_core version (24.10-1.1.4); '' for the in-box driver.")
def set_versions_command(directory: str, driver: str | None, cuda: str | None, vbios: str | None,
                         hca_fw: str | None, ofed: str | None) -> None:
    """Change the versions a simulated node reports (doctor's driver-versions and firmware-versions
    checks). The agent reads them when it registers: restart it, as after a real upgrade.

    \b
    llmgw sim node set-versions /tmp/node-3 --driver 550.90.07 --cuda 12.4
    """
    from llmgw.sim.node_faults import set_versions

    now = set_versions(directory, driver=driver, cuda=cuda, vbios=vbios, hca_fw=hca_fw, ofed=ofed)
    say(f"{directory}: " + ", ".join(f"{key} {value or '-'}" for key, value in now.items()))


@node.command("set-counter")
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("device")
@click.argument("port", type=click.IntRange(min=1))
@click.argument("name")
@click.argument("value", type=click.IntRange(min=0))
def set_counter_command(directory: str, device: str, port: int, name: str, value: int) -> None:
    """Set a simulated port's counter (counters/, counters_ext/ or hw_counters/: out_of_buffer,
    packet_seq_err, symbol_error, ...); the running agent reads it on its next heartbeat.

    \b
    llmgw sim node set-counter /tmp/node-1 mlx5_4 1 packet_seq_err 1200
    """
    from llmgw.sim.node_faults import set_counter

    path = set_counter(directory, device, port, name, value)
    say(f"{device}/{port} {name} = {value} ({path})")


@node.command("set-fabric-manager")
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("state", type=click.Choice(["running", "stopped"]))
def set_fabric_manager_command(directory: str, state: str) -> None:
    """Start or stop a simulated NVSwitch node's fabric manager (nv-fabricmanager); the running
    agent reports it on its next heartbeat, and doctor's fabric-manager check grades it.

    \b
    llmgw sim node set-fabric-manager /tmp/node-1 stopped
    """
    from llmgw.sim.node_faults import set_fabric_manager

    say(f"{directory}: {set_fabric_manager(directory, state == 'running')}")
