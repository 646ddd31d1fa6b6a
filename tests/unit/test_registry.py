"""Node liveness: ready → unreachable → lost → ready, with time as a parameter."""

from __future__ import annotations

from llmgw.server.registry import NodeRegistry
from llmgw.wire.messages import Heartbeat, Register


def reg(node: str = "gpu-01") -> Register:
    return Register(node_id=node, version="0.1.0")


def test_full_lifecycle() -> None:
    r = NodeRegistry(heartbeat_interval=5, unreachable_after=3, lost_after=120)
    s = r.new_session()
    t, replaced = r.register(reg(), now=0, session=s)
    assert t is not None and (t.old, t.new) == (None, "ready") and replaced is None
    assert r.heartbeat("gpu-01", s, Heartbeat(seq=1), now=5) is None
    assert r.tick(now=19.9) == []  # 14.9 s of silence < 15 s
    [t] = r.tick(now=20.1)
    assert (t.old, t.new) == ("ready", "unreachable") and "no heartbeat" in t.reason
    assert r.tick(now=20.1 + 119) == []
    [t] = r.tick(now=20.1 + 120)
    assert (t.old, t.new) == ("unreachable", "lost")
    s2 = r.new_session()
    t, _ = r.register(reg(), now=500, session=s2)
    assert t is not None and (t.old, t.new) == ("lost", "ready")
    assert r.counts() == {"ready": 1, "unreachable": 0, "lost": 0}


def test_disconnect_makes_unreachable_at_once() -> None:
    r = NodeRegistry(heartbeat_interval=5)
    s = r.new_session()
    r.register(reg(), now=0, session=s)
    t = r.disconnect("gpu-01", s, now=1, reason="connection closed by peer")
    assert t is not None and t.new == "unreachable" and "connection closed" in t.reason


def test_replaced_session_closing_does_not_mark_node() -> None:
    r = NodeRegistry(heartbeat_interval=5)
    old, new = r.new_session(), r.new_session()
    r.register(reg(), now=0, session=old)
    t, replaced = r.register(reg(), now=1, session=new)
    assert t is None and replaced == old  # already ready; the old stream is being replaced
    assert r.disconnect("gpu-01", old, now=2, reason="replaced") is None
    assert r.heartbeat("gpu-01", old, Heartbeat(), now=3) is None  # stale session ignored
    assert r.get("gpu-01").session == new and r.get("gpu-01").state == "ready"


def test_heartbeat_revives_unreachable() -> None:
    r = NodeRegistry(heartbeat_interval=1, unreachable_after=3)
    s = r.new_session()
    r.register(reg(), now=0, session=s)
    [t] = r.tick(now=3.5)
    assert t.new == "unreachable"
    t = r.heartbeat("gpu-01", s, Heartbeat(seq=2), now=4)
    assert t is not None and t.new == "ready"


def test_port_changes_name_each_port_whose_state_moved() -> None:
    from llmgw.server.registry import PortChange, port_changes
    from llmgw.wire.messages import PortCounters

    def ports(**states: str) -> dict[str, PortCounters]:
        return {f"{dev}/1": PortCounters(device=dev, port=1, state=st, phys_state="LinkUp")
                for dev, st in states.items()}

    before = ports(mlx5_0="ACTIVE", mlx5_1="ACTIVE", mlx5_2="ACTIVE")
    after = ports(mlx5_0="INIT", mlx5_1="ACTIVE", mlx5_3="ACTIVE")  # mlx5_2 gone, mlx5_3 new: no state change
    assert port_changes(before, after) == [PortChange("mlx5_0/1", "ACTIVE", "INIT", "LinkUp")]
    assert port_changes(after, after) == []
