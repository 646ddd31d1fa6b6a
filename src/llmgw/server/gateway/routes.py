"""The gateway's routing table: per model a Route (balancer, retry budget, admission gate) over
the endpoints that serve it, static (the catalog's) and dynamic (ready replicas, from the
control plane), and one keep-alive connection pool (llmgw.web.client.Upstream) per endpoint."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence

import trio

from llmgw.gwsettings import GatewaySettings, StaticEndpoint
from llmgw.server.gateway.admission_gate import AdmissionGate
from llmgw.server.gateway.balance import Balancer
from llmgw.server.gateway.breaker import Breaker, BreakerState
from llmgw.server.gateway.metrics import GatewayMetrics
from llmgw.server.gateway.retry import RetryBudget
from llmgw.web.client import Upstream
from llmgw.wire.gateway import RouteModel

log = logging.getLogger("llmgw.gateway")


class Route:
    """One model's balancing, retry budget and admission."""

    def __init__(self, name: str, settings: GatewaySettings, policy: str, rng: random.Random,
                 metrics: GatewayMetrics) -> None:
        self.name = name
        self.balancer = Balancer(
            policy,  # type: ignore[arg-type]
            rng=rng,
            load_factor=settings.affinity_load_factor,
            breaker_failures=settings.breaker_failures,
            breaker_cooldown=float(settings.breaker_cooldown),
            kv_cache_limit=settings.kv_cache_limit,
            max_waiting=settings.max_waiting,
            health_failures=settings.health_failures,
            health_probes=settings.health_interval > 0,
        )
        self.budget = RetryBudget(settings.retry_budget)
        self.gate = AdmissionGate(
            on_admit=lambda wait: metrics.admitted(name, wait),
            on_reject=lambda reason: metrics.rejected_for(name, reason),
        )
        self.static: set[str] = set()
        self.dynamic: set[str] = set()


class RouteTable:
    """What the control plane tells the gateway: models, their endpoints, the engine keys."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, rng: random.Random) -> None:
        self.settings = settings
        self.metrics = metrics
        self.rng = rng
        self.routes: dict[str, Route] = {}
        self.upstreams: dict[str, Upstream] = {}
        self.engine_up: dict[str, bool] = {}  # by endpoint, from the last metrics scrape
        self.changed = trio.Event()  # set when endpoints came or went (the scraper looks at once)
        self._bad_endpoints: set[str] = set()

    def configure(self, models: Sequence[RouteModel], static: Sequence[StaticEndpoint],
                  settings: GatewaySettings | None = None) -> None:
        """`models`: the catalog's routing view (llmgw.wire.gateway.route_model), all a gateway is told of it."""
        if settings is not None:
            self.settings = settings
        wanted: dict[str, str] = {m.name: m.balancer for m in models}
        by_name = {m.name: m for m in models}  # dicts, not scans: 3,000 models took 1.5 s scanned
        static_of: dict[str, set[str]] = {}
        for ep in static:
            wanted.setdefault(ep.model, "least-outstanding")
            static_of.setdefault(ep.model, set()).add(ep.url.rstrip("/"))
        for name in list(self.routes):
            if name not in wanted:
                del self.routes[name]
        for name, policy in wanted.items():
            route = self.routes.get(name)
            if route is None:
                route = self.routes[name] = Route(name, self.settings, policy, self.rng, self.metrics)
            route.balancer.policy = policy  # type: ignore[assignment]
            route.balancer.set_health_policy(self.settings.health_failures, self.settings.health_interval > 0)
            model = by_name.get(name)
            if model is not None:
                adm = model.admission
                route.gate.set_limits(limit=adm.max_in_flight, max_queue=adm.max_queue, max_wait=float(adm.max_wait))
            route.static = static_of.get(name, set())
            route.balancer.set_endpoints(route.static | route.dynamic)
        self._prune_upstreams()

    def set_endpoints(self, ready: Mapping[str, Iterable[str]], keys: Mapping[str, str] | None = None) -> None:
        """Endpoints of ready replicas, per model (rank 0 of each), as the control plane sees them,
        and the engine API key of each (sent on every request, health check and scrape)."""
        for endpoint, key in (keys or {}).items():
            if self._usable(endpoint):
                self.upstream(endpoint.rstrip("/")).set_api_key(key)
        changed = False
        for name, route in self.routes.items():
            dynamic = {e.rstrip("/") for e in ready.get(name, ()) if self._usable(e)}
            if dynamic != route.dynamic:
                added, gone = dynamic - route.dynamic, route.dynamic - dynamic
                route.dynamic = dynamic
                route.balancer.set_endpoints(route.static | dynamic)
                for ep in sorted(added):
                    log.info("model %s: endpoint %s in rotation", name, ep)
                for ep in sorted(gone):
                    log.info("model %s: endpoint %s out of rotation", name, ep)
                changed = True
        if changed:
            self._prune_upstreams()
            self.changed.set()

    def _usable(self, endpoint: str) -> bool:
        """An endpoint an agent reported is not trusted blindly: one that is not a valid
        http://host:port URL is left out of rotation (logged once) instead of failing requests."""
        try:
            self.upstream(endpoint.rstrip("/"))
        except ValueError as exc:
            if endpoint not in self._bad_endpoints:
                self._bad_endpoints.add(endpoint)
                log.warning("engine endpoint %r left out of rotation: %s", endpoint, exc)
            return False
        return True

    def _prune_upstreams(self) -> None:
        live = self.endpoints()
        for url in list(self.upstreams):
            if url not in live:
                upstream = self.upstreams.pop(url)
                upstream.closed = True
                self.engine_up.pop(url, None)

    def upstream(self, url: str) -> Upstream:
        upstream = self.upstreams.get(url)
        if upstream is None:
            upstream = self.upstreams[url] = Upstream(url, connect_timeout=float(self.settings.connect_timeout))
        return upstream

    def endpoints(self) -> set[str]:
        """Every endpoint in rotation, of any model."""
        return {ep for route in self.routes.values() for ep in route.balancer.endpoints}

    def models_ready(self) -> list[str]:
        return sorted(name for name, route in self.routes.items() if route.balancer.endpoints)

    async def aclose(self) -> None:
        for upstream in list(self.upstreams.values()):
            await upstream.aclose()


def log_breaker(model: str, endpoint: str, before: BreakerState | None, breaker: Breaker) -> None:
    log.log(logging.INFO if breaker.state.label == "closed" else logging.WARNING,
            "model %s: circuit breaker of %s %s → %s%s", model, endpoint,
            before.label if before is not None else "?", breaker.state.label,
            f" ({breaker.reason})" if breaker.reason else "")
