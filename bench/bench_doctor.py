"""`make bench-doctor`: `GET /api/v1/doctor` at 1,000 nodes × 8 GPUs × 8 ports (issue 14: "the
whole run finishes in seconds on a 1,000-node simulated fleet").

The server's two steps, in this process, over a registry that heard two heartbeats from every node:

- the snapshot on the event loop (`DoctorService.facts`), against its baseline measured in the same
  run: building `GET /api/v1/nodes`' views of the same registry, a read the event loop already
  serves. Bar: at most 1× it (doctor adds no longer stall than `ctl nodes` does);
- the checks in the worker thread (`llmgw.doctor.run`), against the same baseline. Bar: under 20×
  it, and the whole run well inside doctor's deadline (server/doctor.py, 5 s);
- the whole report through trio (snapshot, worker, summary), in seconds.
"""

from __future__ import annotations

import argparse
import time

import trio

from llmgw import doctor
from llmgw.server.doctor import DEADLINE, DoctorService
from llmgw.server.reconcile import Reconciler, Settings
from llmgw.server.registry import NodeRegistry
from llmgw.server.views import node_view
from llmgw.wire import messages as m

SNAPSHOT_RATIO_BAR = 1.0
CHECKS_RATIO_BAR = 20.0


def fleet(nodes: int, gpus: int = 8, ports: int = 8) -> NodeRegistry:
    registry = NodeRegistry(heartbeat_interval=5.0)
    devices = [f"mlx5_{d}" for d in range(ports)]
    for i in range(nodes):
        node_id = f"gpu-{i:04d}"
        inventory = m.Inventory(
            gpus=[m.Gpu(index=g, name="NVIDIA H100 80GB HBM3", nvlink={p: 18 for p in range(gpus) if p != g})
                  for g in range(gpus)],
            ports=[m.Port(device=d, port=1, state="ACTIVE", rate_gbps=400.0, sm_lid=1) for d in devices],
            gpu_source="nvml", gpu_driver="550.54.15")
        status = m.FabricStatus(name="ib", devices=devices, usable=True, ports=[f"{d}:1" for d in devices],
                                rate_gbps=400.0)
        registry.register(m.Register(node_id=node_id, version="bench", inventory=inventory, fabric_status=[status],
                                     cert_not_after=1e9 + 90 * 86400), now=0.0, session=i + 1)
        for beat in (1, 2):
            readings = [m.PortCounters(device=d, port=1, state="ACTIVE", rate_gbps=400.0,
                                       counters={"symbol_error": 3, "link_downed": 0, "port_rcv_errors": 0})
                        for d in devices]
            health = [m.GpuHealth(index=g, ecc_uncorrected=0, nvlink_down=0, xid=0) for g in range(gpus)]
            host = m.HostFacts(memlock_bytes=m.MEMLOCK_UNLIMITED, model_cache="/models", cache_free_bytes=500 << 30,
                               cache_total_bytes=1000 << 30)
            registry.heartbeat(node_id, i + 1,
                               m.Heartbeat(sent_at=1e9 + beat * 20.0, ports=readings, gpus=health, host=host),
                               now=beat * 20.0, wall=1e9 + beat * 20.0)
    return registry


def best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    registry = fleet(args.nodes)
    service = DoctorService(registry,
                            Reconciler([], Settings(backoff_initial=1, backoff_max=10, port_range=(20000, 20999))),
                            clock=lambda: 40.0, wall=lambda: 1e9 + 40.0)
    baseline = best(lambda: [node_view(n, 40.0) for n in registry.nodes.values()], args.repeat)
    snapshot = best(service.facts, args.repeat)
    facts = service.facts()
    checks = best(lambda: doctor.run(facts, clock=time.monotonic, deadline=time.monotonic() + 60), args.repeat)
    findings = doctor.run(facts, clock=time.monotonic, deadline=time.monotonic() + 60)
    bad = [f for f in findings if f.status != "ok"]

    async def whole() -> float:
        start = time.perf_counter()
        await service.report()
        return time.perf_counter() - start

    total = trio.run(whole)
    print(f"doctor over {args.nodes} nodes: {len(findings)} findings ({len(bad)} not ok)")
    print(f"baseline: GET /api/v1/nodes views  {baseline * 1000:8.1f} ms")
    ratio = snapshot / baseline
    print(f"snapshot (event loop)              {snapshot * 1000:8.1f} ms  {ratio:5.2f}× baseline  bar ≤ "
          f"{SNAPSHOT_RATIO_BAR:g}×  "
          f"{'ok' if ratio <= SNAPSHOT_RATIO_BAR else 'OVER'}")
    ratio = checks / baseline
    print(f"checks (worker thread)             {checks * 1000:8.1f} ms  {ratio:5.2f}× baseline  bar ≤ "
          f"{CHECKS_RATIO_BAR:g}×  "
          f"{'ok' if ratio <= CHECKS_RATIO_BAR else 'OVER'}")
    print(f"whole report through trio          {total * 1000:8.1f} ms  (deadline {DEADLINE:g} s)")
    if bad:
        raise SystemExit(f"a healthy simulated fleet should be all ok; first: {bad[0]}")


if __name__ == "__main__":
    main()
