"""The node registry: who is in the fleet and whether we can hear them. Pure; time is a parameter.

ready ──(no heartbeat for N intervals, or the stream closed)──► unreachable
unreachable ──(still unreachable after `lost_after`)──► lost
any ──(a fresh Register)──► ready
"""

from __future__ import annotations

from typing import Literal

import msgspec

from llmgw.wire.messages import (
    FabricDecl,
    Fabrics,
    FabricStatus,
    Heartbeat,
    Inventory,
    PortCounters,
    Register,
)

NodeState = Literal["ready", "unreachable", "lost"]
STATES: tuple[NodeState, ...] = ("ready", "unreachable", "lost")


class Node(msgspec.Struct, kw_only=True):
    id: str
    state: NodeState
    state_since: float
    reason: str = ""
    version: str = ""
    features: list[str] = []
    inventory: Inventory = msgspec.field(default_factory=Inventory)
    # The usable fabrics (what placement reads), replaced whenever the agent says they changed,
    # and every declared fabric's verdict with its reasons (`ctl nodes`).
    fabrics: list[FabricDecl] = []
    fabric_status: list[FabricStatus] = []
    # Each port's latest reading ("mlx5_0/1" → state, rate, counters): from the Register's
    # inventory, then from every heartbeat.
    ports: dict[str, PortCounters] = {}
    address: str = ""
    # The host its engines are reached on, decided by the server (fleet.endpoint_host).
    endpoint_host: str = ""
    identity: str | None = None
    registered_at: float = 0.0
    last_seen: float = 0.0
    last_heartbeat: float | None = None
    heartbeats: int = 0
    session: int = 0
    connected: bool = False
    cert_not_after: float = 0.0
    heartbeat: Heartbeat | None = None
    # Port readings kept for `ctl doctor`'s "error counters rising" (issue 14): (time, readings),
    # oldest first, one every COUNTER_WINDOW / 4 s, at most HISTORY: the oldest is the baseline
    # the latest reading (`ports`) is compared with, so a rise is seen over about a minute.
    port_history: list[tuple[float, dict[str, PortCounters]]] = []
    # The agent's wall clock against the server's (server minus agent, seconds) from its last few
    # heartbeats; the smallest in magnitude is the skew (a late heartbeat only adds to it).
    clock_skews: list[float] = []


COUNTER_WINDOW = 60.0
HISTORY = 5
SKEW_SAMPLES = 4


def port_key(device: str, port: int) -> str:
    return f"{device}/{port}"


class PortChange(msgspec.Struct, frozen=True):
    """A port whose state differs between two readings (`ctl events --node`: INIT, then ACTIVE)."""

    port: str  # "mlx5_1/1"
    old: str
    new: str
    phys_state: str = ""


def port_changes(before: dict[str, PortCounters], after: dict[str, PortCounters]) -> list[PortChange]:
    """Ports whose state changed from `before` to `after` (a port new or gone is no change of state)."""
    out = []
    for key in sorted(after.keys() & before.keys()):
        old, new = before[key].state, after[key].state
        if old and new and old != new:
            out.append(PortChange(key, old, new, after[key].phys_state))
    return out


class Transition(msgspec.Struct, frozen=True):
    node_id: str
    old: NodeState | None
    new: NodeState
    reason: str


class NodeRegistry:
    def __init__(self, heartbeat_interval: float, unreachable_after: int = 3, lost_after: float = 120.0) -> None:
        self.heartbeat_interval = float(heartbeat_interval)
        self.unreachable_after = int(unreachable_after)
        self.lost_after = float(lost_after)
        self.nodes: dict[str, Node] = {}
        self._sessions = 0

    @property
    def silence_limit(self) -> float:
        return self.heartbeat_interval * self.unreachable_after

    def new_session(self) -> int:
        self._sessions += 1
        return self._sessions

    def register(
        self,
        msg: Register,
        now: float,
        session: int,
        address: str = "",
        identity: str | None = None,
        endpoint_host: str = "",
    ) -> tuple[Transition | None, int | None]:
        """Record a registration; returns the transition and the session it replaced, if any."""
        node = self.nodes.get(msg.node_id)
        replaced = node.session if node is not None and node.connected and node.session != session else None
        old = node.state if node is not None else None
        fresh = Node(
            id=msg.node_id,
            state="ready",
            state_since=now if old != "ready" else node.state_since,  # type: ignore[union-attr]
            version=msg.version,
            features=list(msg.features),
            inventory=msg.inventory,
            fabrics=list(msg.fabrics),
            fabric_status=list(msg.fabric_status),
            ports={port_key(p.device, p.port): PortCounters(device=p.device, port=p.port, state=p.state,
                                                            phys_state=p.phys_state, rate_gbps=p.rate_gbps)
                   for p in msg.inventory.ports},
            address=address,
            endpoint_host=endpoint_host,
            identity=identity,
            registered_at=now,
            last_seen=now,
            last_heartbeat=node.last_heartbeat if node is not None else None,
            heartbeats=node.heartbeats if node is not None else 0,
            session=session,
            connected=True,
            cert_not_after=msg.cert_not_after,
        )
        self.nodes[msg.node_id] = fresh
        if old == "ready":
            return None, replaced
        reason = "registered" if old is None else f"registered again (was {old})"
        return Transition(msg.node_id, old, "ready", reason), replaced

    def heartbeat(self, node_id: str, session: int, msg: Heartbeat, now: float,
                  wall: float | None = None) -> Transition | None:
        node = self.nodes.get(node_id)
        if node is None or node.session != session:
            return None
        node.last_seen = now
        node.last_heartbeat = now
        node.heartbeats += 1
        node.heartbeat = msg
        if msg.ports:
            node.ports = {port_key(p.device, p.port): p for p in msg.ports}
            history = node.port_history
            if not history or now - history[-1][0] >= COUNTER_WINDOW / 4:
                node.port_history = [*history[-(HISTORY - 1):], (now, node.ports)]
        if wall is not None and msg.sent_at > 0:
            node.clock_skews = [*node.clock_skews[-(SKEW_SAMPLES - 1):], wall - msg.sent_at]
        if node.state != "ready":
            old = node.state
            node.state, node.state_since, node.reason = "ready", now, ""
            return Transition(node_id, old, "ready", "heartbeat received")
        return None

    def fabrics_changed(self, node_id: str, session: int, msg: Fabrics,
                        now: float) -> tuple[list[str], list[str]] | None:
        """The node's usable fabrics changed: replace them. Returns (before, after) names, or
        None when the message is from a replaced stream."""
        node = self.nodes.get(node_id)
        if node is None or node.session != session:
            return None
        node.last_seen = now
        before = [f.name for f in node.fabrics]
        node.fabrics = list(msg.fabrics)
        node.fabric_status = list(msg.fabric_status)
        return before, [f.name for f in node.fabrics]

    def seen(self, node_id: str, session: int, now: float) -> None:
        node = self.nodes.get(node_id)
        if node is not None and node.session == session:
            node.last_seen = now

    def disconnect(self, node_id: str, session: int, now: float, reason: str) -> Transition | None:
        node = self.nodes.get(node_id)
        if node is None or node.session != session:
            return None  # a replaced stream closing says nothing about the node
        node.connected = False
        if node.state == "ready":
            node.state, node.state_since, node.reason = "unreachable", now, f"stream closed: {reason}"
            return Transition(node_id, "ready", "unreachable", node.reason)
        return None

    def tick(self, now: float) -> list[Transition]:
        out: list[Transition] = []
        limit = self.silence_limit
        for node in self.nodes.values():
            if node.state == "ready" and now - node.last_seen > limit:
                node.state, node.state_since = "unreachable", now
                node.reason = f"no heartbeat for {now - node.last_seen:.0f}s"
                out.append(Transition(node.id, "ready", "unreachable", node.reason))
            elif node.state == "unreachable" and now - node.state_since >= self.lost_after:
                node.state, node.state_since = "lost", now
                node.reason = f"unreachable for {self.lost_after:.0f}s"
                out.append(Transition(node.id, "unreachable", "lost", node.reason))
        return out

    def counts(self) -> dict[NodeState, int]:
        out: dict[NodeState, int] = dict.fromkeys(STATES, 0)
        for node in self.nodes.values():
            out[node.state] += 1
        return out

    def get(self, node_id: str) -> Node | None:
        return self.nodes.get(node_id)
