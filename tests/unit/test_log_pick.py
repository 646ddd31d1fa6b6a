"""Which replica `ctl logs MODEL` reads, and which one it follows after a move (server/logfollow.py).

The end-to-end test (tests/e2e/test_events_logs.py) follows a model across a real drain; these
cover the picks that are slow to set up there: several replicas, `--replica`, none at all.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from llmgw.server.logfollow import Picked, pick, successor_of
from llmgw.server.logs import LogProblem
from llmgw.server.moves import Move, MoveState
from llmgw.server.states import ReplicaState


def replica(rid: str, state: ReplicaState, *nodes: str) -> Any:
    shards = [SimpleNamespace(shard_id=f"{rid}.1.{rank}", node=node, rank=rank) for rank, node in enumerate(nodes)]
    return SimpleNamespace(id=rid, model="chat", state=state, shards=shards)


def book(*replicas: Any, moves: tuple[Move, ...] = ()) -> Any:
    by_id = {r.id: r for r in replicas}
    return SimpleNamespace(replicas=by_id, models={"chat": SimpleNamespace(replicas=len(replicas))},
                           of_model=lambda name: [r for r in replicas if r.model == name],
                           moves={mv.id: mv for mv in moves})


def test_the_first_ready_replica_of_several_and_why() -> None:
    fleet = book(replica("chat.a-1", ReplicaState.STARTING, "gpu-01"),
                 replica("chat.a-2", ReplicaState.READY, "gpu-02"),
                 replica("chat.a-3", ReplicaState.READY, "gpu-01", "gpu-03"))
    got = pick(fleet, "chat")
    assert isinstance(got, Picked) and got.replica.id == "chat.a-2"
    assert got.note == "chat: first ready replica chat.a-2 (ready on gpu-02); 3 replicas, --replica picks another"
    chosen = pick(fleet, "chat", "chat.a-3")
    assert isinstance(chosen, Picked) and chosen.note == "chat: replica chat.a-3 (ready on gpu-01, gpu-03)"
    alone = pick(fleet, "chat.a-1")  # a replica id: that replica, nothing to say
    assert isinstance(alone, Picked) and alone.replica.id == "chat.a-1" and alone.note == ""


def test_what_cannot_be_picked_says_why() -> None:
    fleet = book(replica("chat-b", ReplicaState.READY, "gpu-01"))
    missing = pick(fleet, "chat", "chat-zz")
    assert isinstance(missing, LogProblem) and missing.status == 404 and "its replicas: chat-b" in str(missing)
    unknown = pick(fleet, "llama")
    assert isinstance(unknown, LogProblem) and unknown.status == 404 and "(models: chat)" in str(unknown)
    empty = book()
    empty.models = {"chat": SimpleNamespace(replicas=1)}
    none = pick(empty, "chat")
    assert isinstance(none, LogProblem) and none.status == 409 and "no replica now (wanted: 1)" in str(none)


def test_the_successor_is_the_newest_move_of_the_replica() -> None:
    new = replica("chat-n", ReplicaState.READY, "gpu-02")
    moves = (Move(id=1, replica="chat-o", model="chat", node="gpu-01", kind="drain", reason="r", successor="chat-x",
                  state=MoveState.FAILED),
             Move(id=2, replica="chat-o", model="chat", node="gpu-01", kind="drain", reason="r", successor="chat-n",
                  state=MoveState.DONE))
    found = successor_of(book(new, moves=moves), "chat-o")
    assert found is not None and found[0].id == 2 and found[1] is new
    assert successor_of(book(new, moves=moves), "chat-n") is None
