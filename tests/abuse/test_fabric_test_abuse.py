"""Abuse of `ctl fabric-test` through the doors production uses (issue 40, findings 6 and 7): a real
`llmgw server` with a mutual-TLS fleet port, scripted agents on real streams (tests/abuse/door.py),
the real `llmgw ctl fabric-test`.

- A forged node B answers "ready" naming a system port (22) and a host of its own: refused with one
  line, A is never sent anywhere; with a legal port A is sent B's registered address, not B's host.
- A node saying "progress" forever during prepare is cut at the phase deadline fixed when the phase
  started (`fabric.test_install_wait`, small here).
- While one pair hangs like that, a test of two other nodes runs to the end at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import trio

from llmgw import __version__
from llmgw.wire import messages as m
from tests.abuse.door import Agent, Certs, make_ca, report
from tests.abuse.test_control_plane import OPERATOR, operator_yaml
from tests.e2e.harness import FAST_FLEET, Proc, Server, ctl, llmgw_env, wait_until_async

TABLE = (" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
         " 65536      5000             392.38             392.34 \t\t     0.748336\n")
FOREIGN = "169.254.169.254"  # where a forged B would like A's client to go


def rdma_node(server: Server, certs: Certs, node_id: str) -> Agent:
    """A scripted agent that can run fabric tests: one 400 Gb/s InfiniBand port on fabric ib."""
    register = m.Register(
        node_id=node_id, version=__version__, features=[m.FEATURE_FABRIC_TEST],
        inventory=m.Inventory(ports=[m.Port(device="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0)]),
        fabric_status=[m.FabricStatus(name="ib", devices=["mlx5_0"], usable=True, ports=["mlx5_0:1"], rate_gbps=400.0)])
    agent = Agent(server.fleet_url, certs, node_id, register)
    agent.answer = honest
    return agent


async def honest(msg: msgspec.Struct) -> AsyncIterator[msgspec.Struct]:
    """What a healthy agent answers, quickly: ready on a high port, then a 392 Gb/s table."""
    if not isinstance(msg, m.FabricTest):
        return
    if msg.role == "server":
        yield m.FabricTestResult(request_id=msg.request_id, phase="ready", ok=True, tcp_port=18515)
        await trio.sleep(0.2)  # ok: the client's run, as an agent's perftest takes it
    yield m.FabricTestResult(request_id=msg.request_id, ok=True, output="" if msg.role == "prepare" else TABLE)


async def progress_forever(msg: msgspec.Struct) -> AsyncIterator[msgspec.Struct]:
    """A node that says it is installing perftest, every 0.2 s, and never finishes."""
    if not isinstance(msg, m.FabricTest):
        return
    while True:
        yield m.FabricTestResult(request_id=msg.request_id, phase="progress", ok=True,
                                 notes=["ib_write_bw missing: installing perftest with apt-get"])
        await trio.sleep(0.2)  # ok: the forged agent's pace, not a wait for a condition


def sent(agent: Agent, role: str) -> list[m.FabricTest]:
    return [x for x in agent.received if isinstance(x, m.FabricTest) and x.role == role]


def fabric_test(server: Server, a: str, b: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    result = ctl(server.url, "fabric-test", a, b, "--rail-timeout", "5", env=OPERATOR)
    return result, time.monotonic() - t0


async def start(server: Server, agents: list[Agent], nursery: trio.Nursery, stop: trio.Event,
                procs: list[Proc]) -> None:
    for agent in agents:
        nursery.start_soon(agent.run, stop)
    ids = [a.node_id for a in agents]
    await wait_until_async(lambda: all(server.nodes().get(n, {}).get("state") == "ready" for n in ids),
                           f"{', '.join(ids)} ready", procs=procs)


def popen_ctl(server: Server, a: str, b: str) -> subprocess.Popen[str]:
    """`ctl fabric-test A B` left running, its stderr (the steps as they happen) readable line by line."""
    return subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "--server", server.url, "fabric-test", a, b],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=llmgw_env(OPERATOR))


def rail_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("rail 0: ")]


async def test_a_forged_port_is_refused_and_progress_forever_is_cut_at_the_phase_deadline(
        tmp_path: Path, procs: list[Proc]) -> None:
    certs = make_ca(tmp_path / "ca")
    config = (FAST_FLEET + certs.server_tls_yaml() + operator_yaml()
              + "fabric:\n  test_install_wait: 3s\n  test_grace: 2s\n")
    server = Server(tmp_path, config, insecure=False, token=OPERATOR["LLMGW_TOKEN"])
    procs.append(await trio.to_thread.run_sync(server.start))
    a, b = rdma_node(server, certs, "gpu-01"), rdma_node(server, certs, "gpu-02")
    port = [22]

    async def forged(msg: msgspec.Struct) -> AsyncIterator[msgspec.Struct]:
        if isinstance(msg, m.FabricTest) and msg.role == "server":
            # "ready", with a port of B's choosing and a host field of its own (a newer-looking answer).
            yield msgspec.json.decode(msgspec.json.encode(
                {"type": "FabricTestResult", "request_id": msg.request_id, "phase": "ready", "ok": True,
                 "tcp_port": port[0], "server_host": FOREIGN, "host": FOREIGN}), type=m.FabricTestResult)
            await trio.sleep(0.2)  # ok: as the honest agent
            yield m.FabricTestResult(request_id=msg.request_id, ok=True, output=TABLE)
        else:
            async for reply in honest(msg):
                yield reply

    b.answer = forged
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await start(server, [a, b], nursery, stop, procs)

        # 6. Port 22: refused with one line, A's agent is never sent a client run, B's server is stopped.
        result, took = await trio.to_thread.run_sync(fabric_test, server, "gpu-01", "gpu-02")
        assert result.returncode == 2, (result.stdout, result.stderr)
        why = ("gpu-02 answered TCP port 22 for its ib_write_bw server: outside 1024-65535, so it is not passed to the "
               "client; refused")
        assert rail_lines(result) == [f"rail 0: - of 400 Gb/s: crit ({why})"], result.stderr
        assert not sent(a, "client")
        await wait_until_async(lambda: any(isinstance(x, m.FabricTestCancel) for x in b.received),
                               "B's server cancelled")
        assert why in procs[0].log()
        report("fabric-test: B answers TCP port 22", f"refused in {took:.2f} s: {why}", "A was sent nothing")

        # A legal port: A's client is sent B's address as the server registered it, not B's host.
        port[0] = 18515
        result, _ = await trio.to_thread.run_sync(fabric_test, server, "gpu-01", "gpu-02")
        assert result.returncode == 0, (result.stdout, result.stderr)
        [client] = sent(a, "client")
        registered = server.nodes()["gpu-02"]
        assert (client.server_host, client.server_port) == ("127.0.0.1", 18515), (client, registered)
        report("fabric-test: B names a host of its own", f"A dialled {client.server_host}:{client.server_port}",
               f"not {FOREIGN}")

        # 7. "progress" every 0.2 s during prepare: cut at the 3 s ceiling fixed when prepare started.
        b.answer = progress_forever
        servers = len(sent(b, "server"))
        result, took = await trio.to_thread.run_sync(fabric_test, server, "gpu-01", "gpu-02")
        assert result.returncode == 2, (result.stdout, result.stderr)
        why = ("gpu-02 could not get ib_write_bw ready in time: the prepare phase's deadline (3 s, fixed when it "
               "started) passed")
        assert rail_lines(result) == [f"rail 0: - of 400 Gb/s: crit ({why})"], result.stderr
        assert 3 <= took < 15, took
        assert len(sent(b, "server")) == servers and len(sent(a, "client")) == 1  # no rail ran after it
        report("fabric-test: progress forever during prepare", f"cut after {took:.2f} s: {why}",
               "the lock is free again")

        # The lock is free: the next test of the same pair starts at once (and is cut the same way).
        b.answer = honest
        result, took = await trio.to_thread.run_sync(fabric_test, server, "gpu-01", "gpu-02")
        assert result.returncode == 0 and "another fabric test" not in result.stderr, result.stderr
        stop.set()
        nursery.cancel_scope.cancel()


async def test_a_test_of_two_other_nodes_runs_while_one_pair_is_stuck(tmp_path: Path, procs: list[Proc]) -> None:
    certs = make_ca(tmp_path / "ca")
    config = FAST_FLEET + certs.server_tls_yaml() + operator_yaml() + "fabric:\n  test_install_wait: 120s\n"
    server = Server(tmp_path, config, insecure=False, token=OPERATOR["LLMGW_TOKEN"])
    procs.append(await trio.to_thread.run_sync(server.start))
    agents = [rdma_node(server, certs, f"gpu-0{i}") for i in range(1, 5)]
    agents[1].answer = progress_forever  # gpu-02 holds gpu-01 and itself in a test until its deadline
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await start(server, agents, nursery, stop, procs)
        stuck = await trio.to_thread.run_sync(popen_ctl, server, "gpu-01", "gpu-02")
        running = [stuck]
        try:
            heard: list[str] = []
            reader = threading.Thread(target=lambda: heard.extend(stuck.stderr or []), daemon=True)
            reader.start()
            await wait_until_async(lambda: any("installing perftest" in line for line in heard),
                                   "gpu-02 saying it installs perftest", procs=procs)

            result, took = await trio.to_thread.run_sync(fabric_test, server, "gpu-03", "gpu-04")
            assert result.returncode == 0, (result.stdout, result.stderr)
            assert "another fabric test" not in result.stderr and rail_lines(result)[0].endswith(": ok"), result.stderr
            assert stuck.poll() is None  # the stuck pair is still stuck, on its own
            report("fabric-test beside a stuck pair", f"gpu-03 → gpu-04 done in {took:.2f} s",
                   "gpu-01 → gpu-02 still waiting")

            # A test sharing a node with the stuck pair waits for it, and says whom it waits for.
            shared = await trio.to_thread.run_sync(popen_ctl, server, "gpu-03", "gpu-01")
            running.append(shared)
            assert shared.stderr is not None
            first = await trio.to_thread.run_sync(shared.stderr.readline)
            assert first.strip() == "gpu-01 is in another fabric test; this one starts after it", first
            # Ctrl-C on the stuck test frees gpu-01 (and cancels what it started); the waiting one runs.
            stuck.send_signal(signal.SIGINT)
            await trio.to_thread.run_sync(lambda: stuck.wait(30))
            await wait_until_async(lambda: any(isinstance(x, m.FabricTestCancel) for x in agents[1].received),
                                   "gpu-02's prepare cancelled", procs=procs)
            _, err = await trio.to_thread.run_sync(lambda: shared.communicate(timeout=60))
            assert shared.returncode == 0, err
        finally:
            for p in running:
                if p.poll() is None:
                    p.kill()
        stop.set()
        nursery.cancel_scope.cancel()
