"""`llmgw ctl fabric-test A B`: measure every rail between two nodes with ib_write_bw, from one terminal.

The server runs it over the agents' streams (server/fabric_test.py); this command starts it, prints
each step on stderr as it happens, then a table (or `-o json`) and exits as a Nagios plugin: 0 every
rail ok, 1 a rail at warn, 2 a rail crit or failed, 3 the test could not run (a node not connected,
an agent without the feature, the same node twice, the server unreachable or refusing the credential):
a check that could not run never reads as a warning.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import click

from llmgw.cli import complete
from llmgw.cli.render import (
    NagiosCommand,
    console,
    make_table,
    output_option,
    print_json,
    say,
    text,
)
from llmgw.errors import LlmgwError
from llmgw.verdict import plugin_line

SERVICE = "LLMGW FABRIC-TEST"
GRADE_STYLES = {"ok": "green", "warn": "yellow", "crit": "red", "unknown": "magenta"}


class CouldNotRun(LlmgwError):
    """The test did not run: the Nagios 'unknown' exit."""

    exit_code = 3


def _gbps(value: Any) -> str:
    return "-" if value is None else f"{value:g} Gb/s"


def _progress(event: dict[str, Any]) -> str:
    kind = event.get("event")
    if kind == "start":
        how = f", {event['duration']} s each (ib_write_bw -D)" if event.get("duration") else ""
        how += ", buffers in GPU memory (GPUDirect RDMA)" if event.get("gpudirect") else ""
        return (f"testing {len(event.get('rails') or [])} rails: {event.get('a')} (client) → "
                f"{event.get('b')} (server){how}")
    if kind == "rail_start":
        return f"rail {event.get('rail')} ({event.get('fabric')}): {event.get('a')} → {event.get('b')} ..."
    if kind == "rail":
        line = (f"rail {event.get('rail')}: {_gbps(event.get('measured_gbps'))} of "
                f"{_gbps(event.get('expected_gbps'))}: {event.get('status')}")
        return line + (f" ({event['detail']})" if event.get("detail") else "")
    if kind == "note":
        return f"{event.get('node')}: {event.get('message')}"
    return str(event.get("message") or "")


def status_line(report: dict[str, Any]) -> str:
    """The Nagios plugin's first line: the verdict, the rails by grade, each rail's Gb/s as perfdata."""
    rails = report.get("rails") or []
    counts = {grade: sum(1 for r in rails if r.get("status") == grade) for grade in ("crit", "warn", "unknown", "ok")}
    summary = (f"{report.get('a')} → {report.get('b')}: {len(rails)} rails: "
               + ", ".join(f"{n} {g}" for g, n in counts.items()))
    perf: dict[str, Any] = dict(counts)
    for r in rails:
        if r.get("measured_gbps") is not None:
            perf[_label(f"{r.get('fabric')}_{r.get('rail')}_gbps")] = f"{r['measured_gbps']:g}"
    if report.get("error"):
        summary += f" ({report['error']})"
    return plugin_line(SERVICE, str(report.get("status") or "unknown"), summary, perf)


def _label(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def render(report: dict[str, Any], quiet: bool = False) -> None:
    out = console()
    out.print(text(status_line(report), GRADE_STYLES.get(str(report.get("status")), "")), soft_wrap=True)
    if quiet:
        for r in report.get("rails") or []:
            if r.get("status") != "ok":
                detail = f": {r['detail']}" if r.get("detail") else ""
                out.print(text(f"{str(r.get('status')).upper()} rail {r.get('fabric')}#{r.get('rail')} "
                               f"{r.get('a')} → {r.get('b')}: {_gbps(r.get('measured_gbps'))} of "
                               f"{_gbps(r.get('expected_gbps'))}{detail}"),
                          soft_wrap=True)
        return
    rows = []
    for r in report.get("rails") or []:
        ratio = r.get("ratio")
        rows.append((
            f"{r.get('fabric')}#{r.get('rail')}",
            r.get("a") or "-",
            r.get("b") or "-",
            _gbps(r.get("measured_gbps")),
            _gbps(r.get("expected_gbps") or None),
            "-" if ratio is None else f"{ratio:.0%}",
            text(r.get("status"), GRADE_STYLES.get(str(r.get("status")), "")),
            r.get("detail") or "",
        ))
    a, b = report.get("a"), report.get("b")
    out.print(make_table(["RAIL", f"ADAPTER {a}", f"ADAPTER {b}", "MEASURED", "EXPECTED", "RATIO", "GRADE", "DETAIL"],
                         rows))


@click.command("fabric-test", cls=NagiosCommand)
@click.argument("node_a", shell_complete=complete.FABRIC_A)
@click.argument("node_b", shell_complete=complete.FABRIC_B)
@click.option("--rail-timeout", type=click.FloatRange(1, 600), default=60.0, show_default=True,
              help="Seconds one rail's ib_write_bw may run before it is killed.")
@click.option("--duration", type=click.IntRange(0, 597), default=None,
              help="Seconds each rail runs (ib_write_bw -D); 0: --iterations of --size instead. Must leave 3 s of "
                   "--rail-timeout for perftest to start.  [default: 5, or what fits in --rail-timeout]")
@click.option("--size", type=click.IntRange(1, 1 << 30), default=65536, show_default=True, help="Message size (-s).")
@click.option("--iterations", type=click.IntRange(1, 10_000_000), default=5000, show_default=True,
              help="Iterations (-n), with --duration 0.")
@click.option("--gpudirect", is_flag=True,
              help="Put both sides' buffers in GPU memory (ib_write_bw --use_cuda=N, N the GPU nearest each rail's HCA "
                   "on the PCIe tree): tests "
                   "GPUDirect RDMA, the path NCCL takes. Refused where a node has no GPU.")
@click.option("-q", "--quiet", is_flag=True,
              help="Print the status line and the rails that are not ok (no progress, no table).")
@output_option
@click.pass_context
def fabric_test(ctx: click.Context, node_a: str, node_b: str, rail_timeout: float, duration: int | None, size: int,
                iterations: int, gpudirect: bool, quiet: bool, output: str) -> None:
    """Measure every rail between two nodes: ib_write_bw for 5 s (-D), adapter by adapter (the Nth
    of A to the Nth of B, as NCCL pairs them), one rail at a time, each graded against what it can
    carry: the link's data rate (4X QDR signals 40 Gb/s and carries 32 after 8b/10b; 64b/66b from
    FDR on), or the HCA's PCIe link where that is lower ("limited by PCIe gen3 x8"). Ok from 90 %,
    warn from 70 %, crit below or failed. NODE_B runs the server side.

    The first line is a Nagios plugin's (`LLMGW FABRIC-TEST OK - ... | crit=0 ... ib_0_gbps=392.3`),
    then the table; progress goes to stderr.

    \b
    Exit codes: 0 all ok, 1 a warn, 2 a crit, 3 could not run.
    llmgw ctl fabric-test gpu-01 gpu-02
    llmgw ctl fabric-test gpu-01 gpu-02 --duration 30 --rail-timeout 60
    llmgw ctl fabric-test gpu-01 gpu-02 --gpudirect
    """
    body: dict[str, Any] = {"a": node_a, "b": node_b, "timeout": rail_timeout, "size": size, "iterations": iterations}
    if duration is not None:
        body["duration"] = duration
    if gpudirect:
        body["gpudirect"] = True
    report: dict[str, Any] | None = None
    try:
        client = ctx.obj["api"]()  # a bad --cert or --ca: could not run, too
        for line in client.stream_lines("/api/v1/fabric-tests", method="POST", body=body):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                raise LlmgwError(f"the server sent a line that is not JSON: {line[:200]}") from None
            if event.get("event") == "done":
                report = event
            elif not quiet:
                say(_progress(event), stderr=True)
        if report is None:
            raise CouldNotRun(f"fabric test {node_a} → {node_b}: the server ended the answer without a report")
    except LlmgwError as exc:  # refused (no such node, a credential, not connected) or the answer broke off
        failed = (exc if isinstance(exc, CouldNotRun)
                  else CouldNotRun(f"fabric test {node_a} → {node_b} could not run: {exc}"))
        if output != "json":  # Nagios reads stdout's first line
            say(plugin_line(SERVICE, "unknown", str(failed)))
        raise failed from None
    if output == "json":
        print_json(report)
    else:
        render(report, quiet)
        if report.get("error"):
            say(report["error"], stderr=True)
    sys.exit(int(report.get("exit_code", 3)))
