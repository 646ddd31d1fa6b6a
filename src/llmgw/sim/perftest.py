"""The stand-in `ib_write_bw` on a simulated node: a real server/client pair over TCP on loopback.

`llmgw sim node` writes `bin/ib_write_bw`, which runs `python -m llmgw.sim.perftest NODE_DIR ARGS`.
It takes the real tool's options (-d -i -p -s -n -x -F --report_gbits, the server's host last on
the client) and behaves as perftest does: the server side listens on -p and waits for one client;
the client dials it (refused: `Couldn't connect`, exit 1, as perftest; a server whose port is
taken: `Couldn't listen to port N`, exit 1, as perftest). The two exchange their
device and bandwidth, and both print the table in perftest's format (perftest_parameters.h:
RESULT_LINE, RESULT_FMT_G / RESULT_FMT, REPORT_FMT), measuring the slower of the two adapters.

An adapter's bandwidth is `sim node --bandwidth DEV=GBPS` (perftest.json in the node dir), else 96 %
of its sysfs rate read at run time: a slow rail, or a port degraded under a running agent, is what
the next test measures. Because the figure needs both sides, a test whose server and client run
on the wrong adapters, or never meet, shows it.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from llmgw.fabric import sysfs

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
    try:
        with open(os.path.join(node_dir, "sys", "class", "infiniband", device, "ports", str(port), "rate")) as fh:
            return round(sysfs.parse_rate(fh.read()).gbps * HEALTHY, 2)
    except OSError:
        return 0.0


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
        if arg.startswith("-"):
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


def table(size: int, iterations: int, gbps: float, report_gbits: bool) -> list[str]:
    value = gbps if report_gbits else gbps / MIB_GBPS
    rate = gbps * 1e9 / 8 / size / 1e6
    row = f" {size:<7d}    {iterations:<10d}       {value:<7.2f}            {value:<7.2f}\t\t     {rate:<7.6f}"
    return [RESULT_FMT_G if report_gbits else RESULT_FMT, row, RESULT_LINE]


def main(argv: list[str]) -> int:
    node_dir, args = argv[0], parse_args(argv[1:])
    device = args.get("-d", "mlx5_0")
    port = int(args.get("-i", "1") or 1)
    tcp_port = int(args.get("-p", "18515") or 18515)
    size = int(args.get("-s", "65536") or 65536)
    iterations = int(args.get("-n", "5000") or 5000)
    gid = args.get("-x", "")
    gbps = bandwidth(node_dir, device, port)
    mine = {"device": device, "gbps": gbps, "size": size, "iterations": iterations}
    out = sys.stdout
    if "host" not in args:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("0.0.0.0", tcp_port))
        except OSError:  # perftest_communication.c, ethernet_server_connect, then write_bw.c
            sys.stderr.write(f"Couldn't listen to port {tcp_port}\n Unable to open file descriptor for socket connection\n"
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
    if (peer.get("size"), peer.get("iterations")) != (size, iterations):
        sys.stderr.write(" Mismatch in size or iterations between client and server\n")
        return 1
    measured = min(gbps, float(peer.get("gbps", 0.0)))
    lines = header(device, gid)
    lines += [" local address: LID 0x01 QPN 0x004a PSN 0xbe352e RKey 0x1fff00 VAddr 0x007e6f4ed11000",
              " remote address: LID 0x02 QPN 0x0049 PSN 0x4601da RKey 0x1fff00 VAddr 0x007778e64eb000", RESULT_LINE]
    lines += table(size, iterations, measured, "--report_gbits" in args)
    out.write("\n".join(lines) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
