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
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import msgspec

from llmgw.wire import messages as m

ID_MAX = 128
MODEL_MAX = 256
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def id_problem(value: str, what: str = "id") -> str | None:
    """Why `value` is not a valid id, or None when it is."""
    if not value:
        return f"empty {what}"
    if len(value) > ID_MAX:
        return f"{what} longer than {ID_MAX} characters"
    if not _ID.fullmatch(value) or ".." in value:
        return f"invalid {what} {quote(value)}: use letters, digits, '.', '_' and '-', starting with a letter or digit"
    return None


def model_problem(value: str, what: str = "model name") -> str | None:
    """Why `value` is not a valid model name, or None when it is."""
    if not value:
        return f"empty {what}"
    if len(value) > MODEL_MAX:
        return f"{what} longer than {MODEL_MAX} characters"
    if not _MODEL.fullmatch(value) or any(part in ("", ".", "..") for part in value.split("/")):
        return (f"invalid {what} {quote(value)}: use letters, digits and '.', '_', '-', ':', '@', '+', '/' "
                "(no empty, '.' or '..' segment), starting with a letter or digit")
    return None


def valid_id(value: str) -> bool:
    return id_problem(value) is None


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


def quote(value: object) -> str:
    """A peer-supplied value for a log line: quoted, control characters escaped, so a newline
    in a version or a reason can never start a forged line of its own."""
    return repr(str(value))


def printable(text: str) -> str:
    """`text` with control characters (C0, DEL, C1) escaped as \\xNN: for lines that embed a
    peer's free text (an engine's exit reason) without quoting the whole line."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
