"""Machinery of the fault suite: a real fleet (server, two agents, a model with two replicas of
the simulated engine), a steady openai-client load through the gateway that records every
outcome with its time, and the check that nothing is left running afterwards.

Health timings are shortened so that a test detects a hung engine in about a second and a half
instead of the defaults' few seconds (see FAULT_GATEWAY); everything else is the production path.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.e2e.harness import (
    Proc,
    Server,
    get_json,
    make_sim_node,
    replicas,
    start_agent,
    wait_until,
)

MODEL = "chat"

# Shorter than the defaults (1 s interval, 1 s timeout, 3 failures; 30 s stream head), so a hang
# is detected in ~1.5 s. Timeouts stay well above what a loaded 2-core machine needs to answer
# /health, so a healthy engine is never taken out (that would fail the zero-failure assertion).
FAULT_GATEWAY = """\
gateway:
  scrape_interval: 0.5s
  health_interval: 0.25s
  health_timeout: 0.75s
  health_failures: 3
  stream_head_timeout: 3s
  breaker_failures: 3
  breaker_cooldown: 1s
"""

FAULT_FLEET = """\
fleet:
  heartbeat_interval: 0.25s
  unreachable_after: 3
  lost_after: 2s
  register_timeout: 2s
reconcile:
  tick: 0.5s
  settle: 0.5s
  backoff_initial: 0.5s
  backoff_max: 2s
"""

CATALOG = f"""\
models:
  - name: {MODEL}
    replicas: 2
    profiles:
      - engine: sim
        gpus: 1
        args: ["--ttft-ms", "20", "--itl-ms", "10"]
"""

# A quick reconnect (the server-restart test needs agents back within 2 s of it listening) and
# the agents' own health checks of ready engines shortened like the gateway's.
FAULT_AGENT = """\
backoff:
  initial: 0.1s
  max: 0.4s
engine_health:
  interval: 0.25s
  timeout: 0.75s
  failures: 3
"""


class Fleet:
    """A server and two nodes of one GPU each (so the two replicas are on different nodes); a
    test that needs room for a replacement adds a node with `add_node`."""

    def __init__(self, tmp: Path, procs: list[Proc], extra_config: str = "",
                 fleet_via: Callable[[int], str] | None = None) -> None:
        """`fleet_via(fleet_port)`: the URL agents dial instead of the server's (a proxy)."""
        self.tmp = tmp
        self.procs = procs
        self.server = Server(tmp, FAULT_FLEET + FAULT_GATEWAY + extra_config + CATALOG)
        procs.append(self.server.start())
        self.agents: dict[str, Proc] = {}
        self.agent_configs: dict[str, Path] = {}
        fleet_url = fleet_via(self.server.fleet_port) if fleet_via else self.server.fleet_url
        for node in ("gpu-01", "gpu-02"):
            cfg = make_sim_node(tmp, node, fleet_url, FAULT_AGENT, "--gpus", "1")
            self.agent_configs[node] = cfg
            self.start_agent(node)
        self.wait_ready(2, "two replicas ready")

    @property
    def url(self) -> str:
        return self.server.url

    def add_node(self, node: str, gpus: int = 1) -> Proc:
        self.agent_configs[node] = make_sim_node(self.tmp, node, self.server.fleet_url, FAULT_AGENT,
                                                 "--gpus", str(gpus))
        return self.start_agent(node)

    def start_agent(self, node: str) -> Proc:
        proc = start_agent(self.tmp, node, self.agent_configs[node], "--stop-engines-on-exit")
        self.procs.append(proc)
        self.agents[node] = proc
        return proc

    def ready(self) -> list[dict[str, Any]]:
        return [r for r in replicas(self.server) if r["state"] == "ready" and r["model"] == MODEL]

    def in_rotation(self) -> dict[str, dict[str, Any]]:
        return {e["endpoint"]: e for e in get_json(f"{self.url}/api/v1/endpoints") if e["model"] == MODEL}

    def wait_ready(self, n: int, what: str, deadline: float = 60) -> list[dict[str, Any]]:
        """n ready replicas, every one of them in the gateway's rotation and healthy."""

        def check() -> list[dict[str, Any]] | None:
            ready = self.ready()
            eps = self.in_rotation()
            ok = len(ready) == n and all(eps.get(r["shards"][0]["endpoint"], {}).get("healthy") for r in ready)
            return ready if ok else None

        return wait_until(check, what, deadline=deadline, procs=[p for p in self.procs if p is self.server.proc])


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def engine_pids(tmp: Path) -> set[int]:
    """Simulated engines running for this test (they run in their agent's work dir)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            cwd = os.readlink(entry / "cwd")
            alive = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            continue
        if alive and b"sim\0engine" in cmdline and cwd.startswith(str(tmp)):
            pids.add(int(entry.name))
    return pids


class CutProxy:
    """A TCP relay between agents and the server's fleet port that can cut every connection in
    the middle of the next bytes an agent sends (half of them go through, then both sides are
    closed): a fleet connection lost mid-message."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = 0
        self._cut = threading.Event()
        self.cuts = 0  # connections cut mid-message
        self.conns: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()

    def start(self, target_port: int) -> str:
        self.target = target_port
        threading.Thread(target=self._accept, daemon=True).start()
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._cut.set()

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for a, b in self.conns:
                for sock in (a, b):
                    sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                self._cut.clear()  # connections made after a cut go through
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self.conns.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_agent: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_agent and self._cut.is_set() and len(data) > 1:
                    dst.sendall(data[: len(data) // 2])
                    self.cuts += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def engine_counter(endpoint: str, name: str) -> float:
    text = httpx.get(f"{endpoint}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    stream: bool
    error: str = ""
    mid_stream: bool = False  # a stream that failed after events reached the client


@dataclass
class Load:
    """`workers` threads, each sending one request after another through the gateway with the
    official openai client (no client retries), alternating plain and streamed chat."""

    url: str
    workers: int = 4
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for i in range(self.workers):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self, n: int) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)
        k = 0
        while not self._stop.is_set():
            k += 1
            stream = k % 2 == 0
            started = time.monotonic()
            events = 0
            try:
                if stream:
                    for _ in client.chat.completions.create(model=MODEL,
                                                            messages=[{"role": "user", "content": f"s{n}.{k}"}],
                                                            max_tokens=4, stream=True):
                        events += 1
                    ok = events > 0
                    error = "" if ok else "no events"
                else:
                    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"r{n}.{k}"}],
                                                       max_tokens=4)
                    ok, error = bool(r.choices), ""
            except Exception as exc:
                ok, error = False, f"{type(exc).__name__}: {exc}"
            self.outcomes.append(Outcome(started, time.monotonic(), ok, stream, error,
                                         mid_stream=not ok and events > 0))
            if not ok:
                time.sleep(0.05)  # ok: a failing client paces itself instead of spinning on refusals

    def successes(self) -> int:
        return sum(1 for o in self.outcomes if o.ok)

    def wait_successes(self, more: int, what: str, deadline: float = 60) -> None:
        target = self.successes() + more
        wait_until(lambda: self.successes() >= target, what, deadline=deadline)

    def failures(self, *, avoidable_only: bool = True) -> list[Outcome]:
        """Failed requests; by default not streams cut after events reached the client (no other
        replica could have served those bytes)."""
        return [o for o in self.outcomes if not o.ok and not (avoidable_only and o.mid_stream)]

    def report(self, fault: str, recovered: str) -> str:
        cut = sum(1 for o in self.outcomes if o.mid_stream)
        slowest = max((o.ended - o.started for o in self.outcomes if o.ok), default=0.0)
        line = (f"FAULT {fault}: {len(self.outcomes)} requests, {len(self.failures())} failed, {cut} streams cut "
                "mid-stream, "
                f"slowest success {slowest:.2f}s; {recovered}")
        print(line)
        return line


def strays(tmp: Path) -> list[str]:
    """Processes still running that belong to this test: started with a path under `tmp` in their
    command line, or running in a directory under it (engines run in their agent's work dir)."""
    mine = str(tmp)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if mine in cmdline or cwd.startswith(mine):
            found.append(f"{entry.name}: {cmdline.strip()[:200]}")
    return found
