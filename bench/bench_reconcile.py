"""`make bench-reconcile`: the reconciler at 1,000 nodes × 8 GPUs × 1,000 models.

The pure core, in this process (no I/O: what the server's control loop runs). It prints:

- the placing pass: every model's replica pending, every one placed (1,000 placements over
  1,000 nodes), its total time and its longest step: the longest the event loop would wait,
  since the driver lets everything else run between steps;
- a steady pass (everything ready, nothing to do), the pass every tick and every fleet message
  triggers, as a ratio to its baseline measured in the same run: one plain Python loop over the
  same replicas and shards (the floor of any level-triggered pass);
- one ShardStatus applied (indexed by shard id), against the same baseline per replica;
- one 4-node placement over the same nodes reading a fabric map (the nodes' own rail-optimised
  fat tree: 8 rails, 3 tiers), beside the same placement without a map: the map's
  cost is one look per candidate per tier, and the placement must stay one step (under the step bar).

Before issue 9 a pass cost models × replicas (3,000 models: 2.3 s stalls; 10,000: 23 s) and
every ShardStatus scanned every replica.

Bars (2-core machine): 99th-percentile placing step < 50 ms; steady pass < 25× the baseline loop;
one ShardStatus < 0.1 ms; a multi-node placement with the map < 50 ms (one step).
"""

from __future__ import annotations

import argparse
import random
import time

from llmgw.catalog.schema import Model, Profile
from llmgw.fabric.analysis import analyse
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.fabric.locality import merge, places
from llmgw.placement import NodeCapacity, Request
from llmgw.placement.multi import place_multi
from llmgw.runtime import settle_garbage_collector
from llmgw.server.reconcile import NodeInfo, Reconciler, Settings, StartShard
from llmgw.sim.fabric import FabricSpec, generate
from llmgw.wire import messages as m

STEP_BAR = 0.050
STEADY_RATIO_BAR = 25.0
STATUS_BAR = 0.0001


def fleet(nodes: int, gpus: int) -> list[NodeInfo]:
    def box() -> list[m.Gpu]:
        return [m.Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_mib=81559,
                      nvlink={j: 18 for j in range(gpus) if j != i}) for i in range(gpus)]

    return [NodeInfo(node_id=f"gpu-{i:04d}", state="ready", gpus=box(), features=[m.FEATURE_START, m.FEATURE_STOP])
            for i in range(nodes)]


def catalog(models: int) -> list[Model]:
    return [Model(name=f"model-{i:04d}", replicas=1, profiles=[Profile(name="tp1", engine="sim", gpus=1)])
            for i in range(models)]


def baseline_loop(rec: Reconciler) -> float:
    """Touch every replica and shard once: what any pass over the same data costs at least."""
    t0 = time.perf_counter()
    count = 0
    for replica in rec.replicas.values():
        if replica.state == "failed":
            count += 1
        for shard in replica.shards:
            if shard.state == "stopping":
                count += 1
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--models", type=int, default=1000)
    args = parser.parse_args()

    nodes = fleet(args.nodes, args.gpus)
    rec = Reconciler(catalog(args.models), Settings(port_range=(20000, 29999)), random.Random(1))
    settle_garbage_collector()  # as the server does once it is configured
    print(f"reconcile: {args.nodes:,} nodes × {args.gpus} GPUs × {args.models:,} models (1 replica each)")

    # The placing pass, step by step, as the server's driver runs it.
    steps: list[float] = []
    starts: list[StartShard] = []
    t0 = last = time.perf_counter()
    for action in rec.steps(nodes, 0.0):
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        if isinstance(action, StartShard):
            starts.append(action)
    placing = time.perf_counter() - t0
    rec.drain_log()
    ordered = sorted(steps)
    longest = ordered[int(len(ordered) * 0.99)]
    print(f"  placing pass: {len(starts):,} placements in {placing:.2f} s "
          f"({placing / max(len(starts), 1) * 1000:.2f} ms each); "
          f"steps: p99 {longest * 1000:.1f} ms (bar {STEP_BAR * 1000:.0f} ms), longest {ordered[-1] * 1000:.1f} ms "
          "(the first includes the pass's setup)")

    for start in starts:
        rec.on_shard_status(start.node, m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                                      state="ready", endpoint=f"http://{start.node}:{start.spec.port}"),
                            1.0)
    rec.drain_log()

    # The steady pass against the baseline loop, best of five each.
    steady = min(_timed(lambda: rec.reconcile(nodes, 2.0)) for _ in range(5))
    base = min(baseline_loop(rec) for _ in range(5))
    ratio = steady / base
    print(f"  steady pass: {steady * 1000:.1f} ms; baseline loop over the same {len(rec.replicas):,} replicas "
          f"{base * 1000:.2f} ms; ratio {ratio:.1f}× (bar {STEADY_RATIO_BAR:.0f}×)")

    # One ShardStatus (indexed by shard id), averaged over every shard.
    t0 = time.perf_counter()
    for start in starts:
        rec.on_shard_status(start.node, m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                                      state="ready"), 3.0)
    per_status = (time.perf_counter() - t0) / max(len(starts), 1)
    print(f"  one ShardStatus: {per_status * 1e6:.1f} µs (bar {STATUS_BAR * 1e6:.0f} µs; "
          f"the baseline loop costs {base / max(len(rec.replicas), 1) * 1e6:.2f} µs per replica)")

    multi = multinode(nodes)
    ok = longest < STEP_BAR and ratio < STEADY_RATIO_BAR and per_status < STATUS_BAR and multi < STEP_BAR
    print("  within the bars" if ok else "  OVER A BAR")


def multinode(nodes: list[NodeInfo]) -> float:
    """One 4-node placement with the fabric map, beside the same without it; returns the former."""
    ids = [n.node_id for n in nodes]
    text = generate(FabricSpec(nodes=ids, rails=8, group_size=32, spines=4, core=4, groups_per_pod=4)).ibnetdiscover
    view = merge({"0xfab": places("0xfab", analyse(parse_topology(text)))})
    capacities = [NodeCapacity(node_id=n.node_id, state="ready", gpus=n.gpus, fabrics=["ib"], address="10.0.0.1")
                  for n in nodes]
    req = Request(replica_id="big-x.1", gpus=8)
    with_map = min(_timed(lambda: place_multi(req, 4, capacities, (20000, 29999), view)) for _ in range(5))
    without = min(_timed(lambda: place_multi(req, 4, capacities, (20000, 29999))) for _ in range(5))
    print(f"  one 4-node placement over {len(nodes):,} nodes reading the fabric map (8 rails, 3 tiers): "
          f"{with_map * 1000:.1f} ms; without a map {without * 1000:.1f} ms; ratio {with_map / without:.1f}× "
          f"(bar {STEP_BAR * 1000:.0f} ms: one step)")
    return with_map


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
