"""The server killed alone (kill -9 of its pid, outside systemd, whose cgroup kill would take its
workers too): its gateway workers used to outlive it, keep the public port and follow the next
server beside its own workers, so admission doubled and `ctl gateways` listed every name twice
(issue 41, finding 4). Now each worker reads EOF on a pipe from its server and exits, and a
server refuses a worker that presents another start's key."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.harness import FAST_FLEET, Proc, Server, ctl_json, pid_alive, wait_until
from tests.faults.fleet import MODEL, Fleet, Load, metric

DEADLINE = 10.0  # seconds the orphaned workers get to exit: requests in flight finish first (~0.1 s)


def workers(server: Server) -> list[dict[str, Any]]:
    return [g for g in server.get("/api/v1/gateways") if g["kind"] == "worker"]


def port_free(port: int) -> bool:
    """Nobody holds the port: a plain bind (no SO_REUSEPORT, which would share it) succeeds."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_workers_end_with_a_killed_server_and_the_next_has_only_its_own(tmp_path: Path, procs: list[Proc]) -> None:
    fleet = Fleet(tmp_path, procs, extra_config="  workers: 2\n")  # continues FAULT_GATEWAY's section
    server = fleet.server
    wait_until(lambda: len(workers(server)) == 2, "both workers to follow")
    old = {g["pid"] for g in workers(server)}
    with Load(fleet.url) as load:
        load.wait_successes(20, "traffic through the workers")
        assert server.proc is not None
        server.proc.kill9()  # the server alone: its workers are not signalled
        killed = time.monotonic()
        procs.remove(server.proc)
        wait_until(lambda: not any(pid_alive(p) for p in old), "the orphaned workers to exit", deadline=DEADLINE)
        exited = time.monotonic() - killed
        wait_until(lambda: port_free(server.public_port), "the public port to be free", deadline=DEADLINE)
        free = time.monotonic() - killed
        procs.append(server.start())
        listening = time.monotonic()
        wait_until(lambda: len(workers(server)) == 2, "the new server's workers to follow", procs=[server.proc])
        load.wait_successes(20, "traffic through the new workers")
    listed = ctl_json(fleet.url, "gateways")
    names = sorted(g["name"] for g in listed if g["kind"] == "worker")
    assert names == ["worker-0", "worker-1"], listed
    assert not old & {g["pid"] for g in listed}, listed
    failures = load.failures(avoidable_only=False)
    after = [o for o in failures if o.started > listening]
    load.report("server with 2 local workers, kill -9 of the server alone, restart",
                f"workers exited {exited:.1f}s after the kill, port free {free:.1f}s after; {len(after)} failed after "
                f"the new server listened ({len(failures)} while none listened); the new server lists "
                "only its 2 workers")
    assert not after, after[:3]
    for pid in old:
        assert f"(pid {pid}) refused" not in server.proc.log()  # they were gone, not refused
    log = (tmp_path / "server.log").read_text()
    assert "is gone; exiting (a new server starts its own workers)" in log


def test_a_worker_draining_when_its_server_died_finishes_and_never_follows_the_next(tmp_path: Path,
                                                                                   procs: list[Proc]) -> None:
    """A worker with a stream in flight when its server died stops accepting and finishes it (up
    to shutdown_grace) before it exits; meanwhile it dials the next server's gateway.sock with its
    old key and is refused, so the next server lists only its own workers even then."""
    fleet = Fleet(tmp_path, procs, extra_config="  workers: 2\n")
    server = fleet.server
    wait_until(lambda: len(workers(server)) == 2, "both workers to follow")
    old = {g["pid"] for g in workers(server)}
    events: list[int] = []
    errors: list[str] = []

    def long_stream() -> None:  # ~15 s of tokens (10 ms apart), longer than the next server takes to start
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}],
                                                    max_tokens=1500, stream=True, extra_body={"ignore_eos": True}):
                events.append(1)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    stream = threading.Thread(target=long_stream, daemon=True)
    stream.start()
    wait_until(lambda: len(events) >= 10 or errors, "the stream to flow")
    assert server.proc is not None
    server.proc.kill9()
    killed = time.monotonic()
    procs.remove(server.proc)
    wait_until(lambda: sum(pid_alive(p) for p in old) == 1, "the idle worker to exit, the other to drain")
    idle_exit = time.monotonic() - killed
    draining = next(p for p in old if pid_alive(p))
    procs.append(server.start())
    wait_until(lambda: len(workers(server)) == 2, "the new server's workers to follow", procs=[server.proc])
    refused = f"(pid {draining}) refused on the local feed: its worker key is not this server's"
    wait_until(lambda: refused in server.proc.log() or not pid_alive(draining),
               "the draining worker to dial the next server")
    assert sorted(g["name"] for g in workers(server)) == ["worker-0", "worker-1"]
    assert draining not in {g["pid"] for g in workers(server)}
    stream.join(timeout=60)
    done = time.monotonic()
    assert not errors, errors
    assert len(events) >= 1500, len(events)
    wait_until(lambda: not pid_alive(draining), "the draining worker to exit once its stream is done",
               deadline=DEADLINE)
    print("FAULT server with 2 local workers, kill -9 alone with a stream in flight: idle worker exited "
          f"{idle_exit:.1f}s "
          f"after the kill; the stream ({len(events)} chunks) finished {done - killed:.1f}s after, its worker exited "
          f"{time.monotonic() - done:.1f}s later; refused by the next server meanwhile: {refused in server.proc.log()}")
    assert refused in server.proc.log()


@pytest.mark.parametrize("key", ["wrong", None], ids=["wrong-key", "no-key"])
def test_a_worker_that_is_not_the_servers_own_is_refused(tmp_path: Path, procs: list[Proc], key: str | None) -> None:
    server = Server(tmp_path, FAST_FLEET + "gateway:\n  workers: 2\n")
    procs.append(server.start())
    wait_until(lambda: len(workers(server)) == 2, "both workers to follow", procs=[server.proc])
    stray = Proc("stray-worker", ["gateway", "--worker", "7", "--feed-socket", str(server.state_dir / "gateway.sock"),
                                  "--listen", f"127.0.0.1:{server.public_port}"], tmp_path,
                 env={"LLMGW_WORKER_KEY": key} if key is not None else None)
    procs.append(stray)
    wait_until(lambda: not stray.alive(), "the stray worker to be refused and exit", deadline=DEADLINE)
    assert stray.popen.returncode == 1
    assert "this server did not start this worker" in stray.log()
    why = "its worker key is not this server's" if key else "it presented no worker key"
    assert f"gateway worker-7 (pid {stray.pid}) refused on the local feed: {why}" in server.proc.log()
    assert sorted(g["name"] for g in workers(server)) == ["worker-0", "worker-1"]
    assert metric(server.url, "llmgw_fleet_refused_total", reason="not_own_worker") == 1
