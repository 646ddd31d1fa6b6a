"""What every benchmark needs: a free port, a process's CPU time from /proc, and what the machine
charges for keeping both its cores busy."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path

import llmgw
from llmgw import hotpath
from llmgw.agent.procs import cpu_seconds

__all__ = ["cpu_seconds", "cpu_tree", "free_port", "pair_factor"]


def descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (alive now), from /proc/PID/task/*/children."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def cpu_tree(pid: int) -> float:
    """CPU seconds of a process and every descendant alive now (nginx's worker under its master,
    llmgw's gateway workers under the server)."""
    total = cpu_seconds(pid)
    for child in descendants(pid):
        try:
            total += cpu_seconds(child)
        except ProcessLookupError:
            pass
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build() -> str:
    """Which llmgw the bench's processes run (they inherit this interpreter's path): `make
    bench-*` measures the compiled build a regular install runs."""
    return f"llmgw from {Path(llmgw.__file__).parent.parent}, {hotpath.summary()}"


def _python_work(cpu: int, iterations: int, out: multiprocessing.Queue[float]) -> None:
    """A fixed piece of interpreter work (what a gateway worker does most: JSON, bytes, dicts) on one core."""
    import json

    os.sched_setaffinity(0, {cpu})
    doc = {"model": "bench", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 16}
    started = time.process_time()
    for _ in range(iterations):
        body = json.dumps(doc).encode()
        json.loads(body)
        body.split(b",")
    out.put(time.process_time() - started)


def pair_factor(rounds: int = 8, iterations: int = 30_000) -> float:
    """CPU seconds the same Python work takes with two copies at once (one per core) ÷ with one alone,
    alternated `rounds` times. Not 1.0 on a VM whose cores share a physical core or its caches with
    each other or a neighbour: the machine's own cost of having both cores busy, which any
    comparison of one busy worker against two carries. NaN with fewer than 2 cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return float("nan")
    ctx = multiprocessing.get_context("fork")

    def run(cpus: list[int]) -> float:
        out: multiprocessing.Queue[float] = ctx.Queue()
        procs = [ctx.Process(target=_python_work, args=(c, iterations, out)) for c in cpus]
        for p in procs:
            p.start()
        spent = sum(out.get() for _ in procs) / len(procs)
        for p in procs:
            p.join()
        return spent

    alone = pair = 0.0
    for i in range(rounds):
        alone += run([cores[i % 2]])
        pair += run(cores[:2])
    return pair / alone
