"""The gateway's own counters and histograms (llmgw.server.gateway.metrics: plain dicts, no lock per
increment) render exactly as prometheus_client's Counter and Histogram render the same
observations, `_created` samples aside, so a scrape, the workers' aggregation and every
dashboard read the same series as before."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from llmgw.server.gateway.metrics import LATENCY_BUCKETS, GatewayMetrics

WAITS = [0.0, 0.005, 0.0051, 0.1, 1, 2.5, 599.9, 600, 700, 1e-9]


def text(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_gateway_metrics_render_as_prometheus_client_does() -> None:
    ours = CollectorRegistry()
    metrics = GatewayMetrics(ours)
    ref = CollectorRegistry()
    requests = Counter("llmgw_requests", "Gateway requests by model and HTTP status.", ["model", "code"], registry=ref)
    duration = Histogram("llmgw_request_duration_seconds", "Gateway request duration.", ["model"],
                         buckets=LATENCY_BUCKETS, registry=ref)
    ttft = Histogram("llmgw_time_to_first_token_seconds", "Time to the first streamed token through the gateway.",
                     ["model"],
                     buckets=LATENCY_BUCKETS, registry=ref)
    retries = Counter("llmgw_upstream_retries", "Requests retried on another endpoint, by reason.", ["model", "reason"],
                      registry=ref)
    wait = Histogram("llmgw_admission_wait_seconds", "Time a request waited for an admission slot.", ["model"],
                     buckets=LATENCY_BUCKETS, registry=ref)
    rejected = Counter("llmgw_admission_rejected", "Requests answered 429, by reason.", ["model", "reason"],
                       registry=ref)
    lane = Counter("llmgw_gateway_fast_lane_requests", metrics.fast_lane.documentation, ["model", "outcome"],
                   registry=ref)
    for i, seconds in enumerate(WAITS):
        model, code = ("chat", 200) if i % 3 else ("embed", 429)
        metrics.finished(model, code, seconds)
        requests.labels(model, str(code)).inc()
        duration.labels(model).observe(seconds)
        metrics.admitted(model, seconds)
        wait.labels(model).observe(seconds)
    metrics.first_token("chat", 0.02)
    ttft.labels("chat").observe(0.02)
    metrics.retried("chat", "connect")
    retries.labels("chat", "connect").inc()
    metrics.rejected_for("embed", "queue full")
    rejected.labels("embed", "queue full").inc()
    for outcome in ("answered", "answered", "resumed"):
        metrics.left_fast_lane("chat", outcome)
        lane.labels("chat", outcome).inc()
    assert text(ours) == text(ref)
    assert sum(s.value for m in metrics.requests.collect() for s in m.samples
               if s.name.endswith("_total")) == len(WAITS)
