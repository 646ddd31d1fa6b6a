"""The server's view of weight downloads (llmgw.server.weights): shown per shard until a real
state change, counted per node without counting one source's report once per waiting shard."""

from __future__ import annotations

import trio
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.catalog.schema import ReconcileSettings
from llmgw.server.control import Controller, Settle, make_reconciler
from llmgw.server.links import FleetLinks
from llmgw.server.registry import NodeRegistry
from llmgw.server.states import ReplicaState
from llmgw.server.views import replica_view
from llmgw.server.weights import STALE, WeightsBoard
from llmgw.wire import messages as m
from tests.unit.test_reconcile import catalog, nodes, starts

URL = "https://mirror.example/m/model.safetensors"


def progress(shard: str, done: int, fetched: int, total: int | None = 100, failure: str = "") -> m.Progress:
    return m.Progress(shard_id=shard, source=URL, done_bytes=done, total_bytes=total, rate=10.0, fetched=fetched,
                      failure=failure)


def test_the_latest_report_is_shown_until_a_state_change_clears_it() -> None:
    board = WeightsBoard()
    board.update("gpu-01", progress("s1", 10, 10), now=1.0)
    board.update("gpu-01", progress("s1", 40, 40), now=2.0)
    view = board.of(["s1"], now=2.5)
    assert view is not None and (view.bytes, view.total, view.source) == (40, 100, URL)
    board.clear("s1")
    assert board.of(["s1"], now=2.5) is None


def test_a_report_nobody_refreshed_is_no_longer_shown() -> None:
    board = WeightsBoard()
    board.update("gpu-01", progress("s1", 10, 10), now=1.0)
    assert board.of(["s1"], now=1.0 + STALE) is not None
    assert board.of(["s1"], now=1.1 + STALE) is None


def test_no_length_stays_none_never_a_made_up_total() -> None:
    board = WeightsBoard()
    board.update("gpu-01", progress("s1", 10, 10, total=None), now=1.0)
    view = board.of(["s1"], now=1.0)
    assert view is not None and view.total is None


def test_bytes_count_once_however_many_shards_wait_and_across_an_agent_restart() -> None:
    board = WeightsBoard()
    for fetched in (10, 50):
        for shard in ("s1", "s2", "s3"):  # one download, three shards told
            board.update("gpu-01", progress(shard, fetched, fetched), now=1.0)
    assert board.bytes_total == {"gpu-01": 50}
    board.update("gpu-01", progress("s1", 60, 5), now=2.0)  # the agent restarted: its count began again
    assert board.bytes_total == {"gpu-01": 55}


def test_failures_are_counted_by_a_closed_set_of_reasons() -> None:
    board = WeightsBoard()
    board.update("gpu-01", progress("s1", 1, 1, failure="checksum"), now=1.0)
    board.update("gpu-01", progress("s1", 1, 1, failure="made-up-by-a-node"), now=1.0)
    assert board.failures == {("gpu-01", "checksum"): 1, ("gpu-01", "other"): 1}
    assert board.of(["s1"], now=1.0) is None  # a failure report is not a download in progress
    registry = CollectorRegistry()
    registry.register(board)
    text = generate_latest(registry).decode()
    assert 'llmgw_weights_fetch_failures_total{node="gpu-01",reason="checksum"} 1.0' in text
    assert 'llmgw_weights_bytes_total{node="gpu-01"} 1.0' in text


async def test_a_real_state_change_clears_the_download_through_the_control_plane() -> None:
    """Issue 37: e2e's `progress is None` once the replica is ready cannot fail (the view shows
    progress only for a starting replica). Here the shard's state changes while its replica is
    still starting (its engine launched after the download), through the Controller the fleet
    service calls: what the download showed must be gone, and a node's report about a shard
    it does not run must not clear another's."""
    registry = NodeRegistry(1.0)
    board = WeightsBoard()
    controller = Controller(make_reconciler(catalog(small=1, big=0), ReconcileSettings()), registry,
                            settle=Settle(ReconcileSettings(), registry), links=FleetLinks(), weights=board)
    [start] = starts(controller.reconciler.reconcile(nodes("gpu-01"), 0.0))
    shard = start.spec.shard_id
    controller.progress("gpu-01", progress(shard, 40, 40))
    [replica] = controller.reconciler.replicas.values()
    assert replica.state == ReplicaState.STARTING

    def shown() -> object:
        return replica_view(replica, trio.current_time(), weights=board).progress

    assert shown() is not None  # the download is shown while it runs
    controller.shard_status("gpu-02", m.ShardStatus(shard_id=shard, replica_id=start.spec.replica_id, state="failed"))
    assert shown() is not None  # refused: gpu-02 does not run it
    controller.shard_status("gpu-01", m.ShardStatus(shard_id=shard, replica_id=start.spec.replica_id, state="starting"))
    assert replica.state == ReplicaState.STARTING  # still starting, so the view would show a stale download
    assert shown() is None and board.of([shard], 0.0) is None
