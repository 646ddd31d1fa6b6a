"""A fleet that heals itself (issue 43): doctor's findings, their history, the settings and the
budget → what to do. Pure: values in, actions out, time passed in as a number.

The control plane (server/remedy_service.py) feeds `observe` one reading per node heartbeat (the
findings of doctor's node checks on it) and carries out what `decide` returns. The rules, each
after the drainers that run large fleets (draino, GKE auto-repair, Slurm's NHC):

- a CRIT finding on a GPU (gpu-health, nvlink: fallen off the bus, uncorrectable ECC, NVLink
  down, health lost) makes that GPU unplaceable from its first reading: that takes nothing out
  of service, it only stops new work from landing on a GPU that is probably dead;
- a node is cordoned only when a finding held `hold` consecutive readings (one bad reading, a
  driver hiccup, cordons nothing); replicas on its healthy GPUs stay unless the finding is
  node-wide (a `node_checks` check, or every GPU of the node);
- a GPU returns and an automatic cordon is lifted only after the node's readings were clear for
  `clear_after` (much longer than `hold`: a flapping link must not cycle replicas);
- an operator's cordon or drain is never lifted, nor taken over;
- at most `budget()` nodes are auto-cordoned at once; past it, findings are reported only;
- `report` mode decides the same and says what `act` would do, as events; `off` does nothing.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping

import msgspec

from llmgw.catalog.schema import RemedySettings
from llmgw.doctor.facts import Finding
from llmgw.verdict import Status

# The checks whose CRIT findings name one GPU (subject "GPU n") and mean it should run nothing: the
# replicas on it move, the others stay. A pending or failed row remap (reset or RMA), a card within
# 2 °C of its shutdown threshold, an NVSwitch fabric not set up (CUDA cannot start there).
GPU_CHECKS = frozenset({"gpu-health", "nvlink", "row-remap", "temperature", "fabric-manager"})
AUTO_PREFIX = "auto: "  # a mark's `who` that the system set (drain.py keeps it on disk as it does an operator's)
_GPU_SUBJECT = re.compile(r"GPU (\d+)\b")


class MarkKind(enum.StrEnum):
    OPERATOR = "operator"
    AUTO = "auto"


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """A CRIT finding that remediation acts on. `gpu` None: the whole node."""

    node: str
    check: str
    gpu: int | None
    reason: str  # short, for `ctl nodes`: "gpu 3 Xid 79"

    @property
    def key(self) -> tuple[int | None, str]:
        return (self.gpu, self.check)


def faults(findings: Iterable[Finding], node_checks: Iterable[str] = ()) -> list[Fault]:
    """The CRIT findings of GPU checks (one GPU each) and of `node_checks` (the whole node)."""
    whole = set(node_checks)
    out: list[Fault] = []
    for f in findings:
        if f.status != Status.CRIT:
            continue
        match = _GPU_SUBJECT.fullmatch(f.subject) if f.check in GPU_CHECKS else None
        if match is not None:
            gpu = int(match.group(1))
            rest = f.finding
            if rest.startswith(f.subject):
                rest = rest[len(f.subject):].lstrip(":").strip()
            out.append(Fault(node=f.node, check=f.check, gpu=gpu, reason=f"gpu {gpu} {rest.split(' (')[0]}".strip()))
        elif f.check in whole:
            out.append(Fault(node=f.node, check=f.check, gpu=None, reason=f"{f.check}: {f.finding.split(' (')[0]}"))
    return out


class Track(msgspec.Struct, kw_only=True):
    """One fault's history on one node."""

    fault: Fault
    streak: int = 0  # consecutive readings with it (0: absent from the latest)
    confirmed: bool = False  # it held `hold` readings once: it leaves only after `clear_after`
    absent_since: float | None = None


class Cordon(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    reason: str
    gpus: tuple[int, ...]  # the GPUs whose replicas move
    node_wide: bool  # every replica on the node moves


class Uncordon(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    reason: str


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """A finding that would cordon, and why nothing was done."""

    node: str
    reason: str
    why: str


class GpuOut(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    gpu: int
    reason: str


class GpuBack(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    gpu: int
    reason: str


Action = Cordon | Uncordon | Report | GpuOut | GpuBack


def budget(settings: RemedySettings, fleet: int) -> int:
    """The most nodes auto-cordoned at once: `max_nodes`, and `max_percent` of the fleet
    rounded down but at least one (else a fleet under ten nodes could never heal)."""
    by_share = max(1, int(fleet * settings.max_percent / 100.0 + 1e-9)) if fleet else 0
    return min(settings.max_nodes, by_share)


class Remedy:
    """The histories and what was announced; `observe` and `decide` are the whole interface."""

    def __init__(self, settings: RemedySettings) -> None:
        self.settings = settings
        self.tracks: dict[str, dict[tuple[int | None, str], Track]] = {}
        self.clear_since: dict[str, float] = {}  # node → first reading of its current clean run
        self.out: dict[tuple[str, int], str] = {}  # unplaceable GPUs announced (GpuOut), with their reason
        self.reported: dict[str, tuple[str, str]] = {}  # node → the (reason, why) last reported

    # -- readings ------------------------------------------------------------------------------------

    def observe(self, node: str, found: Iterable[Fault], now: float) -> None:
        """One reading of a node (its latest heartbeat graded)."""
        present = {f.key: f for f in found if f.node == node}
        tracks = self.tracks.setdefault(node, {})
        for key, fault in present.items():
            track = tracks.get(key)
            if track is None:
                track = tracks[key] = Track(fault=fault)
            track.fault = fault
            track.streak += 1
            track.absent_since = None
            if track.streak >= self.settings.hold:
                track.confirmed = True
        for key, track in list(tracks.items()):
            if key in present:
                continue
            track.streak = 0
            if track.absent_since is None:
                track.absent_since = now
            if not track.confirmed or now - track.absent_since >= self.settings.clear_after:
                del tracks[key]
        if present:
            self.clear_since.pop(node, None)
        else:
            self.clear_since.setdefault(node, now)
        if not tracks:
            del self.tracks[node]

    def forget(self, node: str) -> None:
        """A node that left the fleet (`ctl forget`)."""
        self.tracks.pop(node, None)
        self.clear_since.pop(node, None)
        self.reported.pop(node, None)

    # -- what follows ----------------------------------------------------------------------------------

    def unplaceable(self) -> dict[str, dict[int, str]]:
        """Node → GPU → why it takes no new work (empty when `auto_remediate` is off)."""
        if self.settings.mode == "off":
            return {}
        out: dict[str, dict[int, str]] = {}
        for node, tracks in self.tracks.items():
            for track in tracks.values():
                gpu = track.fault.gpu
                if gpu is not None:
                    out.setdefault(node, {}).setdefault(gpu, track.fault.reason)
        return out

    def held(self, node: str) -> list[Fault]:
        """The node's faults that held `hold` readings and are not yet clear for `clear_after`."""
        return [t.fault for _, t in sorted(self.tracks.get(node, {}).items(), key=_order) if t.confirmed]

    def affected(self, node: str, gpus: int) -> tuple[tuple[int, ...], bool]:
        """The GPUs whose replicas must move off an auto-cordoned node, and whether all must
        (a node-wide fault, or one on every one of its `gpus`)."""
        held = self.held(node)
        indexes = tuple(sorted({f.gpu for f in held if f.gpu is not None}))
        node_wide = any(f.gpu is None for f in held) or (gpus > 0 and len(indexes) >= gpus)
        return indexes, node_wide

    def decide(self, now: float, marks: Mapping[str, MarkKind], fleet: Mapping[str, int]) -> list[Action]:
        """`marks`: every cordoned or draining node and who set it; `fleet`: every registered
        node and its GPU count. Level-triggered: the same inputs again give no new actions."""
        mode = self.settings.mode
        if mode == "off":
            return []
        actions: list[Action] = []
        self._gpus(actions)
        auto = sorted(n for n, kind in marks.items() if kind == MarkKind.AUTO)
        cordoned = len(auto)
        for node in auto:  # lift what has been clear long enough
            if node not in fleet:
                continue
            since = self.clear_since.get(node)
            if mode == "act" and not self.held(node) and since is not None and now - since >= self.settings.clear_after:
                actions.append(Uncordon(node=node, reason=f"readings clear for {now - since:.0f}s "
                                                          f"(clear_after {self.settings.clear_after:g}s)"))
                cordoned -= 1
        allowed = budget(self.settings, len(fleet))
        for node in sorted(fleet):
            held = self.held(node)
            if not held:
                self.reported.pop(node, None)
                continue
            reason = held[0].reason + (f" (+{len(held) - 1} more)" if len(held) > 1 else "")
            kind = marks.get(node)
            if kind == MarkKind.AUTO:
                continue
            if kind == MarkKind.OPERATOR:
                self._report(actions, node, reason, "the node is already cordoned by an operator: left as it is")
            elif mode == "report":
                self._report(actions, node, reason, "auto_remediate: report (act would cordon it and move "
                                                    "the replicas on the affected GPUs)")
            elif cordoned >= allowed:
                self._report(actions, node, reason, f"over the budget: {cordoned} node(s) auto-cordoned, at most "
                                                    f"{allowed} (max_nodes {self.settings.max_nodes}, max_percent "
                                                    f"{self.settings.max_percent:g} of {len(fleet)} nodes)")
            else:
                gpus, node_wide = self.affected(node, fleet[node])
                actions.append(Cordon(node=node, reason=reason, gpus=gpus, node_wide=node_wide))
                self.reported.pop(node, None)
                cordoned += 1
        return actions

    def _report(self, actions: list[Action], node: str, reason: str, why: str) -> None:
        if self.reported.get(node) != (reason, why):
            self.reported[node] = (reason, why)
            actions.append(Report(node=node, reason=reason, why=why))

    def _gpus(self, actions: list[Action]) -> None:
        now_out = {(node, gpu): why for node, gpus in self.unplaceable().items() for gpu, why in gpus.items()}
        for (node, gpu), why in sorted(now_out.items()):
            if (node, gpu) not in self.out:
                actions.append(GpuOut(node=node, gpu=gpu, reason=why))
        for (node, gpu), why in sorted(self.out.items()):
            if (node, gpu) not in now_out:
                actions.append(GpuBack(node=node, gpu=gpu, reason=f"clear (was {why})"))
        self.out = now_out


def _order(item: tuple[tuple[int | None, str], Track]) -> tuple[int, int, str]:
    (gpu, check), _ = item
    return (0 if gpu is None else 1, gpu or 0, check)


def mark_kind(who: str) -> MarkKind:
    """Who set a mark, from the `who` drain.py keeps: the system's start with AUTO_PREFIX."""
    return MarkKind.AUTO if who.startswith(AUTO_PREFIX) else MarkKind.OPERATOR
