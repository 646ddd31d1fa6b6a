"""The alert gauges (llmgw.server.alertmetrics): counted right, and bounded however many pairs are tested."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.doctor.facts import Finding, report
from llmgw.server.alertmetrics import MAX_PAIRS, AlertCollector, CheckResults
from llmgw.verdict import Status


def samples(results: CheckResults, replicas=(), desired=None, certs=()) -> dict[str, list[tuple[dict, float]]]:
    registry = CollectorRegistry()
    registry.register(AlertCollector(lambda: desired or {}, lambda: replicas, lambda: certs, results))
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_replicas_desired_ready_and_by_state():
    replicas = [SimpleNamespace(model="chat", state=s) for s in ("ready", "ready", "starting")]
    got = samples(CheckResults(lambda: 0.0), replicas, {"chat": 3, "cold": 1})
    assert got["llmgw_model_replicas_desired"] == [({"model": "chat"}, 3.0), ({"model": "cold"}, 1.0)]
    assert got["llmgw_model_replicas_ready"] == [({"model": "chat"}, 2.0), ({"model": "cold"}, 0.0)]
    assert ({"model": "chat", "state": "starting"}, 1.0) in got["llmgw_model_replicas"]


def test_no_doctor_series_before_a_run_then_the_last_run():
    results = CheckResults(lambda: 1234.0)
    assert "llmgw_doctor_status" not in samples(results)
    results.doctor_done(report([Finding(node="n", check="ports", status=Status.CRIT, finding="x")], nodes=1))
    got = samples(results)
    assert got["llmgw_doctor_status"] == [({}, 2.0)]
    assert got["llmgw_doctor_last_run_timestamp_seconds"] == [({}, 1234.0)]
    assert ({"status": "crit"}, 1.0) in got["llmgw_doctor_findings"]


def test_fabric_tests_keep_the_last_of_each_pair_and_at_most_max_pairs():
    results = CheckResults(lambda: 5.0)
    rail = {"fabric": "ib", "rail": 0, "status": "ok", "measured_gbps": 390.5}
    for i in range(MAX_PAIRS + 10):
        results.fabric_test_done({"a": f"n{i}", "b": "m", "exit_code": 0, "rails": [rail]})
    results.fabric_test_done({"a": "n20", "b": "m", "exit_code": 2,
                              "rails": [{**rail, "status": "crit", "measured_gbps": 90}]})
    got = samples(results)
    assert len(got["llmgw_fabric_test_status"]) == MAX_PAIRS
    assert ({"a": "n0", "b": "m"}, 0.0) not in got["llmgw_fabric_test_status"]  # the oldest went first
    assert ({"a": "n20", "b": "m"}, 2.0) in got["llmgw_fabric_test_status"]
    assert ({"a": "n20", "b": "m", "fabric": "ib", "rail": "0"}, 90.0) in got["llmgw_fabric_test_rail_gbps"]


def test_a_certificate_without_an_expiry_has_no_series():
    got = samples(CheckResults(lambda: 0.0), certs=[("node", "gpu-01", 1.9e9), ("node", "old-agent", 0.0)])
    assert got["llmgw_certificate_expiry_timestamp_seconds"] == [({"kind": "node", "identity": "gpu-01"}, 1.9e9)]
