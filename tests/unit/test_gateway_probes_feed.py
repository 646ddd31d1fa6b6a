"""One process per machine probes the engines (issue 42): a server's own workers take its health
checks and scrapes over the gateway feed (GatewayProbes) instead of asking every engine
themselves, and ask them themselves only while their server does not (no feed, or a server that
does not say `probes`). tests/e2e/test_gateway_probes.py counts the probes a real engine gets."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint
from llmgw.server.gateway.worker import Follow, GatewayWorker
from llmgw.server.gwfeed import GatewayFeedService
from llmgw.wire.gateway import (
    EngineHealth,
    EngineLoad,
    EngineScrape,
    GatewayConfig,
    GatewayProbes,
    decode_to_gateway,
    encode,
)

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def test_local_workers_are_told_their_server_probes_and_remote_gateways_not() -> None:
    feed = GatewayFeedService(local_workers=2, api_socket="/state/api.sock")
    feed.publish_config([Model(name="m")], [], GatewaySettings())
    local, remote = decode_to_gateway(feed._local_config), decode_to_gateway(feed._config)
    assert isinstance(local, GatewayConfig) and isinstance(remote, GatewayConfig)
    assert local.probes and not remote.probes  # another machine reaches the engines its own way
    older = decode_to_gateway(b'{"type":"GatewayConfig"}')  # a control plane that does not say: it probes itself
    assert isinstance(older, GatewayConfig) and not older.probes


def test_a_stream_is_sent_each_engines_latest_probe_it_was_not_sent_yet() -> None:
    feed = GatewayFeedService(local_workers=2)
    feed.publish_config([Model(name="m")], [StaticEndpoint(model="m", url=B + "/")], GatewaySettings())
    feed.publish_endpoints({"m": [A]}, {})
    assert feed.probes.since(0) is None
    feed.publish_probe(A, EngineHealth(ok=False, reason="no answer"))
    feed.publish_probe(A, EngineHealth(ok=True))
    feed.publish_probe(B, EngineScrape(load=EngineLoad(running=3)))
    assert feed.probes.since(0) == GatewayProbes(health={A: EngineHealth(ok=True)},
                                                 scrapes={B: EngineScrape(load=EngineLoad(running=3))})
    sent = feed.probes.count
    feed.publish_probe(B, EngineHealth(ok=False, reason="503"))
    feed.publish_probe(A, EngineHealth(ok=False, reason="refused"))
    assert feed.probes.since(sent) == GatewayProbes(health={A: EngineHealth(ok=False, reason="refused"),
                                                            B: EngineHealth(ok=False, reason="503")})
    assert feed.probes.since(feed.probes.count) is None
    # An endpoint gone from rotation is forgotten (the static one stays).
    feed.publish_endpoints({"m": []}, {})
    again = feed.probes.since(0)
    assert again is not None and set(again.health) == {B} and set(again.scrapes) == {B}
    assert feed.probes.since(sent) == GatewayProbes(health={B: EngineHealth(ok=False, reason="503")})


def test_without_local_workers_nothing_is_kept() -> None:
    feed = GatewayFeedService(local_workers=0)
    feed.publish_probe(A, EngineHealth(ok=True))
    assert feed.probes.since(0) is None


class Recording:
    """The feed side of a follower's stream: what the control plane sends on it."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, payload: bytes) -> None:
        self.sent.append(decode_to_gateway(payload))


async def test_only_a_local_workers_stream_carries_probes_a_round_at_a_time(
        autojump_clock: trio.testing.MockClock) -> None:
    feed = GatewayFeedService(local_workers=2)
    feed.publish_config([Model(name="m")], [StaticEndpoint(model="m", url=B)], GatewaySettings())
    feed.publish_endpoints({"m": [A]}, {})
    local, remote = Recording(), Recording()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed._send_loop, local, True)
        nursery.start_soon(feed._send_loop, remote, False)
        await trio.testing.wait_all_tasks_blocked()
        feed.publish_probe(A, EngineHealth(ok=False, reason="refused"))
        await trio.testing.wait_all_tasks_blocked()
        # Within PROBES_EVERY of that message: these wait, and go together.
        feed.publish_probe(A, EngineScrape(load=None, answered=False, error="refused"))
        feed.publish_probe(B, EngineHealth(ok=True))
        await trio.sleep(1)  # ok: autojump MockClock, past PROBES_EVERY
        nursery.cancel_scope.cancel()
    probes = [m for m in local.sent if isinstance(m, GatewayProbes)]
    assert probes == [GatewayProbes(health={A: EngineHealth(ok=False, reason="refused")}),
                      GatewayProbes(health={B: EngineHealth(ok=True)},
                                    scrapes={A: EngineScrape(load=None, answered=False, error="refused")})]
    assert not any(isinstance(m, GatewayProbes) for m in remote.sent) and len(remote.sent) == 2


def worker_with(settings: GatewaySettings, *, local: bool = True) -> GatewayWorker:
    worker = GatewayWorker("worker-0", Follow(unix_path="/nonexistent"), local=local)
    worker._apply(encode(GatewayConfig(models=[Model(name="m")], static=[StaticEndpoint(model="m", url=A)],
                                       settings=settings, probes=local)))
    return worker


async def test_a_worker_takes_its_servers_probes_as_its_own() -> None:
    """Out of rotation after health_failures failed checks (or unanswered scrapes), back on a
    pass; the scrape's load reaches the balancer and engine_up."""
    worker = worker_with(GatewaySettings(health_failures=2))
    balancer = worker.gateway.routes["m"].balancer
    sick = encode(GatewayProbes(health={A: EngineHealth(ok=False, reason="503")}))
    worker._apply(sick)
    assert balancer.healthy(A)
    worker._apply(encode(GatewayProbes(scrapes={A: EngineScrape(load=None, answered=False, error="refused")})))
    assert not balancer.healthy(A)
    assert worker.gateway.engine_up[A] is False
    worker._apply(encode(GatewayProbes(health={A: EngineHealth(ok=True)},
                                       scrapes={A: EngineScrape(load=EngineLoad(running=7, engine="vllm"))})))
    assert balancer.healthy(A) and worker.gateway.engine_up[A] is True
    assert [s.load.running for s in balancer.status() if s.load is not None] == [7]
    # A probe of an endpoint this worker does not route is nothing to it.
    worker._apply(encode(GatewayProbes(scrapes={B: EngineScrape(load=EngineLoad())})))
    assert B not in worker.gateway.engine_up


async def test_a_worker_probes_itself_only_while_its_server_does_not_for_it() -> None:
    def probing(worker: GatewayWorker) -> list[str]:
        running: list[str] = []

        def task(name: str) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                running.append(name)
                try:
                    await trio.sleep_forever()
                finally:
                    running.remove(name)
            return run

        worker.gateway.run_health_checks = task("health")  # type: ignore[method-assign]  # stand-ins that say they run
        worker.gateway.run_scraper = task("scrape")  # type: ignore[method-assign]
        return running

    local = worker_with(GatewaySettings())
    remote = worker_with(GatewaySettings(), local=False)
    running, remote_running = probing(local), probing(remote)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(local.run_probes)
        nursery.start_soon(remote.run_probes)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(running) == ["health", "scrape"]  # not following yet: nobody probes for it
        local._follows(True)
        remote._follows(True)
        await trio.testing.wait_all_tasks_blocked()
        assert running == []  # its server probes, on the feed
        assert sorted(remote_running) == ["health", "scrape"]  # another machine: always its own
        local._follows(False)  # the feed is lost: it asks the engines itself until it follows again
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(running) == ["health", "scrape"]
        local._follows(True)
        await trio.testing.wait_all_tasks_blocked()
        assert running == []
        # A server that stops saying it probes (an older one after an upgrade): the worker does.
        local._apply(encode(GatewayConfig(models=[Model(name="m")], static=[StaticEndpoint(model="m", url=A)])))
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(running) == ["health", "scrape"]
        nursery.cancel_scope.cancel()
