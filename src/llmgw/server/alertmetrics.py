"""The gauges an SRE writes the first alerts on (issue 46, item 8): replicas wanted against ready
per model, each certificate's expiry, and the last doctor report and fabric test as numbers.

Read at scrape time from what the server holds; the doctor and fabric-test results are the last
ones run (by `ctl doctor`, Nagios, cron), never run by a scrape. Names follow Prometheus's base
units: expiry and run times are Unix timestamps in seconds (`time() - x`, `x - time()` in a
rule), rates in Gb/s say so in the name. The fabric tests kept are bounded (`MAX_PAIRS`, the
oldest pair dropped first), so a script testing every pair of a large fleet cannot grow /metrics
without end.

    - alert: ReplicasBelowDesired
      expr: llmgw_model_replicas_ready < llmgw_model_replicas_desired
      for: 10m
    - alert: CertificateExpiresSoon
      expr: llmgw_certificate_expiry_timestamp_seconds - time() < 14 * 86400
    - alert: DoctorCritical
      expr: llmgw_doctor_status >= 2 and time() - llmgw_doctor_last_run_timestamp_seconds < 3600
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.doctor.facts import Report
from llmgw.verdict import Status, exit_code

MAX_PAIRS = 256


class CheckResults:
    """The last full doctor report and the last fabric test of each ordered pair, with when."""

    def __init__(self, wall: Callable[[], float]) -> None:
        self.wall = wall
        self.doctor: tuple[float, Report] | None = None
        self.fabric_tests: OrderedDict[tuple[str, str], tuple[float, dict[str, Any]]] = OrderedDict()

    def doctor_done(self, report: Report) -> None:
        self.doctor = (self.wall(), report)

    def fabric_test_done(self, report: Mapping[str, Any]) -> None:
        pair = (str(report.get("a")), str(report.get("b")))
        self.fabric_tests.pop(pair, None)
        self.fabric_tests[pair] = (self.wall(), dict(report))
        while len(self.fabric_tests) > MAX_PAIRS:
            self.fabric_tests.popitem(last=False)


class AlertCollector(Collector):
    def __init__(self, desired: Callable[[], Mapping[str, int]], replicas: Callable[[], Iterable[Any]],
                 certificates: Callable[[], Iterable[tuple[str, str, float]]], results: CheckResults) -> None:
        self._desired = desired
        self._replicas = replicas
        self._certificates = certificates
        self._results = results

    def collect(self) -> Iterator[Metric]:
        yield from self._models()
        certs = GaugeMetricFamily("llmgw_certificate_expiry_timestamp_seconds",
                                  "When a certificate stops being valid (Unix time): the server's own, and each node's "
                                  "as it presented it.", labels=["kind", "identity"])
        for kind, identity, not_after in self._certificates():
            if not_after > 0:
                certs.add_metric([kind, identity], not_after)
        yield certs
        yield from self._doctor()
        yield from self._fabric_tests()

    def _models(self) -> Iterator[Metric]:
        desired = dict(self._desired())
        by_state: dict[tuple[str, str], int] = {}
        for replica in self._replicas():
            key = (replica.model, str(replica.state))
            by_state[key] = by_state.get(key, 0) + 1
        wanted = GaugeMetricFamily("llmgw_model_replicas_desired", "Replicas the catalog asks for, per model.",
                                   labels=["model"])
        ready = GaugeMetricFamily("llmgw_model_replicas_ready", "Replicas serving (every shard ready), per model.",
                                  labels=["model"])
        states = GaugeMetricFamily("llmgw_model_replicas", "Replicas per model and state (pending, starting, ready, "
                                   "failed, draining, stopping).", labels=["model", "state"])
        for model in sorted(desired):
            wanted.add_metric([model], float(desired[model]))
            ready.add_metric([model], float(by_state.get((model, "ready"), 0)))
        for (model, state), count in sorted(by_state.items()):
            states.add_metric([model, state], float(count))
        yield wanted
        yield ready
        yield states

    def _doctor(self) -> Iterator[Metric]:
        status = GaugeMetricFamily("llmgw_doctor_status", "The last full ctl doctor run's verdict as its Nagios exit "
                                   "code: 0 ok, 1 warning, 2 critical, 3 unknown.")
        findings = GaugeMetricFamily("llmgw_doctor_findings", "The last full ctl doctor run's findings by status.",
                                     labels=["status"])
        when = GaugeMetricFamily("llmgw_doctor_last_run_timestamp_seconds", "When the last full ctl doctor run was "
                                 "(Unix time); no series before the first.")
        if self._results.doctor is not None:
            at, report = self._results.doctor
            status.add_metric([], float(report.exit_code))
            for name in ("ok", "warn", "crit", "unknown"):
                findings.add_metric([name], float(getattr(report.summary, name)))
            when.add_metric([], at)
        yield status
        yield findings
        yield when

    def _fabric_tests(self) -> Iterator[Metric]:
        status = GaugeMetricFamily("llmgw_fabric_test_status", "The last fabric test of each pair (a: client, b: "
                                   "server) as its Nagios exit code: 0 ok, 1 warning, 2 critical.", labels=["a", "b"])
        when = GaugeMetricFamily("llmgw_fabric_test_timestamp_seconds", "When the last fabric test of each pair "
                                 "ended (Unix time).", labels=["a", "b"])
        rails = GaugeMetricFamily("llmgw_fabric_test_rail_gbps", "What each rail measured in the pair's last fabric "
                                  "test, in Gb/s (no series for a rail that failed to run).",
                                  labels=["a", "b", "fabric", "rail"])
        for (a, b), (at, report) in self._results.fabric_tests.items():
            grades = [Status(r["status"]) for r in report.get("rails") or [] if r.get("status") in set(Status)]
            status.add_metric([a, b], float(report.get("exit_code", exit_code(grades))))
            when.add_metric([a, b], at)
            for r in report.get("rails") or []:
                if isinstance(r.get("measured_gbps"), int | float):
                    rails.add_metric([a, b, str(r.get("fabric")), str(r.get("rail"))], float(r["measured_gbps"]))
        yield status
        yield when
        yield rails
