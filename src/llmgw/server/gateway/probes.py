"""What the gateway asks engines on its own: active health checks (an endpoint that fails N in a
row goes out of rotation) and /metrics scrapes (load-aware balancing, violations, engine up).

Asking (`run_health_checks`, `run_scraper`) and taking a result (`health_result`,
`scrape_result`) are apart, so that one process per machine asks: a server with gateway workers
probes every engine itself and passes each result (`report`) to its workers over the gateway
feed (GatewayProbes), which take it as their own (llmgw.server.gateway.worker). With N workers
each engine was asked N + 1 times (issue 42)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

import trio

from llmgw.server.gateway.enginemetrics import parse_engine_metrics
from llmgw.server.gateway.routes import RouteTable, log_breaker
from llmgw.web.client import UpstreamError
from llmgw.wire.gateway import MAX_PROBE_REASON, EngineHealth, EngineScrape, GatewayProbes

log = logging.getLogger("llmgw.gateway")

# An engine's /metrics page (or /health answer), at most: vLLM v1's whole page is 46 KB idle (tests/fixtures/real/
# vllm-metrics), SGLang's 10 KB; per-adapter or per-request labels multiply that, not by 100.
SCRAPE_MAX = 4 * 1024 * 1024

# Where else a probe's result goes, besides this gateway's own balancers (the gateway feed:
# llmgw.server.gwfeed.GatewayFeedService.publish_probe).
Report = Callable[[str, EngineHealth | EngineScrape], None]


class EngineProbes:
    """`evict(endpoint, reason)` moves or cuts the requests in flight on an endpoint that just went
    out of rotation, and says how many there were."""

    def __init__(self, table: RouteTable, evict: Callable[[str, str], int]) -> None:
        self.table = table
        self.evict = evict
        self._checking: set[str] = set()  # endpoints whose health check is in flight

    async def run_health_checks(self, report: Report | None = None) -> None:
        """Active health (issue 9: a SIGSTOPped engine stayed in rotation ~11 minutes): every
        health_interval, GET health_path on every endpoint in rotation, at most one check in
        flight per endpoint, each bounded by health_timeout. See `health_result`."""
        async with trio.open_nursery() as nursery:
            next_round = trio.current_time()
            while True:
                interval = float(self.table.settings.health_interval)
                if interval > 0:
                    for ep in sorted(self.table.endpoints()):
                        if ep not in self._checking:
                            self._checking.add(ep)
                            nursery.start_soon(self._check_health, ep, report)
                next_round = max(next_round + (interval or 1.0), trio.current_time())
                await trio.sleep_until(next_round)

    async def _check_health(self, endpoint: str, report: Report | None) -> None:
        settings = self.table.settings
        path = settings.health_path.encode()
        timeout = float(settings.health_timeout)
        ok, reason = False, ""
        try:
            with trio.move_on_after(timeout) as scope:
                try:
                    response = await self.table.upstream(endpoint).request(b"GET", path, [], b"", head_timeout=timeout)
                    try:
                        await response.read(timeout, limit=SCRAPE_MAX)
                    finally:
                        await response.aclose()
                    ok = response.status < 500  # any answer but a server error: alive
                    reason = "" if ok else f"{path.decode()} answered {response.status}"
                except UpstreamError as exc:
                    reason = f"{path.decode()}: {exc}"
            if scope.cancelled_caught:
                reason = f"no answer to {path.decode()} within {timeout:g}s"
        except ValueError as exc:  # not a usable URL (left out of rotation elsewhere)
            reason = str(exc)
        finally:
            self._checking.discard(endpoint)
        self.health_result(endpoint, ok, reason)
        if report is not None:
            report(endpoint, EngineHealth(ok=ok, reason=reason[:MAX_PROBE_REASON]))

    def health_result(self, endpoint: str, ok: bool, reason: str) -> None:
        """Feed a health check (or a metrics scrape that got no answer) to every balancer that
        has the endpoint; when it goes out of rotation, the requests waiting on it are moved
        (those that sent nothing to their client) or cut (streams already relaying)."""
        now = trio.current_time()
        for route in self.table.routes.values():
            if endpoint not in route.balancer:
                continue
            breaker = route.balancer.breaker(endpoint)
            before = breaker.state
            change = route.balancer.health(endpoint, now, ok, reason)
            if breaker.state != before:
                log_breaker(route.name, endpoint, before, breaker)
            if change == "down":
                moved = self.evict(endpoint, f"out of rotation: {reason}")
                log.warning("model %s: endpoint %s out of rotation: %d health checks failed in a row, last: %s; "
                            "%d request(s) in flight on it moved or cut", route.name, endpoint,
                            route.balancer.health_failures, reason, moved)
            elif change == "up":
                log.info("model %s: endpoint %s back in rotation (health check passed)", route.name, endpoint)

    async def run_scraper(self, report: Report | None = None) -> None:
        """Every scrape_interval: each engine's /metrics, for load-aware balancing and violations."""
        table = self.table
        while True:
            endpoints = sorted(table.endpoints())
            if endpoints:
                async with trio.open_nursery() as nursery:
                    for ep in endpoints:
                        nursery.start_soon(self._scrape, ep, report)
            with trio.move_on_after(float(table.settings.scrape_interval)):
                await table.changed.wait()
                await trio.sleep(0.05)
            table.changed = trio.Event()

    async def _scrape(self, endpoint: str, report: Report | None) -> None:
        try:
            scrape = await self._scrape_one(endpoint)
            self.scrape_result(endpoint, scrape)
            if report is not None:
                report(endpoint, scrape)
        except Exception:
            # One engine's odd answer must not stop scraping (and balancing) for every model.
            log.exception("scraping %s failed", endpoint)

    async def _scrape_one(self, endpoint: str) -> EngineScrape:
        table = self.table
        timeout = float(table.settings.scrape_timeout)
        load = None
        error = ""
        answered = False
        with trio.move_on_after(timeout):
            try:
                response = await table.upstream(endpoint).request(b"GET", b"/metrics", [], b"", head_timeout=timeout)
                try:
                    body = await response.read(timeout, limit=SCRAPE_MAX)
                finally:
                    await response.aclose()
                answered = True
                if response.status == 200:
                    load = parse_engine_metrics(body.decode("utf-8", "replace"))
                else:
                    error = f"HTTP {response.status}"
            except UpstreamError as exc:
                error = str(exc)
        if load is None and not error:
            error = f"no answer within {timeout:g}s"
        return EngineScrape(load=load, answered=answered, error=error[:MAX_PROBE_REASON])

    def scrape_result(self, endpoint: str, scrape: EngineScrape) -> None:
        """Feed a scrape to every balancer that has the endpoint (its load; unanswered, a failed
        health check too) and say when the engine's metrics came up or went away."""
        table = self.table
        load, error = scrape.load, scrape.error
        if not any(endpoint in route.balancer for route in table.routes.values()):
            return  # no longer (or not yet) in rotation here: nothing to say of it
        up = load is not None
        if table.engine_up.get(endpoint) != up:
            if up:
                log.info("engine %s metrics: up", endpoint)
            elif endpoint in table.engine_up:
                log.warning("engine %s metrics: unreachable (%s)", endpoint, error)
            else:
                log.info("engine %s metrics: not answering yet (%s)", endpoint, error)
        table.engine_up[endpoint] = up
        if not scrape.answered and table.settings.health_interval > 0:
            self.health_result(endpoint, False, f"metrics scrape: {error}")
        for route in table.routes.values():
            if endpoint in route.balancer:
                route.balancer.update_load(endpoint, load)


T = TypeVar("T")


class LatestProbes:
    """The latest probe of each engine, for followers that take them (a server's own workers: the
    gateway feed's GatewayProbes). Each is kept with `count`, the number of probes added when it
    came, in that order, so that `since(sent)` reads only what is newer than what a stream was sent."""

    def __init__(self) -> None:
        self.count = 0
        self._health: dict[str, tuple[int, EngineHealth]] = {}
        self._scrapes: dict[str, tuple[int, EngineScrape]] = {}

    def add(self, endpoint: str, result: EngineHealth | EngineScrape) -> None:
        self.count += 1
        # Popped first, so that it goes to the end: each dict stays in the order of the counts.
        if isinstance(result, EngineHealth):
            self._health.pop(endpoint, None)
            self._health[endpoint] = (self.count, result)
        else:
            self._scrapes.pop(endpoint, None)
            self._scrapes[endpoint] = (self.count, result)

    def keep(self, endpoints: Iterable[str]) -> None:
        """Forget the engines not in `endpoints` (gone from rotation): memory does not grow with
        every endpoint ever seen. One probed again (a settling server's) comes back with its probe."""
        wanted = set(endpoints)
        for latest in (self._health, self._scrapes):
            for endpoint in [ep for ep in latest if ep not in wanted]:
                del latest[endpoint]

    def since(self, sent: int) -> GatewayProbes | None:
        """Each engine's latest probe added after the first `sent`; None when there is none."""
        if self.count <= sent:
            return None
        health, scrapes = _newer(self._health, sent), _newer(self._scrapes, sent)
        return GatewayProbes(health=health, scrapes=scrapes) if health or scrapes else None


def _newer(latest: dict[str, tuple[int, T]], sent: int) -> dict[str, T]:
    out: dict[str, T] = {}
    for endpoint, (n, result) in reversed(latest.items()):
        if n <= sent:
            break
        out[endpoint] = result
    return out
