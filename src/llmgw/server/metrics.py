"""Prometheus metrics of one server instance (its own registry, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class _NodeStates(Collector):
    """llmgw_nodes{state}: counted at scrape time, so heartbeats cost nothing here."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("llmgw_nodes", "Nodes by state.", labels=["state"])
        for state, value in self._counts().items():
            family.add_metric([state], value)
        yield family


class ServerMetrics:
    def __init__(self, node_counts: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_NodeStates(node_counts))
        self.fleet_messages = Counter(
            "llmgw_fleet_messages", "Fleet messages received, by type.", ["type"], registry=self.registry
        )
        self.fleet_refused = Counter(
            "llmgw_fleet_refused",
            "Fleet connections or streams refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self._message_children: dict[str, Counter] = {}

    def count_message(self, kind: str) -> None:
        child = self._message_children.get(kind)
        if child is None:
            child = self._message_children[kind] = self.fleet_messages.labels(kind)
        child.inc()

    def count_refused(self, reason: str) -> None:
        self.fleet_refused.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
