"""The gateway feed's state (llmgw.server.gwfeed): what a local worker and a remote gateway are
sent, and /metrics' merge of every follower's metrics under a `worker` label."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, Counter, generate_latest

from llmgw.catalog.schema import Admission, GatewaySettings, Model
from llmgw.server.gwfeed import (
    BEHIND_AFTER,
    Follower,
    GatewayFeedService,
    WorkerMetrics,
    divide_admission,
)
from llmgw.wire.gateway import (
    GatewayConfig,
    GatewayEndpoints,
    GatewayStats,
    config_digest,
    decode_from_gateway,
    decode_to_gateway,
)


def test_admission_is_divided_among_local_workers_rounded_up() -> None:
    model = Model(name="m", admission=Admission(max_in_flight=5, max_queue=10))
    assert divide_admission(model, 2).admission.max_in_flight == 3
    assert divide_admission(model, 2).admission.max_queue == 5
    assert divide_admission(model, 8).admission.max_in_flight == 1  # never 0, which means unlimited
    assert divide_admission(model, 1) is model
    unlimited = Model(name="u")
    assert divide_admission(unlimited, 4).admission.max_in_flight == 0


def test_local_workers_get_their_share_and_remote_gateways_the_catalog() -> None:
    feed = GatewayFeedService(local_workers=4, api_socket="/state/api.sock")
    models = [Model(name="m", admission=Admission(max_in_flight=8))]
    feed.publish_config(models, [], GatewaySettings(max_attempts=2))
    local = decode_to_gateway(feed._local_config)
    remote = decode_to_gateway(feed._config)
    assert isinstance(local, GatewayConfig) and isinstance(remote, GatewayConfig)
    assert local.models[0].admission.max_in_flight == 2 and local.api_url == "/state/api.sock"
    assert remote.models[0].admission.max_in_flight == 8 and remote.api_url == ""
    assert local.settings.max_attempts == 2
    feed.publish_endpoints({"m": {"http://b:1", "http://a:1"}}, {"http://a:1": "k"})
    endpoints = decode_to_gateway(feed._endpoints)
    assert isinstance(endpoints, GatewayEndpoints)
    assert endpoints.ready == {"m": ["http://a:1", "http://b:1"]} and endpoints.keys == {"http://a:1": "k"}
    # Shutting down: nothing more is published (the followers keep the last state).
    feed.freeze()
    feed.publish_endpoints({}, {})
    assert decode_to_gateway(feed._endpoints) == endpoints


def test_views_say_whether_each_follower_runs_the_config_published_now() -> None:
    """`ctl gateways` CONFIG: a follower reports the digest of the config it applied; a local
    worker's is its share (admission divided, the api socket), a remote gateway's the catalog."""
    feed = GatewayFeedService(local_workers=2, api_socket="/state/api.sock")
    feed.publish_config([Model(name="m")], [], GatewaySettings())
    t0 = feed._config_changed
    local, remote = config_digest(feed._local_config), config_digest(feed._config)
    assert local != remote
    feed.followers[1] = Follower(name="worker-0", peer="local", kind="worker", config=local, last_report=t0)
    feed.followers[2] = Follower(name="edge-1", peer="10.0.0.9:5000", kind="remote", config=remote, last_report=t0)
    feed.followers[3] = Follower(name="worker-1", peer="local", kind="worker")  # no report yet (or too old to say)
    feed.followers[4] = Follower(name="edge-2", peer="10.0.0.8:5000", kind="remote", config=local, last_report=t0)
    states = {v.name: v.config for v in feed.views(now=t0)}
    assert states == {"worker-0": "current", "edge-1": "current", "worker-1": None, "edge-2": "updating"}
    # A reload changes the catalog: "updating" until each reports it, "behind" BEHIND_AFTER later.
    feed.publish_config([Model(name="m"), Model(name="n")], [], GatewaySettings())
    t1 = feed._config_changed
    assert {v.name: v.config for v in feed.views(now=t1 + 1)} == {
        "worker-0": "updating", "edge-1": "updating", "worker-1": None, "edge-2": "updating"}
    feed.followers[1].config = config_digest(feed._local_config)
    feed.followers[2].config = config_digest(feed._config)
    assert {v.name: v.config for v in feed.views(now=t1 + BEHIND_AFTER + 1)} == {
        "worker-0": "current", "edge-1": "current", "worker-1": None, "edge-2": "behind"}
    # Endpoints come and go on every pass: they are not the config.
    feed.publish_endpoints({"m": {"http://a:1"}}, {})
    assert feed.views(now=t1 + BEHIND_AFTER + 1)[0].config == "current"


def test_stats_from_an_older_or_a_newer_gateway_decode() -> None:
    """Mixed versions in a rolling upgrade: a report without `config` reads as not saying."""
    old = decode_from_gateway(b'{"type":"GatewayStats","metrics":"","requests":3}')
    assert isinstance(old, GatewayStats) and old.config == "" and old.requests == 3
    newer = decode_from_gateway(b'{"type":"GatewayStats","metrics":"","config":"ab12","later":1}')
    assert isinstance(newer, GatewayStats) and newer.config == "ab12"


def test_metrics_of_every_follower_in_one_scrape_with_a_worker_label() -> None:
    feed = GatewayFeedService()
    for name, n in (("worker-0", 3), ("worker-1", 5)):
        reg = CollectorRegistry()
        Counter("llmgw_requests", "Gateway requests.", ["model", "code"], registry=reg).labels("m", "200").inc(n)
        feed.followers[id(name)] = Follower(name=name, peer="unknown", metrics=generate_latest(reg).decode())
    own = CollectorRegistry()
    Counter("llmgw_requests", "Gateway requests.", ["model", "code"], registry=own).labels("m", "200").inc(7)
    scrape = CollectorRegistry()
    scrape.register(WorkerMetrics(feed, own))
    text = generate_latest(scrape).decode()
    assert text.count("# TYPE llmgw_requests_total counter") == 1  # one family, not three
    assert 'llmgw_requests_total{code="200",model="m"} 7.0' in text
    assert 'llmgw_requests_total{code="200",model="m",worker="worker-0"} 3.0' in text
    assert 'llmgw_requests_total{code="200",model="m",worker="worker-1"} 5.0' in text
    # A follower whose text does not parse is left out, not the whole scrape.
    feed.followers[0] = Follower(name="bad", peer="unknown", metrics="llmgw_requests_total{ 1 2 3\n")
    assert 'worker="worker-0"' in generate_latest(scrape).decode()
    assert msgspec.json.encode(feed.followers[0])


def test_reasons_travel_for_models_without_a_ready_replica_bounded_and_optional() -> None:
    asked: list[str] = []

    def reason(model: str) -> str:
        asked.append(model)
        return "r1 pending (no placement: " + "x" * 2000 + ")" if model == "cold" else ""

    feed = GatewayFeedService(not_ready_reason=reason)
    feed.publish_config([Model(name="warm"), Model(name="cold"), Model(name="quiet")], [], GatewaySettings())
    feed.publish_endpoints({"warm": {"http://a:1"}}, {})
    endpoints = decode_to_gateway(feed._endpoints)
    assert isinstance(endpoints, GatewayEndpoints)
    assert asked == ["cold", "quiet"]  # a model with a ready replica needs no reason
    assert list(endpoints.reasons) == ["cold"] and len(endpoints.reasons["cold"]) == 500
    # An older control plane sends no reasons: the message still decodes, with none.
    old = msgspec.json.encode({"type": "GatewayEndpoints", "ready": {"warm": ["http://a:1"]}})
    assert decode_to_gateway(old) == GatewayEndpoints(ready={"warm": ["http://a:1"]})


def test_a_resized_pool_gets_admission_divided_by_the_new_count() -> None:
    feed = GatewayFeedService(local_workers=2, api_socket="/state/api.sock")
    feed.publish_config([Model(name="m", admission=Admission(max_in_flight=12, max_queue=6))], [], GatewaySettings())
    woken = feed._changed
    for count, in_flight, queue in ((3, 4, 2), (2, 6, 3), (5, 3, 2)):
        feed.set_local_workers(count)
        local = decode_to_gateway(feed._local_config)
        assert isinstance(local, GatewayConfig)
        assert (local.models[0].admission.max_in_flight, local.models[0].admission.max_queue) == (in_flight, queue)
        assert woken.is_set()  # every follower's send loop wakes to send its new share
        woken = feed._changed
    remote = decode_to_gateway(feed._config)
    assert isinstance(remote, GatewayConfig) and remote.models[0].admission.max_in_flight == 12  # per remote gateway


def test_a_follower_cannot_forge_the_control_planes_metrics_or_break_the_scrape() -> None:
    """A compromised gateway reports families of the control plane's own (llmgw_nodes) and others:
    they are left out, so the scrape has one `# TYPE` per family (Prometheus refuses a scrape that
    repeats one) and no forged sample; what a gateway really exports still passes."""
    from llmgw.server.metrics import ServerMetrics

    server = ServerMetrics(lambda: {})
    feed = GatewayFeedService()
    server.registry.register(WorkerMetrics(feed))
    real = CollectorRegistry()
    Counter("llmgw_requests", "Gateway requests.", ["model", "code"], registry=real).labels("m", "200").inc(2)
    forged = ('# TYPE llmgw_nodes gauge\nllmgw_nodes{state="ready"} 999\n'
              '# TYPE llmgw_fleet_refused counter\nllmgw_fleet_refused_total{reason="x"} 1\n# TYPE up gauge\nup 0\n')
    feed.followers[1] = Follower(name="gw-evil", peer="unknown", metrics=forged + generate_latest(real).decode())
    text = server.render().decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), types
    assert "999" not in text and 'worker="gw-evil"} 0' not in text and "up{" not in text
    assert 'llmgw_requests_total{code="200",model="m",worker="gw-evil"} 2.0' in text


def test_every_family_a_real_gateway_exports_reaches_the_scrape() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from llmgw.server.gateway.worker import Follow, GatewayWorker
    from llmgw.server.gwfeed import GATEWAY_FAMILIES

    worker = GatewayWorker("worker-0", Follow(unix_path="/nonexistent"), local=True)
    exported = {f.name for f in text_string_to_metric_families(generate_latest(worker.registry).decode())}
    assert exported - GATEWAY_FAMILIES == set(), "add the new family to gwfeed.GATEWAY_METRICS"


async def test_every_series_a_real_gateway_exports_is_admitted_with_its_labels() -> None:
    """Each family with samples (traffic of every kind, an endpoint in rotation): none refused, so
    the allowlist's types and labels are a real gateway's (gwfeed.GATEWAY_METRICS)."""
    from prometheus_client.parser import text_string_to_metric_families

    from llmgw.catalog.schema import StaticEndpoint
    from llmgw.server.gateway.worker import Follow, GatewayWorker
    from llmgw.server.gwfeed import GATEWAY_METRICS, admit_report

    worker = GatewayWorker("worker-0", Follow(unix_path="/nonexistent"), local=True)
    worker.gateway.configure([Model(name="m")], [StaticEndpoint(model="m", url="http://127.0.0.1:9")])
    m = worker.metrics
    m.finished("m", 200, 0.1), m.first_token("m", 0.1), m.retried("m", "connect"), m.admitted("m", 0.1)
    m.left_fast_lane("m", "answered"), m.rejected_for("m", "queue_full"), worker.updates.inc()
    families = list(text_string_to_metric_families(generate_latest(worker.registry).decode()))
    assert {f.name for f in families if f.samples} == set(GATEWAY_METRICS)
    admitted = admit_report(families, cap=10_000)
    assert admitted.refused == {"family": 0, "labels": 0, "cap": 0}
    assert sum(len(f.samples) for f in admitted.families) == sum(len(f.samples) for f in families)


def test_forged_families_labels_and_series_over_the_cap_are_refused_and_counted() -> None:
    """Issue 40, finding 5: an allowed family with made-up labels, the right name with another
    type, a label value of megabytes, and 20,000 made-up models' series: only the gateway's own,
    up to its cap, reach the scrape; the rest is counted by reason, once per report."""
    feed = GatewayFeedService()
    feed.publish_config([Model(name="m")], [], GatewaySettings())
    cap = feed.series_cap
    assert cap < 20_000
    forged = [
        # wrong type
        '# TYPE llmgw_requests_in_flight_total counter', 'llmgw_requests_in_flight_total{model="m"} 1',
        # a label of its own
        '# TYPE llmgw_engine_up gauge', 'llmgw_engine_up{model="m",endpoint="e",evil="1"} 1',
        'llmgw_engine_up{model="' + "x" * 600 + '",endpoint="e"} 1',  # a value no gateway sends
        '# TYPE llmgw_requests_total counter']
    forged += [f'llmgw_requests_total{{model="forged-{i}",code="200"}} 1' for i in range(20_000)]
    feed.followers[1] = Follower(name="gw-evil", peer="10.0.0.9:1", metrics="\n".join(forged) + "\n")
    scrape = CollectorRegistry()
    collector = WorkerMetrics(feed)
    scrape.register(collector)
    text = generate_latest(scrape).decode()
    assert "evil=" not in text and "x" * 600 not in text and "llmgw_requests_in_flight" not in text
    assert text.count('worker="gw-evil"') == cap + 3  # its series under the cap, and its three refused counts
    assert f'llmgw_gateway_series_refused_total{{reason="cap",worker="gw-evil"}} {20_000 - cap}.0' in text
    assert 'llmgw_gateway_series_refused_total{reason="labels",worker="gw-evil"} 2.0' in text
    assert 'llmgw_gateway_series_refused_total{reason="family",worker="gw-evil"} 1.0' in text
    assert generate_latest(scrape).decode() == text  # the same report is not counted twice


def _big_report() -> str:
    from llmgw.server.gateway.worker import Follow, GatewayWorker

    worker = GatewayWorker("worker-0", Follow(unix_path="/nonexistent"), local=True)
    for i in range(600):  # ~23,000 lines: requests, durations and first tokens of 600 models
        worker.metrics.finished(f"model-{i}", 200, 0.3)
        worker.metrics.first_token(f"model-{i}", 0.1)
    return generate_latest(worker.registry).decode()


async def test_reports_are_parsed_in_steps_that_let_the_event_loop_run() -> None:
    """A big report (a worker with a big catalog, or a compromised gateway's 4 MiB) is parsed a
    step at a time: other tasks run between the steps, and the scrape is the one-go parse's."""
    import trio

    text = _big_report()
    feed = GatewayFeedService()
    feed.publish_config([Model(name=f"model-{i}") for i in range(600)], [], GatewaySettings())  # all under the cap
    feed.followers[1] = Follower(name="worker-0", peer="unknown", metrics=text)
    reference = CollectorRegistry()
    reference.register(WorkerMetrics(feed))
    in_one_go = generate_latest(reference)  # another collector's: what it parses it keeps
    scrape = CollectorRegistry()
    collector = WorkerMetrics(feed)
    scrape.register(collector)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        before = ticks
        await collector.parse_reports()
        nursery.cancel_scope.cancel()
    from llmgw.server.gwfeed import PARSE_STEP

    assert ticks - before >= text.count("\n") // PARSE_STEP - 1 >= 5
    assert collector._parsed[1][0] is text  # the scrape takes these, not a parse of its own
    assert generate_latest(scrape) == in_one_go


def test_a_gateway_is_sent_the_routing_view_of_the_catalog_and_no_secret() -> None:
    """Issue 40, finding 2: profiles (their env: HF_TOKEN) and source URLs (user:pass@, a presigned
    query) stayed in every GatewayConfig. Both configs, a remote gateway's and a local worker's,
    now carry of a model its name, balancer and admission only (tests/abuse/test_gateway_feed.py
    checks the same on a real certificate's stream)."""
    from llmgw.catalog.schema import Profile
    from llmgw.wire.gateway import RouteModel

    model = Model(name="m", source="https://alice:s3cret@hf.example/m?X-Amz-Signature=abc", balancer="prefix-affinity",
                  admission=Admission(max_in_flight=4, max_queue=9),
                  profiles=[Profile(engine="sim", env={"HF_TOKEN": "hf_secret"}, args=["--api-key", "argsecret"])])
    feed = GatewayFeedService(local_workers=2, api_socket="/state/api.sock")
    feed.publish_config([model], [], GatewaySettings())
    for payload in (feed._config, feed._local_config):
        for secret in (b"hf_secret", b"HF_TOKEN", b"s3cret", b"alice", b"Signature", b"argsecret", b"profiles",
                       b"source"):
            assert secret not in payload, (secret, payload)
        config = decode_to_gateway(payload)
        assert isinstance(config, GatewayConfig) and isinstance(config.models[0], RouteModel)
        assert (config.models[0].name, config.models[0].balancer) == ("m", "prefix-affinity")
    remote = decode_to_gateway(feed._config)
    assert isinstance(remote, GatewayConfig) and remote.models[0].admission.max_in_flight == 4
    # An older gateway decodes models as catalog Models (unknown fields refused): the view is a subset.
    from llmgw.catalog.units import dec_hook

    old = msgspec.json.decode(feed._config, type=dict)
    assert msgspec.convert(old["models"][0], Model, dec_hook=dec_hook).admission.max_queue == 9
