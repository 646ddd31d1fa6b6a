"""Prometheus metrics of one server instance (its own registry, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.server.hwmetrics import HardwareCollector
from llmgw.server.registry import Node, NodeState
from llmgw.wire.messages import AGENT_TYPES


class _NodeStates(Collector):
    """llmgw_nodes{state}: counted at scrape time, so heartbeats cost nothing here."""

    def __init__(self, counts: Callable[[], dict[NodeState, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("llmgw_nodes", "Nodes by state.", labels=["state"])
        for state, value in self._counts().items():
            family.add_metric([state], value)
        yield family


class ServerMetrics:
    def __init__(self, node_counts: Callable[[], dict[NodeState, int]],
                 nodes: Callable[[], Iterable[Node]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_NodeStates(node_counts))
        if nodes is not None:
            self.registry.register(HardwareCollector(nodes))
        self.fleet_messages = Counter(
            "llmgw_fleet_messages", "Fleet messages received, by type.", ["type"], registry=self.registry
        )
        self.fleet_refused = Counter(
            "llmgw_fleet_refused",
            "Fleet connections or streams refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.auth_failures = Counter(
            "llmgw_auth_failures",
            "Public-port requests refused for a missing or wrong credential, by door (client, viewer, operator).",
            ["door"],
            registry=self.registry,
        )
        self.fleet_dropped = Counter(
            "llmgw_fleet_dropped",
            "Fleet messages dropped unprocessed (over a rate limit), by reason.",
            ["reason"],
            registry=self.registry,
        )
        self._message_children: dict[str, Counter] = {}

    def count_message(self, kind: str) -> None:
        """By type, from a closed set: a type this server does not know counts as "unknown"
        (a peer choosing label values could grow /metrics without bound: 20,000 made-up types
        took it from 6.5 KB to 2.3 MB)."""
        if kind not in AGENT_TYPES:
            kind = "unknown"
        child = self._message_children.get(kind)
        if child is None:
            child = self._message_children[kind] = self.fleet_messages.labels(kind)
        child.inc()

    def count_refused(self, reason: str) -> None:
        self.fleet_refused.labels(reason).inc()

    def count_auth_failure(self, door: str) -> None:
        self.auth_failures.labels(door).inc()

    def count_dropped(self, reason: str) -> None:
        self.fleet_dropped.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
