"""`ctl replicas` shows a replica being moved and its successor (the REASON column), from the
move a `GET /api/v1/replicas` row carries (views.move_view over a real reconciler's move)."""

from __future__ import annotations

import msgspec

from llmgw.cli.ctl import _replica_rows
from llmgw.server.moves import Move
from llmgw.server.views import replica_view
from tests.unit.test_moves import small
from tests.unit.test_reconcile import bring_up, make, nodes


def test_the_old_replica_and_its_successor_say_what_the_move_does() -> None:
    rec = make(small(1))
    [first] = bring_up(rec, nodes("gpu-01"))
    old = first.spec.replica_id
    move = rec.request_move(old, 1, reason="drain of gpu-01", kind="drain", avoid=["gpu-01"])
    assert isinstance(move, Move)
    rec.reconcile(nodes("gpu-01", "gpu-02"), 2)
    rows = [msgspec.to_builtins(replica_view(r, 3, move=rec.move_of(r.id))) for r in rec.of_model("small")]
    by_id = {row[0]: row for row in _replica_rows(rows)}
    assert str(by_id[old][-1]).startswith(f"moving (drain, surging) → {move.successor}: placing successor"), by_id[old]
    assert str(by_id[move.successor][-1]).startswith(f"successor of {old} (drain, surging)"), by_id[move.successor]
