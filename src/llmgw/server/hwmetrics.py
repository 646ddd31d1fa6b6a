"""The fleet's hardware on /metrics: each RDMA port's state, rate and counters, NVLink peers per
GPU, and whether a node's GPU topology is known at all. Read from the registry at scrape time
(heartbeats cost nothing here).

Port counters are Prometheus counters (`llmgw_ib_port_data_words_total`, `_packets_total`,
`_errors_total`: data words, packets and error counts apart, issue 38), so `rate()` works on
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

def _label(text: str) -> str:
    """A state word as a label value: what sysfs prints, bounded, "" for nothing."""
    return text if _COUNTER_NAME.match(text) else ("unknown" if text else "")


# Sources that stand for NVML: NVML itself, and the simulated inventory that plays it.
TOPOLOGY_SOURCES = frozenset({"nvml", "sim"})


class HardwareCollector(Collector):
    def __init__(self, nodes: Callable[[], Iterable[Node]]) -> None:
        self._nodes = nodes

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily("llmgw_ib_port_active", "1 when the RDMA port's state is ACTIVE (latest heartbeat); "
                                   "state and phys_state say why not (DOWN/Polling: no cable; INIT/LinkUp: no SM).",
                                   labels=["node", "device", "port", "state", "phys_state"])
        rate = GaugeMetricFamily("llmgw_ib_port_rate_gbps", "The RDMA port's link rate in Gb/s (latest heartbeat).",
                                 labels=["node", "device", "port"])
        # Three families, so a sum() or rate() over one never adds words to errors.
        data = CounterMetricFamily("llmgw_ib_port_data_words", "The RDMA port's data counters (port_xmit_data, "
                                   "port_rcv_data and their _64 forms), in 4-byte words as the HCA counts them.",
                                   labels=["node", "device", "port", "counter"])
        packets = CounterMetricFamily("llmgw_ib_port_packets", "The RDMA port's packet counters (*_packets).",
                                      labels=["node", "device", "port", "counter"])
        errors = CounterMetricFamily("llmgw_ib_port_errors", "The RDMA port's other sysfs counters: errors and "
                                     "congestion (symbol_error, link_downed, port_rcv_errors, port_xmit_wait, ...).",
                                     labels=["node", "device", "port", "counter"])
        hw = CounterMetricFamily("llmgw_rdma_port_hw_counters", "The RDMA port's hw_counters (mlx5: out_of_buffer, "
                                 "packet_seq_err, rnr_nak_retry_err, np_cnp_sent, ...), by file name.",
                                 labels=["node", "device", "port", "counter"])
        peers = GaugeMetricFamily("llmgw_gpu_nvlink_peers", "GPUs this GPU reaches over NVLink (0 is 'none' only where "
                                  "llmgw_node_nvml_available is 1).", labels=["node", "gpu"])
        nvml = GaugeMetricFamily("llmgw_node_nvml_available", "1 when the node's GPUs and NVLink topology came from "
                                 "NVML (or the simulated inventory standing in for it); 0: topology unknown.",
                                 labels=["node"])
        for node in sorted(self._nodes(), key=lambda n: n.id):
            if node.state == "lost":
                continue
            nvml.add_metric([node.id], 1.0 if node.inventory.gpu_source in TOPOLOGY_SOURCES else 0.0)
            for gpu in node.inventory.gpus:
                peers.add_metric([node.id, str(gpu.index)], float(sum(1 for n in gpu.nvlink.values() if n > 0)))
            for reading in node.ports.values():
                labels = [node.id, reading.device, str(reading.port)]
                active.add_metric([*labels, _label(reading.state.upper()), _label(reading.phys_state)],
                                  1.0 if reading.state.upper() == "ACTIVE" else 0.0)
                rate.add_metric(labels, reading.rate_gbps)
                for name, value in sorted(reading.counters.items()):
                    if value is not None and _COUNTER_NAME.match(name):
                        family = (data if name.endswith(("_data", "_data_64"))
                                  else packets if "packets" in name else errors)
                        family.add_metric([*labels, name], float(value))
                for name, value in sorted(reading.hw_counters.items()):
                    if value is not None and _COUNTER_NAME.match(name):
                        hw.add_metric([*labels, name], float(value))
        yield active
        yield rate
        yield data
        yield packets
        yield errors
        yield hw
        yield peers
        yield nvml
