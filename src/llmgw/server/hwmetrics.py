"""The fleet's hardware on /metrics: each RDMA port's state, rate and counters, NVLink peers per
GPU, and whether a node's GPU topology is known at all. Read from the registry at scrape time
(heartbeats cost nothing here).

Port counters are Prometheus counters (`llmgw_ib_port_counter_total`), so `rate()` works on
them: the kernel's counters only grow (until the HCA resets, which `rate()` handles). A
counter the port cannot read (`N/A (no PMA)`) has no series, not a zero.

`llmgw_gpu_nvlink_peers` is 0 both on a PCIe box and on a node whose NVLink topology nobody
could read; `llmgw_node_nvml_available` tells them apart (0: no NVML, topology unknown).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.server.registry import Node

# A counter's label is a sysfs file name; anything else a node sends is not exported. With the
# caps (fleet.max_ports ports, 64 counters a port: fleet/limits.py) a node's series are bounded.
_COUNTER_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")

# Sources that stand for NVML: NVML itself, and the simulated inventory that plays it.
TOPOLOGY_SOURCES = frozenset({"nvml", "sim"})


class HardwareCollector(Collector):
    def __init__(self, nodes: Callable[[], Iterable[Node]]) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily("llmgw_ib_port_active", "1 when the RDMA port's state is ACTIVE (latest heartbeat).",
                                   labels=["node", "device", "port"])
        rate = GaugeMetricFamily("llmgw_ib_port_rate_gbps", "The RDMA port's link rate in Gb/s (latest heartbeat).",
                                 labels=["node", "device", "port"])
        counter = CounterMetricFamily("llmgw_ib_port_counter", "The RDMA port's sysfs counters (counters/ and "
                                      "counters_ext/, by file name; data counters count 4-byte words).",
                                      labels=["node", "device", "port", "counter"])
        peers = GaugeMetricFamily("llmgw_gpu_nvlink_peers", "GPUs this GPU reaches over NVLink (0 is 'none' only where "
                                  "llmgw_node_nvml_available is 1).", labels=["node", "gpu"])
        nvml = GaugeMetricFamily("llmgw_node_nvml_available", "1 when the node's GPUs and NVLink topology came from NVML "
                                 "(or the simulated inventory standing in for it); 0: topology unknown.", labels=["node"])
        for node in sorted(self._nodes(), key=lambda n: n.id):
            if node.state == "lost":
                continue
            nvml.add_metric([node.id], 1.0 if node.inventory.gpu_source in TOPOLOGY_SOURCES else 0.0)
            for gpu in node.inventory.gpus:
                peers.add_metric([node.id, str(gpu.index)], float(sum(1 for n in gpu.nvlink.values() if n > 0)))
            for reading in node.ports.values():
                labels = [node.id, reading.device, str(reading.port)]
                active.add_metric(labels, 1.0 if reading.state.upper() == "ACTIVE" else 0.0)
                rate.add_metric(labels, reading.rate_gbps)
                for name, value in sorted(reading.counters.items()):
                    if value is not None and _COUNTER_NAME.match(name):
                        counter.add_metric([*labels, name], float(value))
        yield active
        yield rate
        yield counter
        yield peers
        yield nvml
