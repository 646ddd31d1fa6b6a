"""The one pattern for ids that cross the fleet stream, and quoting for logs. Pure.

Replica and shard ids become file names on nodes (`work_dir/shards/<shard>.json`,
`work_dir/logs/<shard>.log`), and ids, model names and versions go into logs on both sides.
Before this check a node could adopt `replica_id=/tmp/x/owned`, and the agent the replica
was re-placed on wrote and later unlinked files outside its work dir; a newline in a version
forged a whole log line. So every door (the server on Register, ShardStatus and Progress;
the agent on Start, Stop and Drain) checks ids against one pattern before anything else:

- an id (node, replica, shard, profile): a letter or digit, then letters, digits, `.`, `_`
  and `-`, at most 128 characters (a shard id is `<replica>.<attempt>`, a replica id
  `<model slug>-<5 letters>`). No `/`, so it can never name a directory; no `..` either.
- a model name: the same, plus `/ : @ +` inside (served names like `meta-llama/Llama-3.1-8B`),
  at most 256 characters, with no empty, `.` or `..` path segment.

Neither admits whitespace or control characters, so a checked id is safe in a log line and a
path component; `quote()` is for the free text a peer sends (versions, reasons).

The patterns themselves live in llmgw/names.py (the catalog checks names with them too, and
sits below this protocol); they are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from llmgw.names import ID_MAX, MODEL_MAX, id_problem, model_problem, printable, quote, valid_id
from llmgw.wire import messages as m

__all__ = ["ID_MAX", "MODEL_MAX", "id_problem", "message_problems", "model_problem", "printable", "quote",
           "spec_problems", "valid_id"]


def spec_problems(spec: m.ShardSpec) -> Iterator[str]:
    """Every id in a shard spec that fails its pattern."""
    for value, what in ((spec.shard_id, "shard id"), (spec.replica_id, "replica id"), (spec.profile, "profile")):
        problem = id_problem(value, what)
        if problem:
            yield problem
    problem = model_problem(spec.model)
    if problem:
        yield problem
    if spec.served_name:
        problem = model_problem(spec.served_name, "served name")
        if problem:
            yield problem


def message_problems(msg: msgspec.Struct) -> list[str]:
    """The ids a fleet message carries that fail their pattern (empty: the message may go on).

    Covers every message type that names a node, replica or shard, in both directions; a
    test enumerates the message types with such fields and fails when one is missing here.
    """
    out: list[str] = []

    def check(value: str, what: str, *, optional: bool = False) -> None:
        if optional and not value:
            return
        problem = id_problem(value, what)
        if problem:
            out.append(problem)

    if isinstance(msg, m.Register):
        check(msg.node_id, "node id")
        for report in msg.shards:
            out.extend(spec_problems(report.spec))
    elif isinstance(msg, m.Heartbeat):
        for report in msg.shards or ():
            out.extend(spec_problems(report.spec))
    elif isinstance(msg, m.ShardStatus):
        check(msg.shard_id, "shard id")
        check(msg.replica_id, "replica id", optional=True)  # "" when the agent does not know the shard
    elif isinstance(msg, m.Progress):
        check(msg.shard_id, "shard id")
    elif isinstance(msg, m.Start):
        out.extend(spec_problems(msg.spec))
    elif isinstance(msg, (m.Stop, m.Drain, m.LogTail)):
        check(msg.shard_id, "shard id")
    return out
