"""Subnet managers and fabric identity: `saquery SMIR` and `sminfo` text in, fabrics out. Pure.

`saquery SMIR` — no real output could be found in public sources, so the parser follows the
printf in rdma-core's infiniband-diags/saquery.c (`dump_one_smi_record`, read at
linux-rdma/rdma-core 691953d8d), one record per SM the SA knows:

    SMInfoRecord dump:
    \\t\\tRID
    \\t\\tLID...................%u
    \\t\\tSMInfo dump:
    \\t\\tGUID..................0x%016x
    \\t\\tSM_Key................0x%016x
    \\t\\tActCount..............%u
    \\t\\tPriority..............%u
    \\t\\tSMState...............%u

SMState is the number (0 not active, 1 discovering, 2 standby, 3 master). `sminfo` (real
samples in the fixtures) is a second source of the master's GUID and priority:
`sminfo: sm lid %d sm guid 0x%x, activity count %u priority %d state %d %s`; a mail client
wrapped the sample's lines, so a record may continue on the next line.

**Identity.** Subnet managers listed together belong to one fabric, and a fabric is named by the
lowest GUID among them, so a master failover keeps the name. A name once given stays with every
GUID that was ever seen in it (`known`): after a failover in which the old master vanished, the
remaining SM still names the fabric it named before (without that, a failover briefly read as
two fabrics).
"""

from __future__ import annotations

import enum
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

import msgspec

from llmgw.fabric.topology import LineProblem, clip, normalise_guid

MASTER_CHANGE_WINDOW = 3600.0  # a master change in the last hour is a problem


class SmState(enum.StrEnum):
    NOT_ACTIVE = "not-active"
    DISCOVERING = "discovering"
    STANDBY = "standby"
    MASTER = "master"


SM_STATES = (SmState.NOT_ACTIVE, SmState.DISCOVERING, SmState.STANDBY, SmState.MASTER)
SMINFO_NAMES = {"SMINFO_NOTACT": SmState.NOT_ACTIVE, "SMINFO_DISCOVER": SmState.DISCOVERING,
                "SMINFO_STANDBY": SmState.STANDBY, "SMINFO_MASTER": SmState.MASTER}


class SmRecord(msgspec.Struct, kw_only=True, frozen=True):
    guid: str
    lid: int = 0
    priority: int = 0
    state: SmState = SmState.NOT_ACTIVE
    act_count: int = 0


class SmParse(msgspec.Struct, kw_only=True):
    records: list[SmRecord]
    problems: list[LineProblem]


_SMIR_FIELD = re.compile(r"\s*(LID|GUID|SM_Key|ActCount|Priority|SMState)\.{2,}\s*(\S+)\s*$", re.ASCII)
_SMINFO = re.compile(
    r"sminfo:\s+sm\s+lid\s+(\d{1,9})\s+sm\s+guid\s+(0x[0-9a-fA-F]{1,16}),\s+activity\s+count\s+(\d{1,12})"
    r"\s+priority\s+(\d{1,9})\s+state\s+(\d{1,9})(?:\s+(SMINFO_\w+))?",
    re.ASCII,
)


def _number(text: str) -> int | None:
    text = text.strip()
    if text.isascii() and text.isdigit() and len(text) <= 12:
        return int(text)
    return None


def parse_smir(text: str) -> SmParse:
    """Every `SMInfoRecord dump:` block; a block without a GUID or a state is reported, not kept."""
    records: list[SmRecord] = []
    problems: list[LineProblem] = []
    block: dict[str, str] | None = None
    start = 0

    def finish() -> None:
        if block is None:
            return
        guid = normalise_guid(block.get("GUID", ""))
        state = _number(block.get("SMState", ""))
        if guid is None or state is None or state >= len(SM_STATES):
            problems.append(LineProblem(line=start, text="SMInfoRecord dump:",
                                        reason="a record without a GUID or a valid SMState (cut short?)"))
            return
        records.append(SmRecord(
            guid=guid, lid=_number(block.get("LID", "")) or 0, priority=_number(block.get("Priority", "")) or 0,
            state=SM_STATES[state], act_count=_number(block.get("ActCount", "")) or 0,
        ))

    for number, raw in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line == "SMInfoRecord dump:":
            finish()
            block, start = {}, number
            continue
        if line in ("RID", "SMInfo dump:") and block is not None:
            continue
        match = _SMIR_FIELD.match(line)
        if match and block is not None:
            block[match[1]] = match[2]
            continue
        problems.append(LineProblem(line=number, text=clip(line), reason="not `saquery SMIR` output"))
    finish()
    return SmParse(records=records, problems=sorted(problems, key=lambda p: p.line))


def parse_sminfo(text: str) -> SmParse:
    """Every `sminfo:` record, also when a mail client wrapped it onto a second line."""
    records: list[SmRecord] = []
    problems: list[LineProblem] = []
    lines = text.removeprefix("\ufeff").splitlines()
    skip = False
    for number, raw in enumerate(lines, 1):
        if skip:
            skip = False
            continue
        line = raw.strip()
        if not line.startswith("sminfo:"):
            continue
        match = _SMINFO.match(line)
        if match is None and number < len(lines):
            match = _SMINFO.match(line + " " + lines[number].strip())
            skip = match is not None
        if match is None:
            problems.append(LineProblem(line=number, text=clip(line), reason="an sminfo line that does not read"))
            continue
        lid, guid, count, priority, state, name = match.groups()
        guid_text = normalise_guid(guid)
        number_state = int(state)
        sm_state = SMINFO_NAMES.get(name or "") or (SM_STATES[number_state] if number_state < 4 else None)
        if guid_text is None or sm_state is None:
            problems.append(LineProblem(line=number, text=clip(line), reason="an sminfo line with a bad GUID or state"))
            continue
        records.append(SmRecord(guid=guid_text, lid=int(lid), priority=int(priority), state=sm_state,
                                act_count=int(count)))
    return SmParse(records=records, problems=problems)


UNREADABLE_SM = "could not read the subnet manager list"


def parse_sm_text(text: str) -> SmParse:
    """Either source, by what the text holds. Text that is neither (ibdiagnet's `ibdiagnet2.sm`
    report, `saquery -s` PortInfoRecords, an error page) is one problem, not an empty list: an
    empty list reads as "no subnet manager", and "start opensm" is the wrong advice for a fabric
    whose SM is fine but whose report llmgw cannot read."""
    parsed = parse_smir(text) if "SMInfoRecord dump:" in text else parse_sminfo(text)
    if parsed.records or parsed.problems:
        return parsed
    first = next(((n, line.strip()) for n, line in enumerate(text.removeprefix("\ufeff").splitlines(), 1)
                  if line.strip() and not line.lstrip().startswith("#")), None)
    if first is None:
        return parsed
    parsed.problems.append(LineProblem(
        line=first[0], text=clip(first[1]),
        reason=f"{UNREADABLE_SM}: neither `saquery SMIR` nor `sminfo` output (ibdiagnet's .sm, `saquery -s`?)",
    ))
    return parsed


# ---- fabrics ------------------------------------------------------------------------------------


class PortView(msgspec.Struct, kw_only=True, frozen=True):
    """What one port saw: the SMs its subnet lists, and its own state (sysfs)."""

    node: str
    port: str  # "mlx5_0/1"
    state: str = "ACTIVE"  # ACTIVE, INIT, DOWN, ARMED
    sm_lid: int = 0
    records: tuple[SmRecord, ...] = ()
    unreadable: bool = False  # the SM text came back in a format llmgw does not read


class FabricProblemKind(enum.StrEnum):
    NO_STANDBY = "no_standby"
    SM_DISAGREE = "sm_disagree"
    NO_SM = "no_sm"
    SM_UNREADABLE = "sm_unreadable"
    MASTER_CHANGED = "master_changed"


class FabricProblem(msgspec.Struct, kw_only=True):
    kind: FabricProblemKind
    message: str


class MasterChange(msgspec.Struct, kw_only=True, frozen=True):
    fabric: str
    at: float  # wall-clock seconds
    old: str  # GUID, "" for the first master seen
    new: str
    reported_by: str = ""  # node/port


class Fabric(msgspec.Struct, kw_only=True):
    id: str  # the lowest SM GUID ever seen in it
    master: SmRecord | None
    standbys: list[SmRecord]
    subnet_managers: list[SmRecord]
    ports: list[str]  # node/port that reported it
    problems: list[FabricProblem]


class FabricReport(msgspec.Struct, kw_only=True):
    fabrics: list[Fabric]
    unmanaged: list[str]  # ports up with no subnet manager (INIT)
    problems: list[FabricProblem]  # problems that belong to no fabric (no_sm)


def group_fabrics(views: Iterable[PortView], known: Mapping[str, str] | None = None,
                  changes: Iterable[MasterChange] = (), now: float = 0.0) -> FabricReport:
    """Ports' views → fabrics. `known`: SM GUID → the fabric id it was seen in before (the server
    keeps it); `changes`: recent master changes, for the `master_changed` problem."""
    known = known or {}
    views = list(views)
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for view in views:
        guids = [r.guid for r in view.records]
        for guid in guids:
            find(guid)
        for guid in guids[1:]:
            parent[find(guid)] = find(guids[0])
    # A GUID the server saw in a fabric before joins that fabric's other known GUIDs.
    by_known: dict[str, list[str]] = defaultdict(list)
    for guid in list(parent):
        if guid in known:
            by_known[known[guid]].append(guid)
    for guids in by_known.values():
        for guid in guids[1:]:
            parent[find(guid)] = find(guids[0])

    members: dict[str, set[str]] = defaultdict(set)
    for guid in parent:
        members[find(guid)].add(guid)
    fabric_of: dict[str, str] = {}
    for root, group in members.items():
        names = [known[g] for g in group if g in known]
        name = min(names) if names else min(group)
        for guid in group:
            fabric_of[guid] = name
        fabric_of[root] = name

    per_fabric: dict[str, list[PortView]] = defaultdict(list)
    unmanaged: list[str] = []
    unreadable: list[str] = []
    for view in views:
        if view.records:
            per_fabric[fabric_of[view.records[0].guid]].append(view)
        elif view.unreadable and view.state.upper() != "INIT":
            unreadable.append(f"{view.node}/{view.port}")
        elif view.state.upper() == "INIT" or (view.state.upper() == "ACTIVE" and view.sm_lid == 0):
            unmanaged.append(f"{view.node}/{view.port}")

    recent: dict[str, list[MasterChange]] = defaultdict(list)
    for change in changes:
        if change.old and now - change.at <= MASTER_CHANGE_WINDOW:
            recent[change.fabric].append(change)

    fabrics = [_fabric(fid, fviews, recent.get(fid, [])) for fid, fviews in sorted(per_fabric.items())]
    problems = []
    if unmanaged:
        problems.append(FabricProblem(
            kind=FabricProblemKind.NO_SM,
            message=f"{len(unmanaged)} ports are up with no subnet manager (INIT): {', '.join(sorted(unmanaged)[:5])}",
        ))
    if unreadable:
        problems.append(FabricProblem(
            kind=FabricProblemKind.SM_UNREADABLE,
            message=f"{UNREADABLE_SM} from {len(unreadable)} ports (not `saquery SMIR` or `sminfo` output): "
                    + ", ".join(sorted(unreadable)[:5]),
        ))
    return FabricReport(fabrics=fabrics, unmanaged=sorted(unmanaged), problems=problems)


def _fabric(fabric_id: str, views: list[PortView], changes: list[MasterChange]) -> Fabric:
    latest: dict[str, SmRecord] = {}
    masters: dict[str, list[str]] = defaultdict(list)
    standing_by: set[str] = set()
    for view in views:
        for record in view.records:
            if record.state is SmState.STANDBY:
                standing_by.add(record.guid)
            old = latest.get(record.guid)
            if old is None or record.act_count >= old.act_count:
                latest[record.guid] = record
            if record.state is SmState.MASTER:
                masters[record.guid].append(f"{view.node}/{view.port}")
    sms = sorted(latest.values(), key=lambda r: (-r.priority, r.guid))
    # The master most ports name (ties: the highest activity count, then the lowest GUID).
    master_guid = min(masters, key=lambda g: (-len(masters[g]), -latest[g].act_count, g), default=None)
    master = latest[master_guid] if master_guid else None
    standbys = [r for r in sms if r.guid in standing_by and r.guid != master_guid]
    problems = []
    if master is None:
        problems.append(FabricProblem(kind=FabricProblemKind.SM_DISAGREE,
                                      message="no port reports a master subnet manager"))
    if not standbys:
        problems.append(FabricProblem(
            kind=FabricProblemKind.NO_STANDBY,
            message="no standby subnet manager: if the master fails the fabric runs unmanaged",
        ))
    if len(masters) > 1:
        said = "; ".join(f"{g} by {', '.join(sorted(p)[:3])}" for g, p in sorted(masters.items()))
        problems.append(FabricProblem(kind=FabricProblemKind.SM_DISAGREE,
                                      message=f"ports disagree on the master: {said}"))
    for change in sorted(changes, key=lambda c: c.at)[-1:]:
        problems.append(FabricProblem(
            kind=FabricProblemKind.MASTER_CHANGED,
            message=f"the master changed from {change.old} to {change.new} in the last hour",
        ))
    return Fabric(id=fabric_id, master=master, standbys=standbys, subnet_managers=sms,
                  ports=sorted(f"{v.node}/{v.port}" for v in views), problems=problems)


def master_changes(previous: Mapping[str, str], report: FabricReport, now: float) -> list[MasterChange]:
    """Changes since `previous` (fabric id → master GUID): one per fabric whose master differs."""
    out = []
    for fabric in report.fabrics:
        if fabric.master is None:
            continue
        old = previous.get(fabric.id, "")
        if old != fabric.master.guid:
            out.append(MasterChange(fabric=fabric.id, at=now, old=old, new=fabric.master.guid,
                                    reported_by=fabric.ports[0] if fabric.ports else ""))
    return out


def remember(report: FabricReport, known: Mapping[str, str]) -> dict[str, str]:
    """`known` with every SM GUID of every fabric in `report` added (GUID → fabric id)."""
    out = dict(known)
    for fabric in report.fabrics:
        for record in fabric.subnet_managers:
            out.setdefault(record.guid, fabric.id)
    return out
