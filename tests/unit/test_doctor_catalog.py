"""`ctl doctor --list` and `--only` / `--skip` (issue 39): the list is the registry `run` walks,
every finding carries a listed check id, and a selection runs exactly what it names."""

from __future__ import annotations

import time

import msgspec
import pytest

from llmgw import doctor
from llmgw.doctor import catalog
from llmgw.doctor.cluster import CLUSTER_CHECKS
from llmgw.doctor.facts import ClusterFacts, ModelFacts, ReplicaFacts
from llmgw.doctor.node import NODE_CHECKS
from llmgw.wire import messages as m
from tests.unit.test_doctor_checks import healthy

# The ids of findings that stand for several checks at once: a stale node's readings, and what a
# deadline left unrun (a check's own id when only one was asked for).
PSEUDO = {"(readings)", "(all)"}


def fleet() -> ClusterFacts:
    """Facts that make every check say something, ok or not: a node gone, one fine, one on
    another driver, a failed replica."""
    odd = healthy("gpu-03")
    odd.inventory = msgspec.structs.replace(odd.inventory, gpu_driver="550.90.07")
    return ClusterFacts(nodes=[healthy("gpu-01"), healthy("gpu-02"), odd,
                               healthy("gpu-04", state="lost", connected=False)],
                        models=[ModelFacts(name="llama", replicas=1)],
                        replicas=[ReplicaFacts(id="llama-0", model="llama", state="failed", reason="OOM")])


def findings(**kw: object) -> list[doctor.Finding]:
    return doctor.run(fleet(), clock=time.monotonic, deadline=time.monotonic() + 30, **kw)  # type: ignore[arg-type]


def test_every_check_that_runs_is_listed_with_what_it_reads_and_means() -> None:
    listed = {doc.id: doc for doc in catalog.listing()}
    assert list(listed) == [*NODE_CHECKS, *CLUSTER_CHECKS] == list(doctor.CHECKS)
    for doc in listed.values():
        assert doc.reads and doc.reads != catalog.UNDOCUMENTED, f"{doc.id}: add its words to doctor/catalog.py"
        assert doc.scope in ("node", "cluster")
    ran = {f.check for f in findings()}
    assert ran - PSEUDO <= set(listed), ran - set(listed)
    assert set(listed) <= ran  # and this fleet does run every one of them
    assert {"driver-versions", "firmware-versions"} <= ran
    assert [d.id for d in catalog.listing() if d.needs_server] == ["agent", "clock"]


def test_a_new_check_without_words_is_listed_as_undocumented(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(NODE_CHECKS, "new-check", lambda n, ctx: [])
    [doc] = [d for d in catalog.listing() if d.id == "new-check"]
    assert doc.reads == catalog.UNDOCUMENTED  # which the test above refuses


def test_only_and_skip_select_what_runs() -> None:
    assert catalog.select() is None
    assert catalog.select(["clock,cert"]) == {"clock", "cert"}
    assert catalog.select(["clock", "cert"], ["cert"]) == {"clock"}
    assert catalog.select([], ["clock", "driver-versions,firmware-versions"]) == set(doctor.CHECKS) - {
        "clock", "driver-versions", "firmware-versions"}
    only = {f.check for f in findings(checks=catalog.select(["ports,driver-versions"]))} - PSEUDO
    assert only == {"ports", "driver-versions"}
    skipped = {f.check for f in findings(checks=catalog.select([], ["ports", "replicas"]))}
    assert "ports" not in skipped and "replicas" not in skipped and "counters" in skipped
    assert {f.check for f in findings(check="clock", checks=catalog.select(["clock,cert"]))} - PSEUDO == {"clock"}


@pytest.mark.parametrize(("only", "skip", "said"), [
    (["nope"], [], "'nope'"), (["clock,nope2"], [], "'nope2'"), ([], ["bad"], "'bad'"),
    (["clock"], ["clock"], "leave no check"),
])
def test_an_unknown_id_is_refused_naming_it(only: list[str], skip: list[str], said: str) -> None:
    with pytest.raises(catalog.UnknownCheck) as err:
        catalog.select(only, skip)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_every_finding_carries_its_check_in_json() -> None:
    for f in findings():
        assert msgspec.to_builtins(f)["check"] in {*doctor.CHECKS, *PSEUDO}


def test_a_node_too_old_to_report_versions_is_left_out_not_called_odd() -> None:
    old = healthy("gpu-03")
    old.inventory = msgspec.structs.replace(old.inventory, gpu_driver="")
    facts = ClusterFacts(nodes=[healthy("gpu-01"), healthy("gpu-02"), old])
    [f] = CLUSTER_CHECKS["driver-versions"](facts)
    assert f.status.value == "ok"
    assert "NVIDIA driver not reported by gpu-03;" in f.finding


def test_hw_counters_ride_the_wire_and_default_empty() -> None:
    reading = m.PortCounters(device="mlx5_0", port=1, hw_counters={"out_of_buffer": 3})
    again = msgspec.json.decode(msgspec.json.encode(reading), type=m.PortCounters)
    assert again.hw_counters == {"out_of_buffer": 3}
    old = msgspec.json.decode(b'{"device": "mlx5_0", "port": 1}', type=m.PortCounters)
    assert old.hw_counters == {}
