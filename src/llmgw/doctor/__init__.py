"""`llmgw ctl doctor`'s checks (issue 14): findings from facts, no I/O, time passed in.

`run` grades every node and then the fleet. It never raises and never runs past its deadline
by more than one check (each check is a few loops over one node's ports and GPUs, microseconds):
a check that raises, or that the deadline leaves unrun, is an `unknown` finding with the reason.
A node whose agent is not connected gets its agent finding and one `unknown` for the rest (its
readings are stale), not a dozen lines for cron mail.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from llmgw.doctor.cluster import CLUSTER_CHECKS
from llmgw.doctor.facts import CLUSTER, ClusterFacts, Finding, NodeFacts, Report, report
from llmgw.doctor.node import NODE_CHECKS, SERVER_ONLY, NodeContext, fabric_rates
from llmgw.verdict import Status

CHECKS: tuple[str, ...] = (*NODE_CHECKS, *CLUSTER_CHECKS)

__all__ = ["CHECKS", "CLUSTER", "ClusterFacts", "Finding", "NodeFacts", "Report", "report", "run"]


def _unknown(node: str, check: str, why: str) -> Finding:
    return Finding(node=node, check=check, status=Status.UNKNOWN, finding=why,
                   action="run `llmgw ctl doctor` again; if it repeats, the server's log says more")


def run(facts: ClusterFacts, *, clock: Callable[[], float], deadline: float, node: str | None = None,
        check: str | None = None, cluster: bool = True, local: bool = False,
        checks: Collection[str] | None = None) -> list[Finding]:
    """Every finding, nodes in id order then the fleet's. `node` narrows it to one node, `checks`
    (`--only`/`--skip`, doctor.catalog.select) or `check` to those checks; `cluster` False
    leaves out the fleet-wide checks; `local` the checks that need a server."""
    out: list[Finding] = []
    ctx = NodeContext(fabric_rates=fabric_rates(facts.nodes))
    chosen = frozenset(checks) if checks is not None else None
    if check is not None:
        chosen = frozenset({check}) if chosen is None else chosen & {check}
    label = next(iter(chosen)) if chosen is not None and len(chosen) == 1 else "(all)"  # a pseudo-id, listed
    names = [name for name in NODE_CHECKS if (chosen is None or name in chosen) and not (local and name in SERVER_ONLY)]
    for n in sorted(facts.nodes, key=lambda n: n.id):
        if node is not None and n.id != node:
            continue
        if clock() > deadline:
            out.append(_unknown(n.id, label, "not checked: doctor's deadline passed before this node"))
            continue
        out.extend(_node(n, ctx, names, local))
    if cluster and node is None:
        for name, fn in CLUSTER_CHECKS.items():
            if chosen is not None and name not in chosen:
                continue
            if clock() > deadline:
                out.append(_unknown(CLUSTER, name, "not checked: doctor's deadline passed before this check"))
                continue
            out.extend(_guarded(fn, (facts,), CLUSTER, name))
    return out


def _node(n: NodeFacts, ctx: NodeContext, names: list[str], local: bool) -> list[Finding]:
    out: list[Finding] = []
    stale = not local and (not n.connected or n.state != "ready")
    for name in names:
        if stale and name != "agent":
            continue
        out.extend(_guarded(NODE_CHECKS[name], (n, ctx), n.id, name))
    others = [name for name in names if name != "agent"]
    if stale and others:
        which = others[0] if len(others) == 1 else "(readings)"
        out.append(Finding(node=n.id, check=which, status=Status.UNKNOWN,
                           finding=f"not checked: the agent is {n.state}, its last readings are stale",
                           action="see the agent check"))
    return out


def _guarded(fn: Callable[..., list[Finding]], args: tuple[object, ...], node: str, name: str) -> list[Finding]:
    try:
        return fn(*args)
    except Exception as exc:  # a check's bug must not take doctor down: it is that check's unknown
        return [_unknown(node, name, f"the check failed: {type(exc).__name__}: {exc}")]
