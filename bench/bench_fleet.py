"""`make bench-fleet`: N agent streams against a real `llmgw server` on loopback.

One process (this one) opens N fleet streams (default 1,000), registers them, and sends a
heartbeat on each once a second for 30 s. It prints: the time until all N are `ready`, the
server's CPU seconds per 1,000 heartbeats, and the server's peak RSS. Baseline, measured in
the same run: the CPU this client process spends per 1,000 heartbeats doing the same HTTP/2
framing and JSON encoding, so the server's figure reads as a ratio to bare protocol work.

Bar, a ratio to the same run's baseline (issue 17): server CPU per heartbeat <= 1.2x the
client's (1.04 when it was set); zero failed streams. The time to ready and the peak RSS are
printed as figures.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from benchutil import build, cpu_seconds, free_port
from llmgw import __version__
from llmgw.fleet import ChannelClosed, DialError, dial
from llmgw.wire import messages as m


def proc_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ready_count(public: str) -> int:
    text = httpx.get(f"{public}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('llmgw_nodes{state="ready"}'):
            return int(float(line.split()[-1]))
    return 0


def inventory(i: int) -> m.Inventory:
    return m.Inventory(
        hostname=f"bench-{i:05d}",
        gpus=[m.Gpu(index=g, uuid=f"GPU-{i}-{g}", name="NVIDIA H100 80GB HBM3", memory_mib=81559,
                    nvlink={h: 18 for h in range(8) if h != g}) for g in range(8)],
        ports=[m.Port(device=f"mlx5_{p}", port=1, state="ACTIVE", phys_state="LinkUp", rate_gbps=400,
                      width="4X", speed="NDR") for p in range(4)],
        gpu_source="sim",
    )


class Stats:
    def __init__(self) -> None:
        self.registered = 0
        self.heartbeats = 0
        self.errors: list[str] = []


async def one_node(url: str, i: int, stats: Stats, start_beating: trio.Event, stop: trio.Event,
                   rng: random.Random) -> None:
    try:
        async with dial(url, ssl_context=None, insecure=True, max_message=4 << 20, connect_timeout=30) as ch:
            await ch.send(m.encode(m.Register(node_id=f"bench-{i:05d}", version=__version__, inventory=inventory(i))))
            await ch.receive()  # Welcome
            stats.registered += 1
            # Heartbeat from registration on, as a real agent does (a node that waited for
            # the whole fleet would go unreachable on a slow registration); the measurement
            # window starts once every node is ready.
            await trio.sleep(rng.random())  # spread the fleet over the second
            seq = 0
            ports = [m.PortCounters(device=f"mlx5_{p}", port=1, state="ACTIVE", rate_gbps=400) for p in range(4)]
            gpus = [m.GpuHealth(index=g, temperature_c=40) for g in range(8)]
            next_at = trio.current_time()
            while not stop.is_set():
                seq += 1
                await ch.send(m.encode(m.Heartbeat(seq=seq, ports=ports, gpus=gpus)))
                if seq % 3 == 0:
                    ch.connection.ping()  # as the agent does when the server has been quiet
                stats.heartbeats += 1
                next_at += 1.0
                with trio.move_on_at(next_at):
                    await stop.wait()
    except (DialError, ChannelClosed, OSError) as exc:
        stats.errors.append(str(exc))
    except BaseExceptionGroup as group:
        stats.errors.append(str(group.exceptions[0]))


async def run(n: int, seconds: float, server_pid: int, public: str, fleet: str) -> dict[str, float]:
    stats = Stats()
    start_beating, stop = trio.Event(), trio.Event()
    rng = random.Random(1)
    t0 = time.monotonic()
    cpu_server0 = cpu_seconds(server_pid)
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one_node, fleet, i, stats, start_beating, stop, rng)
            if i % 50 == 49:
                await trio.lowlevel.checkpoint()
        deadline = time.monotonic() + 120
        while True:
            ready = await trio.to_thread.run_sync(ready_count, public)
            if ready >= n:
                break
            if time.monotonic() > deadline or stats.errors:
                stop.set()
                start_beating.set()
                raise SystemExit(f"only {ready} of {n} ready ({stats.registered} registered); errors: "
                                 f"{stats.errors[:3]}")
            await trio.sleep(0.1)
        t_ready = time.monotonic() - t0
        cpu_register = cpu_seconds(server_pid) - cpu_server0
        start_beating.set()
        await trio.sleep(2)  # let the phases spread before measuring
        hb0, cpu0, self0 = stats.heartbeats, cpu_seconds(server_pid), self_cpu()
        await trio.sleep(seconds)
        hb1, cpu1, self1 = stats.heartbeats, cpu_seconds(server_pid), self_cpu()
        stop.set()
    beats = hb1 - hb0
    return {
        "ready_s": t_ready,
        "register_cpu_s": cpu_register,
        "heartbeats": beats,
        "server_cpu_per_1k": (cpu1 - cpu0) / beats * 1000,
        "client_cpu_per_1k": (self1 - self0) / beats * 1000,
        "rss_mb": proc_hwm_mb(server_pid),
        "errors": len(stats.errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nodes", type=int, default=int(os.environ.get("BENCH_NODES", 1000)))
    parser.add_argument("-t", "--seconds", type=float, default=float(os.environ.get("BENCH_SECONDS", 30)))
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * args.nodes + 256)), hard))

    public_port, fleet_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "server.yaml"
        cfg.write_text("fleet:\n  heartbeat_interval: 1s\n  lost_after: 2m\n  register_timeout: 60s\n")
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115
        server = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "server", "--config", str(cfg), "--insecure", "--log-level", "warning",
             "--listen", f"127.0.0.1:{public_port}", "--fleet-listen", f"127.0.0.1:{fleet_port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        public = f"http://127.0.0.1:{public_port}"
        try:
            for _ in range(200):
                try:
                    httpx.get(f"{public}/healthz", timeout=1)
                    break
                except httpx.HTTPError:
                    time.sleep(0.05)
            print(f"bench-fleet: {args.nodes} agent streams, heartbeats 1/s for {args.seconds:g}s, server pid "
                  f"{server.pid}")
            print(f"  {build()}")
            r = trio.run(run, args.nodes, args.seconds, server.pid, public, f"http://127.0.0.1:{fleet_port}")
        finally:
            server.terminate()
            server.wait(timeout=30)
            log.close()
    ratio = r["server_cpu_per_1k"] / r["client_cpu_per_1k"] if r["client_cpu_per_1k"] else float("nan")
    print(f"  all nodes ready in {r['ready_s']:.2f} s; server CPU for registration {r['register_cpu_s']:.2f} s; "
          f"{r['heartbeats']:.0f} heartbeats measured; server peak RSS {r['rss_mb']:.0f} MB (figures, no bars: "
          "absolute times and sizes move 2-3x from day to day on a shared machine)")
    # Each bar is a ratio to a baseline measured in the same run (issue 17).
    rows = [
        ("server CPU per 1,000 heartbeats", f"{r['server_cpu_per_1k']:.3f} s",
         f"{r['client_cpu_per_1k']:.3f} s (client)", f"{ratio:.2f}×", "<= 1.2×", ratio <= 1.2),
        ("failed streams", f"{r['errors']:.0f}", "", "", "0", r["errors"] == 0),
    ]
    print(f"  {'':<32}  {'figure':>10}  {'baseline':>18}  {'ratio':>7}  {'bar':>8}")
    for name, value, baseline, rat, bar, ok in rows:
        print(f"  {name:<32}  {value:>10}  {baseline:>18}  {rat:>7}  {bar:>8}  {'ok' if ok else 'OVER BAR'}")

if __name__ == "__main__":
    main()
