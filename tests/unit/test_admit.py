"""admit_register (server/admit.py): each refusal a Register can get, without a stream (issue 42).

The reason codes are the stream's refusal and the label of llmgw_fleet_refused_total: they are
what dashboards and alerts are written on, so they are pinned here word for word."""

from __future__ import annotations

import pytest

from llmgw.server.admit import (
    AdmitRules,
    Admitted,
    Refusal,
    admit_register,
    decide_endpoint_host,
    peer_host,
    refuse_by_count,
)
from llmgw.wire import messages as m
from llmgw.wire.caps import Caps

PEER = "10.0.0.21:51234"


def register(node_id: str = "gpu-01", **kw: object) -> m.Register:
    return m.Register(node_id=node_id, version="1", **kw)  # type: ignore[arg-type]


def spec(shard_id: str = "small-kq7xz.1") -> m.ShardSpec:
    return m.ShardSpec(shard_id=shard_id, replica_id="small-kq7xz", model="small", profile="p", engine="sim")


def refused(msg: m.Register, *, identity: str | None = None, rules: AdmitRules | None = None,
            peer: str = PEER) -> Refusal:
    verdict = admit_register(msg, peer=peer, identity=identity, rules=rules or AdmitRules())
    assert isinstance(verdict, Refusal), verdict
    return verdict


def test_a_plain_register_is_admitted_on_its_advertised_host_or_its_peer() -> None:
    verdict = admit_register(register(advertise_host="gpu-01.example.com"), peer=PEER, identity=None,
                             rules=AdmitRules())
    assert verdict == Admitted(register(advertise_host="gpu-01.example.com"), "gpu-01.example.com")
    verdict = admit_register(register(), peer="[fd00::5]:4000", identity=None, rules=AdmitRules())
    assert isinstance(verdict, Admitted) and verdict.endpoint_host == "fd00::5" and verdict.dropped == ()


def test_over_the_caps_is_too_big_and_its_line_is_throttled() -> None:
    many = register(inventory=m.Inventory(gpus=[m.Gpu(index=i) for i in range(5)]))
    r = refused(many, rules=AdmitRules(caps=Caps(gpus=4)))
    assert (r.reason, r.throttled) == ("too_big", True)
    assert r.message.startswith("the Register reports 5 GPUs (fleet.max_gpus is 4)")
    # quoted: unchecked
    assert r.log_fmt % r.log_args == f"fleet stream from {PEER} (node 'gpu-01') refused: {r.message}"
    shards = register(shards=[m.ShardReport(spec=spec(f"s-{i}.1")) for i in range(3)])
    assert "3 shards (fleet.max_shards is 2)" in refused(shards, rules=AdmitRules(caps=Caps(shards=2))).message
    ports = register(inventory=m.Inventory(ports=[m.Port(device="mlx5_0", port=i) for i in range(3)]))
    assert "3 ports (fleet.max_ports is 2)" in refused(ports, rules=AdmitRules(caps=Caps(ports=2))).message


def test_the_census_refuses_over_the_counted_caps_as_admit_register_would_without_decoding() -> None:
    """A Register over the GPU, port or shard caps is refused from its bytes, before its entries
    are built (issue 41: 100,000 decoded GPUs kept the server's memory), with the same verdict."""
    rules = AdmitRules(caps=Caps(gpus=4, ports=2, shards=2))
    for msg in (
        register(inventory=m.Inventory(gpus=[m.Gpu(index=i, nvlink={1: 2}) for i in range(5)])),
        register(inventory=m.Inventory(ports=[m.Port(device="mlx5_0", port=i) for i in range(3)])),
        register("bad\nid", shards=[m.ShardReport(spec=spec(f"s-{i}.1")) for i in range(3)],
                 inventory=m.Inventory(gpus=[m.Gpu(index=i) for i in range(9)])),
    ):
        assert refuse_by_count(m.encode(msg), peer=PEER, rules=rules) == refused(msg, rules=rules)
    # Within those caps, not a Register, or not even JSON of that shape: the full decode judges.
    nvlink = register(inventory=m.Inventory(gpus=[m.Gpu(index=0, nvlink={i: 1 for i in range(5)})]))
    assert "NVLink peers" in refused(nvlink, rules=rules).message
    for payload in (m.encode(nvlink), m.encode(m.Heartbeat(seq=1)), b"{",
                    b'{"type": "Register", "inventory": {"gpus": [1]}}'):
        assert refuse_by_count(payload, peer=PEER, rules=rules) is None


def test_the_size_check_comes_first_and_quotes_an_id_not_yet_checked() -> None:
    r = refused(register("bad\nid", inventory=m.Inventory(gpus=[m.Gpu(index=i) for i in range(3)])),
                rules=AdmitRules(caps=Caps(gpus=2), require_identity=True))
    assert r.reason == "too_big" and "\n" not in r.log_fmt % r.log_args


@pytest.mark.parametrize("node_id", ["", "-gpu", "gpu 01", "gpu/01", "a" * 254, "gpu\n01"])
def test_a_node_id_that_is_no_host_name_word_is_bad_node_id(node_id: str) -> None:
    r = refused(register(node_id))
    assert (r.reason, r.message, r.throttled) == ("bad_node_id", f"invalid node id {node_id!r}", False)
    assert r.log_fmt % r.log_args == f"fleet stream from {PEER}: invalid node id {node_id!r}; closing"


def test_a_peer_value_is_repeated_at_most_300_characters_long() -> None:
    """A 3.4 MB node id or advertise_host was repeated whole in the answer and the log line (issue 41)."""
    for msg in (register("x" * 3_400_000), register(advertise_host="x" * 3_400_000),
                register("x\n" * 1_700_000, inventory=m.Inventory(gpus=[m.Gpu(index=i) for i in range(300)]))):
        r = refused(msg)
        line = r.log_fmt % r.log_args
        assert "… (3,400,000 characters)" in r.message + line and len(r.message) < 600 and len(line) < 900, line[:2000]
        assert "\n" not in line


def test_a_certificate_for_another_node_is_identity_when_required() -> None:
    rules = AdmitRules(require_identity=True)
    r = refused(register("gpu-01"), identity="gpu-02", rules=rules)
    assert r.reason == "identity"
    assert r.message == "client certificate is for 'gpu-02' but the agent registered as 'gpu-01'"
    assert r.log_fmt % r.log_args == (f"fleet stream from {PEER} refused: certificate common name 'gpu-02' "
                                      "does not match node id 'gpu-01'")
    assert refused(register("gpu-01"), identity=None, rules=rules).reason == "identity"  # no certificate at all
    assert isinstance(admit_register(register("gpu-01"), peer=PEER, identity="gpu-01", rules=rules), Admitted)
    assert isinstance(admit_register(register("gpu-01"), peer=PEER, identity="gpu-02", rules=AdmitRules()), Admitted)


def test_an_address_the_node_does_not_own_is_address() -> None:
    r = refused(register(advertise_host="10.0.0.5"), rules=AdmitRules(endpoint_host="peer"))
    assert r.reason == "address" and "connects from 10.0.0.21" in r.message
    assert r.log_fmt % r.log_args == f"fleet stream from {PEER} (node gpu-01) refused: {r.message}"
    bad = refused(register(advertise_host="not a host!"))
    assert bad.reason == "address" and "is not an IP address or host name" in bad.message
    ok = admit_register(register(advertise_host="10.0.0.21"), peer=PEER, identity=None,
                        rules=AdmitRules(endpoint_host="peer"))
    assert isinstance(ok, Admitted) and ok.endpoint_host == "10.0.0.21"


def test_shard_reports_with_bad_ids_are_left_out_and_named() -> None:
    good = m.ShardReport(spec=spec())
    msg = register(shards=[good, m.ShardReport(spec=spec("../../etc")), good])
    verdict = admit_register(msg, peer=PEER, identity=None, rules=AdmitRules())
    assert isinstance(verdict, Admitted)
    assert verdict.register.shards == [good, good] and verdict.register.node_id == "gpu-01"
    assert len(verdict.dropped) == 1 and verdict.dropped[0]
    clean = register(shards=[good])
    assert admit_register(clean, peer=PEER, identity=None, rules=AdmitRules()) == Admitted(clean, "10.0.0.21")


def test_the_helpers_it_is_made_of() -> None:
    assert peer_host("10.0.0.1:5") == "10.0.0.1" and peer_host("[::1]:5") == "::1" and peer_host("sock") == "sock"
    assert decide_endpoint_host("advertised", " ", "10.0.0.9") == ("10.0.0.9", "")
