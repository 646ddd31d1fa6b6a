"""Check results graded the way monitoring already reads them.

`ctl doctor` and `ctl fabric-test` both report findings with one of four statuses and exit with the
Nagios plugin convention (0 ok, 1 warning, 2 critical, 3 unknown), so an existing Nagios, Icinga or
cron wrapper can call them unchanged. Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping


class Status(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    CRIT = "crit"
    UNKNOWN = "unknown"  # the check could not run: agent gone, tool missing, deadline passed


# Exit codes of the Nagios plugin guidelines.
EXIT_OK = 0
EXIT_WARN = 1
EXIT_CRIT = 2
EXIT_UNKNOWN = 3  # could not run at all (server unreachable), or only unknowns beside oks

_SEVERITY = {Status.OK: 0, Status.UNKNOWN: 1, Status.WARN: 2, Status.CRIT: 3}
_EXIT = {Status.OK: EXIT_OK, Status.UNKNOWN: EXIT_UNKNOWN, Status.WARN: EXIT_WARN, Status.CRIT: EXIT_CRIT}


def worst(statuses: Iterable[Status]) -> Status:
    """The status that decides the exit: crit over warn over unknown over ok (as check_multi ranks them)."""
    out = Status.OK
    for s in statuses:
        if _SEVERITY[s] > _SEVERITY[out]:
            out = s
    return out


def exit_code(statuses: Iterable[Status]) -> int:
    """0 all ok (or nothing checked), 1 any warn, 2 any crit, 3 only unknowns beside oks."""
    return _EXIT[worst(statuses)]


def grade_ratio(measured: float, expected: float, *, ok_at: float = 0.9, warn_at: float = 0.7) -> Status:
    """A measurement against what it should reach: ok at ≥ 90 % of it, warn at ≥ 70 %, crit below.

    An expectation that is not positive cannot be graded: unknown.
    """
    if expected <= 0:
        return Status.UNKNOWN
    ratio = measured / expected
    if ratio >= ok_at:
        return Status.OK
    if ratio >= warn_at:
        return Status.WARN
    return Status.CRIT


_PLUGIN_WORD = {Status.OK: "OK", Status.WARN: "WARNING", Status.CRIT: "CRITICAL", Status.UNKNOWN: "UNKNOWN"}


def plugin_line(service: str, status: Status | str, summary: str,
                perf: Mapping[str, str | int | float] | None = None) -> str:
    """The first line of a Nagios plugin's output: `SERVICE WORD - summary | perfdata`
    (nagios-plugins guidelines: the status word, text, then `label=value[UOM]` pairs after a `|`;
    Nagios shows this line and graphs the pairs). A `|` in the summary would start the perfdata,
    so it becomes `/`; labels are plain words, so need no quoting."""
    word = _PLUGIN_WORD.get(Status(status), "UNKNOWN")
    line = f"{service} {word} - {summary.replace('|', '/')}"
    if perf:
        line += " | " + " ".join(f"{label}={value}" for label, value in perf.items())
    return line
