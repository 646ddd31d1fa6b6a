"""Each engine is probed once per machine, not once per gateway worker (issue 42): a server with
`gateway.workers: 3` asks an engine for its /health and /metrics at one process's rate, where
each worker used to ask too (N + 1 probes of every engine), and every worker still takes an
engine that fails its health checks out of rotation and puts it back when it passes again (the
server's results reach them on the gateway feed).

The engine is a counting one, in this process, so that every probe from any process is seen."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import FAST_FLEET, Proc, Server, wait_until

WORKERS = 3
HEALTH_INTERVAL = 0.1  # seconds: one process checks an engine 10 times a second
SCRAPE_INTERVAL = 0.2
METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"


class CountingEngine(ThreadingHTTPServer):
    """Answers GET /health (200, or 503 while `sick`) and GET /metrics, and counts them."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.counts = {"/health": 0, "/metrics": 0}
        self.sick = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, path: str) -> int:
        with self.lock:
            return self.counts[path]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the gateway's engine pools expect
    server: CountingEngine

    def do_GET(self) -> None:
        engine = self.server
        path = self.path.split("?", 1)[0]
        with engine.lock:
            if path in engine.counts:
                engine.counts[path] += 1
        if path == "/health":
            status, body = (503, b"sick") if engine.sick else (200, b"")
        elif path == "/metrics":
            status, body = 200, METRICS
        else:
            status, body = 404, b""
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[CountingEngine]:
    server = CountingEngine()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def per_worker(server: Server, name: str, endpoint: str) -> dict[str, float]:
    """One endpoint's gauge in every worker (the server's /metrics labels each worker's)."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'worker="' in line and f'endpoint="{endpoint}"' in line:
            labels, value = line.rsplit(" ", 1)
            out[labels.split('worker="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def rates(engine: CountingEngine, hits: int) -> tuple[float, float]:
    """Health checks and scrapes per second the engine gets while `hits` health checks come."""
    health0, metrics0, t0 = engine.count("/health"), engine.count("/metrics"), time.monotonic()
    wait_until(lambda: engine.count("/health") >= health0 + hits, f"{hits} health checks of the engine")
    took = time.monotonic() - t0
    return (engine.count("/health") - health0) / took, (engine.count("/metrics") - metrics0) / took


def test_engines_are_probed_once_for_all_workers(tmp_path: Path, procs: list[Proc], engine: CountingEngine) -> None:
    config = FAST_FLEET + f"""\
gateway:
  workers: {WORKERS}
  health_interval: {HEALTH_INTERVAL}s
  health_timeout: 1s
  health_failures: 2
  scrape_interval: {SCRAPE_INTERVAL}s
endpoints:
  - model: chat
    url: {engine.url}
"""
    server = Server(tmp_path, config)
    procs.append(server.start())
    names = {f"worker-{i}" for i in range(WORKERS)}
    wait_until(lambda: set(per_worker(server, "llmgw_engine_up", engine.url)) == names and
               all(per_worker(server, "llmgw_engine_up", engine.url).values()),
               f"{WORKERS} workers following, each with the engine up", procs=procs)

    # One process asks: at most one health check per interval (each round waits for the next
    # interval, and at most one check of an endpoint is in flight), one scrape per scrape
    # interval; with every worker asking too it was WORKERS + 1 times that.
    health, scrapes = rates(engine, hits=30)
    assert health <= 1.5 / HEALTH_INTERVAL, f"{health:.1f} health checks/s: more than one process probes the engine"
    assert scrapes <= 1.5 / SCRAPE_INTERVAL, f"{scrapes:.1f} scrapes/s: more than one process scrapes the engine"
    assert health >= 0.3 / HEALTH_INTERVAL, f"{health:.1f} health checks/s"  # and the one that asks does

    # Every worker takes the server's results as its own: out of rotation when the checks fail,
    # back when they pass.
    engine.sick = True
    wait_until(lambda: (h := per_worker(server, "llmgw_endpoint_healthy", engine.url)) and set(h) == names and
               not any(h.values()), "every worker to take the failing engine out of rotation", procs=procs)
    engine.sick = False
    wait_until(lambda: (h := per_worker(server, "llmgw_endpoint_healthy", engine.url)) and set(h) == names and
               all(h.values()), "every worker to put it back", procs=procs)
    health, _ = rates(engine, hits=20)
    assert health <= 1.5 / HEALTH_INTERVAL, f"{health:.1f} health checks/s after the engine came back"
