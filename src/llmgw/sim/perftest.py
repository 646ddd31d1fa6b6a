"""The stand-in `ib_write_bw` on a simulated node: a real server/client pair over TCP on loopback.

`llmgw sim node` writes `bin/ib_write_bw`, which runs `python -m llmgw.sim.perftest NODE_DIR ARGS`.
It takes the real tool's options (-d -i -p -s -n -D -x -F --report_gbits --use_cuda=N, the
server's host last on the client) and behaves as perftest does: the server side listens on -p and waits for one client;
the client dials it (refused: `Couldn't connect`, exit 1, as perftest; a server whose port is
taken: `Couldn't listen to port N`, exit 1, as perftest). The two exchange their
device and bandwidth, and both print the table in perftest's format (perftest_parameters.h:
RESULT_LINE, RESULT_FMT_G / RESULT_FMT, REPORT_FMT), measuring the slower of the two adapters.

An adapter's bandwidth is `sim node --bandwidth DEV=GBPS` (perftest.json in the node dir), else 96 %
of what it can carry, read from its sysfs at run time: its rate's data rate (8b/10b up to QDR)
capped by its PCIe link (`sim node set-pcie`), as fabric/linkrate.py computes it: a slow rail, a
port degraded under a running agent or a card in a narrow slot is what the next test measures.

`-D SECONDS` runs that long, as perftest does (so a rail timeout below it kills the run), and
prints perftest's duration table: the warning that the peak is not measured, #iterations the
count moved in that time, BW peak 0.00 (perftest_parameters.c, print_report_bw). `--use_cuda=N`
prints CUDA's initialisation lines for GPU N of the node's gpus.json, or perftest's `No such
device ID (N) exists in system` and exit status 1 where it has no such GPU. Because the figure
needs both sides, a test whose server and client run on the wrong adapters, or never meet, shows
it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from llmgw.fabric import linkrate, sysfs

HEALTHY = 0.96  # of the link rate: what a healthy link measures (real samples: 0.92-0.98)
SETTINGS_FILE = "perftest.json"
RESULT_LINE = "-" * 87
RESULT_FMT = " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]"
RESULT_FMT_G = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
MIB_GBPS = 1048576 * 8 / 1e9


def bandwidth(node_dir: str, device: str, port: int) -> float:
    """The Gb/s this node's `device` moves: the configured figure, else HEALTHY × its sysfs rate."""
    try:
        with open(os.path.join(node_dir, SETTINGS_FILE)) as fh:
            configured = json.load(fh).get("bandwidth_gbps", {})
        if device in configured:
            return float(configured[device])
    except (OSError, ValueError, AttributeError):
        pass
    dev_dir = os.path.join(node_dir, "sys", "class", "infiniband", device)
    try:
        with open(os.path.join(dev_dir, "ports", str(port), "rate")) as fh:
            rate = sysfs.parse_rate(fh.read())
        with open(os.path.join(dev_dir, "ports", str(port), "link_layer")) as fh:
            layer = fh.read().strip()
    except OSError:
        return 0.0
    pci = {name: _read(os.path.join(dev_dir, "device", name)) for name in sysfs.PCIE_FILES}
    carries = linkrate.capacity(rate.gbps, rate.speed, layer,
                                pcie_speed=linkrate.parse_pcie_speed(pci["current_link_speed"]),
                                pcie_width=linkrate.parse_pcie_width(pci["current_link_width"]))
    return round(carries.gbps * HEALTHY, 2)


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _bus(pci_bus_id: object) -> str:
    """"00000000:18:00.0" → "18:00", as perftest prints a CUDA device's PCIe address."""
    parts = str(pci_bus_id).split(":")
    return f"{parts[1].upper()}:{parts[2][:2]}" if len(parts) == 3 else "00:00"


def cuda_lines(node_dir: str, gpu: int) -> list[str] | None:
    """What perftest's cuda_memory.c prints while it opens GPU `gpu`; None: the node has no such GPU."""
    try:
        with open(os.path.join(node_dir, "gpus.json")) as fh:
            gpus = [g for g in json.load(fh).get("gpus", []) if isinstance(g, dict)]
    except (OSError, ValueError, AttributeError):
        gpus = []
    found = next((g for g in gpus if g.get("index") == gpu), None)
    if found is None:
        return None
    lines = ["initializing CUDA", "Listing all CUDA devices in system:"]
    lines += [f"CUDA device {g.get('index')}: PCIe address is {_bus(g.get('pci_bus_id'))}" for g in gpus]
    return [*lines, "", f"Picking device No. {gpu}",
                    f"[pid = {os.getpid()}, dev = {gpu}] device name = [{found.get('name', '')}]",
                    "creating CUDA Ctx", "making it the current CUDA Ctx", "CUDA device integrated: 0",
                    "cuMemAlloc() of a 2097152 bytes GPU buffer", "allocated GPU buffer address at 00007f3dfa600000"]


def parse_args(argv: list[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    takes = {"-d", "-i", "-p", "-s", "-n", "-x", "-D", "-q"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in takes and i + 1 < len(argv):
            opts[arg] = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--") and "=" in arg:
            name, _, given = arg.partition("=")
            opts[name] = given
        elif arg.startswith("-"):
            opts[arg] = ""
        else:
            opts["host"] = arg
        i += 1
    return opts


def header(device: str, gid: str) -> list[str]:
    ethernet = gid != ""
    lines = [RESULT_LINE, "                    RDMA_Write BW Test",
             f" Dual-port       : OFF\t\tDevice         : {device}",
             " Number of qps   : 1\t\tTransport type : IB",
             " Connection type : RC\t\tUsing SRQ      : OFF",
             " TX depth        : 128", " CQ Moderation   : 100", " Mtu             : 4096[B]",
             f" Link type       : {'Ethernet' if ethernet else 'IB'}"]
    if ethernet:
        lines.append(f" GID index       : {gid}")
    lines += [" Max inline data : 0[B]", " rdma_cm QPs\t : OFF", " Data ex. method : Ethernet", RESULT_LINE]
    return lines


def table(size: int, iterations: int, gbps: float, report_gbits: bool, peak: bool = True) -> list[str]:
    value = gbps if report_gbits else gbps / MIB_GBPS
    rate = gbps * 1e9 / 8 / size / 1e6
    top = value if peak else 0.0  # a duration run measures no peak (print_report_bw: noPeak)
    row = f" {size:<7d}    {iterations:<10d}       {top:<7.2f}            {value:<7.2f}\t\t     {rate:<7.6f}"
    return [RESULT_FMT_G if report_gbits else RESULT_FMT, row, RESULT_LINE]


def main(argv: list[str]) -> int:
    node_dir, args = argv[0], parse_args(argv[1:])
    device = args.get("-d", "mlx5_0")
    port = int(args.get("-i", "1") or 1)
    tcp_port = int(args.get("-p", "18515") or 18515)
    size = int(args.get("-s", "65536") or 65536)
    iterations = int(args.get("-n", "5000") or 5000)
    gid = args.get("-x", "")
    duration = int(args.get("-D", "0") or 0)
    gbps = bandwidth(node_dir, device, port)
    mine = {"device": device, "gbps": gbps, "size": size, "iterations": iterations, "duration": duration}
    out = sys.stdout
    if duration:
        out.write(" WARNING: BW peak won't be measured in this run.\n")
    if "--use_cuda" in args:
        gpu = int(args["--use_cuda"]) if args["--use_cuda"].isdigit() else -1
        lines = cuda_lines(node_dir, gpu)
        if lines is None:  # cuda_memory.c, init_gpu
            out.write("initializing CUDA\n")
            sys.stderr.write(f"No such device ID ({args['--use_cuda']}) exists in system\n Couldn't init GPU context\n")
            return 1
        out.write("\n".join(lines) + "\n")
    if "host" not in args:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("0.0.0.0", tcp_port))
        except OSError:  # perftest_communication.c, ethernet_server_connect, then write_bw.c
            sys.stderr.write(f"Couldn't listen to port {tcp_port}\n"
                             " Unable to open file descriptor for socket connection\n"
                             " Unable to init the socket connection\n")
            return 1
        listener.listen(1)
        out.write("\n************************************\n* Waiting for client to connect... *\n"
                  "************************************\n")
        out.flush()
        conn, _ = listener.accept()
        listener.close()
    else:
        try:
            conn = socket.create_connection((args["host"], tcp_port), timeout=10)
        except OSError:
            sys.stderr.write(f"Couldn't connect to {args['host']}:{tcp_port}\n Unable to init the socket connection\n")
            return 1
    with conn:
        conn.sendall((json.dumps(mine) + "\n").encode())
        reader = conn.makefile("r")
        line = reader.readline()
    try:
        peer = json.loads(line)
    except ValueError:
        sys.stderr.write(" Failed to exchange data between server and clients\n")
        return 1
    if (peer.get("size"), peer.get("iterations"), peer.get("duration", 0)) != (size, iterations, duration):
        sys.stderr.write(" Mismatch in size or iterations between client and server\n")
        return 1
    measured = min(gbps, float(peer.get("gbps", 0.0)))
    if duration:
        time.sleep(duration)  # perftest runs the test that long (run_iter_bw under an alarm)
        iterations = int(measured * 1e9 / 8 / size * duration)
    lines = header(device, gid)
    lines += [" local address: LID 0x01 QPN 0x004a PSN 0xbe352e RKey 0x1fff00 VAddr 0x007e6f4ed11000",
              " remote address: LID 0x02 QPN 0x0049 PSN 0x4601da RKey 0x1fff00 VAddr 0x007778e64eb000", RESULT_LINE]
    lines += table(size, iterations, measured, "--report_gbits" in args, peak=not duration)
    out.write("\n".join(lines) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
