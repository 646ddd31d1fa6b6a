"""`llmgw ctl doctor`: node and fleet diagnosis from one terminal, and from cron (issue 14).

Exit codes are the Nagios plugin convention (llmgw.verdict): 0 all ok, 1 a warning, 2 a critical
finding, 3 doctor could not run (the server unreachable or refusing; one line on stderr, and the
UNKNOWN status line on stdout, where a plugin's output is read).
"""

from __future__ import annotations

import sys
import time
from typing import Any
from urllib.parse import urlencode

import click

from llmgw.cli import complete
from llmgw.cli.context import api
from llmgw.cli.render import (
    NagiosCommand,
    console,
    make_table,
    output_option,
    print_json,
    say,
    text,
)
from llmgw.doctor import CHECKS
from llmgw.errors import LlmgwError, UsageError
from llmgw.verdict import EXIT_UNKNOWN, plugin_line

SERVICE = "LLMGW DOCTOR"
STATUS_STYLES = {"ok": "green", "warn": "yellow", "crit": "bold red", "unknown": "magenta"}


class CouldNotRun(LlmgwError):
    """Doctor could not ask (server unreachable, credentials refused): Nagios's UNKNOWN."""

    exit_code = EXIT_UNKNOWN


def _local_report(config_path: str | None, node: str | None, checks: frozenset[str] | None,
                  interval: float) -> dict[str, Any]:
    import msgspec

    from llmgw import doctor as grading
    from llmgw.agent.selfcheck import local_facts
    from llmgw.catalog import load_agent_config
    from llmgw.doctor.facts import ClusterFacts, report

    cfg = load_agent_config(config_path)
    facts = local_facts(cfg, interval=interval)
    if node is not None and node != facts.id:
        raise UsageError(f"--node {node} with --local: this machine is {facts.id} (drop --node, or run it there)")
    found = grading.run(ClusterFacts(nodes=[facts]), clock=time.monotonic, deadline=time.monotonic() + 30,
                       checks=checks, cluster=False, local=True)
    return msgspec.to_builtins(report(found, nodes=1))


def _complete_checks(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Check ids after the last comma typed (`--skip clock,fi<TAB>`)."""
    from click.shell_completion import CompletionItem

    head, _, tail = incomplete.rpartition(",")
    prefix = head + "," if head else ""
    return [CompletionItem(prefix + name) for name in CHECKS if name.startswith(tail)]


def _print_list(output: str) -> None:
    """`--list`: every check `run` runs, from its registry (doctor.catalog.listing)."""
    from rich.text import Text

    from llmgw.doctor.catalog import listing

    checks = listing()
    if output == "json":
        print_json({"checks": checks})
        return
    table = make_table(["CHECK", "SCOPE", "READS, AND WHAT CRIT AND WARN MEAN"], [])
    for doc in checks:
        cell = text(doc.reads)
        for status, meaning in (("CRIT", doc.crit), ("WARN", doc.warn)):
            if meaning:
                cell.append(Text(f"\n{status}: ", STATUS_STYLES[status.lower()]))
                cell.append(text(meaning))
        scope = doc.scope + (" (server)" if doc.needs_server else "")
        table.add_row(text(doc.id), text(scope), cell)
    console().print(table)


def _line(f: dict[str, Any]) -> str:
    action = f" — {f['action']}" if f.get("action") else ""
    return f"{f['status'].upper()} {f['node']} {f['check']}: {f['finding']}{action}"


def _table(findings: list[dict[str, Any]]) -> Any:
    """One row per finding, grouped by node (the node named once, a rule between groups); what to
    do under a finding that is not ok."""
    from rich.text import Text

    table = make_table(["NODE", "CHECK", "STATUS", "FINDING"], [])
    group = None
    for f in findings:
        first = f["node"] != group
        if first and group is not None:
            table.add_section()
        group = f["node"]
        cell = text(f["finding"])
        if f.get("action"):
            cell.append(Text("\n→ "))
            cell.append(text(f["action"], "dim"))
        table.add_row(text(f["node"]) if first else "", text(f["check"]),
                      text(f["status"].upper(), STATUS_STYLES.get(f["status"], "")), cell)
    return table


def _status_line(data: dict[str, Any]) -> str:
    """The Nagios plugin's first line: the verdict, the counts, and the counts as perfdata."""
    s = data["summary"]
    nodes = f"{s['nodes']} node{'s' if s['nodes'] != 1 else ''}"
    summary = (f"{nodes}, {len(data['findings'])} findings: {s['crit']} crit, {s['warn']} warn, "
               f"{s['unknown']} unknown, {s['ok']} ok")
    perf: dict[str, Any] = {k: s[k] for k in ("crit", "warn", "unknown", "ok", "nodes")}
    if isinstance(data.get("took"), int | float):
        perf["took"] = f"{data['took']:.3f}s"
    return plugin_line(SERVICE, data["status"], summary, perf)


@click.command(cls=NagiosCommand)
@click.option("--node", "node_id", shell_complete=complete.NODES,
              help="Only this node's checks (the fleet-wide checks are left out).")
@click.option("--local", is_flag=True, help="Run the node checks on this machine, with no server (a node being "
              "brought up): the agent's own discovery, with --config's settings.")
@click.option("--config", "config_path", envvar="LLMGW_AGENT_CONFIG", type=click.Path(dir_okay=False),
              help="With --local: the agent config (discovery, fabrics, model cache, certificate). "
                   "[env: LLMGW_AGENT_CONFIG]")
@click.option("--interval", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="With --local: seconds between the two readings of the error counters.")
@click.option("--only", "only", multiple=True, metavar="ID,...", shell_complete=_complete_checks,
              help="Run only these checks (comma-separated or repeated; `--list` shows the ids).")
@click.option("--skip", "skip", multiple=True, metavar="ID,...", shell_complete=_complete_checks,
              help="Leave these checks out (comma-separated or repeated).")
@click.option("--check", "check", type=click.Choice(CHECKS), help="Run only this check (the same as --only ID).")
@click.option("--list", "list_checks", is_flag=True, help="List every check: its id, what it reads, what its "
              "CRIT and WARN mean (no server needed).")
@click.option("-q", "--quiet", is_flag=True, help="Print the status line and what is not ok, one line each "
              "(the table left out).")
@output_option
@click.pass_context
def doctor(ctx: click.Context, node_id: str | None, local: bool, config_path: str | None, interval: float,
           only: tuple[str, ...], skip: tuple[str, ...], check: str | None, list_checks: bool, quiet: bool,
           output: str) -> None:
    """Check nodes and the fleet: agents, GPUs, NVLink, adapters, ports, counters (hw_counters as
    rates), memlock, disk, certificates, clocks, fabrics, replicas, and driver and firmware versions
    that differ across nodes. Each finding says what to do when it is not ok; --list says what
    each check reads.

    The first line is a Nagios plugin's: `LLMGW DOCTOR OK - <counts> | crit=0 warn=0 ...`, then the
    table (or, with --quiet, one line per finding that is not ok).

    \b
    Exit codes (Nagios): 0 all ok, 1 warning, 2 critical, 3 could not run.
    llmgw ctl doctor                 # the whole fleet
    llmgw ctl doctor --quiet         # Nagios/Icinga: the status line and what is wrong
    chronic llmgw ctl doctor --quiet # cron (moreutils): mail only when it exits non-zero
    llmgw ctl doctor --local --config /etc/llmgw/agent.yaml
    llmgw ctl doctor --list          # every check: what it reads, what CRIT and WARN mean
    llmgw ctl doctor --skip firmware-versions,clock
    """
    if list_checks:
        _print_list(output)
        return
    from llmgw.doctor.catalog import UnknownCheck, listing, select, split_ids

    try:
        checks = select([*only, *([check] if check else [])], skip)
    except UnknownCheck as exc:  # bad usage: UNKNOWN (3) through NagiosCommand, one line
        raise click.UsageError(str(exc)) from None
    if local and checks is not None:
        here = {doc.id for doc in listing() if doc.scope == "node" and not doc.needs_server}
        if not checks & here:
            raise click.UsageError(f"--local runs this machine's node checks; {', '.join(sorted(checks))} "
                                   "need a server (the fleet's checks compare nodes)")
    try:
        data = _report(ctx, local, config_path, node_id, checks, interval,
                       split_ids([*only, *([check] if check else [])]), split_ids(skip))
    except CouldNotRun as exc:  # Nagios shows stdout's first line: "(No output returned from plugin)" otherwise
        if output != "json":
            say(plugin_line(SERVICE, "unknown", f"could not run: {exc}"))
        raise
    findings = data["findings"]
    if quiet:
        findings = [f for f in findings if f["status"] != "ok"]
    if output == "json":
        print_json({**data, "findings": findings})
    else:
        out = console()
        out.print(text(_status_line(data), STATUS_STYLES.get(data["status"], "")), soft_wrap=True)
        if quiet:
            for f in findings:
                out.print(text(_line(f)), soft_wrap=True)
        else:
            out.print(_table(findings))
    sys.stdout.flush()
    sys.exit(int(data["exit_code"]))


def _report(ctx: click.Context, local: bool, config_path: str | None, node_id: str | None,
            checks: frozenset[str] | None, interval: float, only: list[str], skip: list[str]) -> dict[str, Any]:
    if local:
        try:
            return _local_report(config_path, node_id, checks, interval)
        except UsageError as exc:  # no config, a bad one, --node of another machine: doctor could not run
            raise CouldNotRun(str(exc)) from None
    # As given (checked here already): a newer server runs its own new checks under --skip.
    query = urlencode({k: v for k, v in (("node", node_id), ("only", ",".join(only)), ("skip", ",".join(skip))) if v})
    try:
        data: dict[str, Any] = api(ctx).get("/api/v1/doctor" + (f"?{query}" if query else ""))
    except LlmgwError as exc:  # a usage error too (--server's URL): could not run, never CRITICAL
        raise CouldNotRun(str(exc)) from None
    return data
