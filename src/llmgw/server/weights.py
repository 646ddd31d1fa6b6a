"""What the server knows of weight downloads (issue 12): the latest Progress of each starting
shard, for `ctl replicas` and `GET /api/v1/replicas`, and the two counters of /metrics.

Progress is not a state: it never touches the reconciler (a download's bytes must not look
like a shard making progress toward ready, or a doomed replica would live for hours), and a
real state change (any ShardStatus of the shard) clears it. A report nobody has refreshed for
STALE seconds (the node went quiet) is no longer shown.

Counters: `llmgw_weights_bytes_total{node}` adds up, per node and source, the growth of the
agent's `fetched` (bytes it received over the network; one source's figure arrives once per
waiting shard, so the growth is counted, not the reports); `llmgw_weights_fetch_failures_total
{node,reason}` counts the reports that carry a failure, by a reason from a closed set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from llmgw.wire import messages as m

STALE = 15.0  # seconds after its last report that a download is no longer shown
MAX_PROGRESS = 4096  # shards with a download shown at once; beyond, the oldest reports go
MAX_SOURCES_PER_NODE = 64  # sources whose byte counts are remembered per node (LRU)
MAX_SOURCE = 2048  # characters of a source kept (a node could send megabytes of one)
# The agent's reasons (llmgw.agent.fetch.Reason); anything else counts as "other".
REASONS = frozenset({"http", "network", "checksum", "length", "disk", "timeout", "source", "redirect"})


class ProgressView(msgspec.Struct, kw_only=True):
    """A replica's download as `GET /api/v1/replicas` and `ctl replicas -o json` show it."""

    source: str
    bytes: int
    total: int | None  # None: the file server sent no length; `bytes` is "so far"
    rate: float  # bytes per second, as the agent measured it over its last report interval
    node: str
    shard_id: str


class _Entry(msgspec.Struct):
    view: ProgressView
    at: float


class WeightsBoard(Collector):
    def __init__(self) -> None:
        self._progress: OrderedDict[str, _Entry] = OrderedDict()  # shard id -> latest report
        self._fetched: dict[str, OrderedDict[str, int]] = {}  # node -> source -> last `fetched`
        self.bytes_total: dict[str, int] = {}
        self.failures: dict[tuple[str, str], int] = {}

    def update(self, node_id: str, msg: m.Progress, now: float) -> None:
        """A Progress the reconciler accepted (a known shard of this node)."""
        if msg.failure:
            reason = msg.failure if msg.failure in REASONS else "other"
            self.failures[(node_id, reason)] = self.failures.get((node_id, reason), 0) + 1
        source = msg.source[:MAX_SOURCE]
        self._count_bytes(node_id, source, max(msg.fetched, 0))
        if msg.failure:
            return  # the failed ShardStatus follows; nothing is downloading any more
        view = ProgressView(source=source, bytes=max(msg.done_bytes, 0),
                            total=msg.total_bytes if msg.total_bytes is not None and msg.total_bytes >= 0 else None,
                            rate=max(float(msg.rate), 0.0), node=node_id, shard_id=msg.shard_id)
        self._progress[msg.shard_id] = _Entry(view, now)
        self._progress.move_to_end(msg.shard_id)
        while len(self._progress) > MAX_PROGRESS:
            self._progress.popitem(last=False)

    def _count_bytes(self, node_id: str, source: str, fetched: int) -> None:
        sources = self._fetched.setdefault(node_id, OrderedDict())
        last = sources.get(source)
        # Smaller than before: the agent restarted and counts from zero again.
        grew = fetched if last is None or fetched < last else fetched - last
        sources[source] = fetched
        sources.move_to_end(source)
        while len(sources) > MAX_SOURCES_PER_NODE:
            sources.popitem(last=False)
        if grew:
            self.bytes_total[node_id] = self.bytes_total.get(node_id, 0) + grew

    def clear(self, shard_id: str) -> None:
        """The shard changed state (launched, failed, stopped): its download is over."""
        self._progress.pop(shard_id, None)

    def of(self, shard_ids: Iterator[str] | list[str], now: float) -> ProgressView | None:
        """The freshest download among these shards, if one reported within STALE seconds."""
        best: _Entry | None = None
        for shard_id in shard_ids:
            entry = self._progress.get(shard_id)
            if entry is not None and now - entry.at <= STALE and (best is None or entry.at > best.at):
                best = entry
        return best.view if best is not None else None

    def collect(self) -> Iterator[CounterMetricFamily]:
        fetched = CounterMetricFamily("llmgw_weights_bytes", "Weight bytes agents fetched over the network, by node.",
                                      labels=["node"])
        for node, value in sorted(self.bytes_total.items()):
            fetched.add_metric([node], value)
        failures = CounterMetricFamily("llmgw_weights_fetch_failures",
                                       "Weight downloads that failed, by node and reason.", labels=["node", "reason"])
        for (node, reason), value in sorted(self.failures.items()):
            failures.add_metric([node, reason], value)
        yield fetched
        yield failures
