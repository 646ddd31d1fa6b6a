"""Abuse of the control plane through the doors production uses: a config file read by a
real `llmgw server` and `ctl reload`, Register and heartbeats on a real mutual-TLS fleet
stream. Each is answered with one clear line while a well-behaved client (`Probe`, /healthz
on the public port) is served within its normal latency. Issue 9, items 2-6 and the risks.
"""

from __future__ import annotations

import time
from pathlib import Path

import trio

from tests.abuse.door import Agent, Probe, assert_served, clique, make_ca, report
from tests.e2e.harness import (
    FAST_FLEET,
    Proc,
    Server,
    ctl,
    one_error_line,
    run_llmgw,
    wait_until_async,
)

OPERATOR = {"LLMGW_TOKEN": "abuse-operator-token"}
OPERATOR_TOKENS = "api:\n  operator_tokens: [\"sha256:{}\"]\n"


def operator_yaml() -> str:
    import hashlib

    return OPERATOR_TOKENS.format(hashlib.sha256(OPERATOR["LLMGW_TOKEN"].encode()).hexdigest())


def alias_bomb(levels: int) -> str:
    """The billion-laughs shape: each level is nine aliases of the one before (9**levels leaves)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    lines.append(f"models: [*a{levels}]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_at_start_is_one_line(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb(6))  # 9**6 = 531,441 strings from 400 bytes
    t0 = time.monotonic()
    result = run_llmgw("server", "--config", str(bomb), "--insecure", "--state-dir", str(tmp_path / "state"),
                       timeout=60)
    took = time.monotonic() - t0
    line = one_error_line(result)
    assert result.returncode == 2
    assert f"{bomb}:2: YAML alias *a0 is not accepted" in line, line
    assert took < 10, took
    report("YAML alias bomb at start", f"exit 2 in {took:.2f} s: {line}", f"{bomb.stat().st_size} bytes")


def deep_nest(levels: int) -> str:
    """Flow lists nested `levels` deep, no aliases: small, but one parser frame per level."""
    return "models: " + "[" * levels + "]" * levels + "\n"


def test_yaml_nested_50000_deep_at_start_is_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text(deep_nest(50_000))
    result = run_llmgw("server", "--config", str(deep), "--insecure", "--state-dir", str(tmp_path / "state"),
                       timeout=60)
    line = one_error_line(result)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{deep}:1: YAML nested deeper than 64 levels" in line, line
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 2, result.stderr[-2000:]
    report("YAML nested 50,000 deep at start", f"exit 2: {line}", f"{deep.stat().st_size} bytes")


async def test_alias_bomb_and_a_big_catalog_reload_off_the_event_loop(tmp_path: Path, procs: list[Proc]) -> None:
    server = Server(tmp_path, FAST_FLEET + operator_yaml())
    procs.append(await trio.to_thread.run_sync(server.start))
    probe = Probe(server.public_port)
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        await trio.sleep(0.5)  # ok: a baseline of the probe's normal latency
        baseline = probe.since(0)

        # 1. An alias bomb through `ctl reload`: refused with file:line, the running config stays.
        good = server.config.read_text()
        server.config.write_text(good + alias_bomb(6))
        mark = probe.mark()
        t0 = time.monotonic()
        result = await trio.to_thread.run_sync(lambda: ctl(server.url, "reload", env=OPERATOR))
        took = time.monotonic() - t0
        line = one_error_line(result)
        assert result.returncode == 1 and "YAML alias *a0 is not accepted" in line and f"{server.config}:" in line, line
        served = assert_served(probe, mark, "the alias-bomb reload")
        report("YAML alias bomb via ctl reload", f"refused in {took:.2f} s: {line}", served)

        # 1b. Nesting 50,000 deep, no aliases: refused the same way (it was HTTP 500 and ~3,000
        # ERROR lines), nothing of it in the server's log beyond the one refusal.
        server.config.write_text(good + deep_nest(50_000))
        mark = probe.mark()
        proc = procs[-1]
        logged = len(proc.log().splitlines())
        result = await trio.to_thread.run_sync(lambda: ctl(server.url, "reload", env=OPERATOR))
        line = one_error_line(result)
        assert result.returncode == 1 and "YAML nested deeper than 64 levels" in line, (line, result.stderr[-2000:])
        assert "500" not in line, line
        new = proc.log().splitlines()[logged:]
        assert not [x for x in new if "Traceback" in x or "RecursionError" in x], new[:20]
        assert len(new) <= 5, new[:20]
        report("YAML nested 50,000 deep via ctl reload", f"refused: {line}",
               assert_served(probe, mark, "the deep reload"))

        # 2. A big, valid catalog (1,000 models): parsed in a worker thread, the gateway keeps answering.
        models = "".join(f"  - name: model-{i:04d}\n    replicas: 0\n    profiles: [{{engine: sim, gpus: 1}}]\n"
                         for i in range(1000))
        server.config.write_text(good + "models:\n" + models)
        mark = probe.mark()
        t0 = time.monotonic()
        result = await trio.to_thread.run_sync(lambda: ctl(server.url, "reload", env=OPERATOR))
        took = time.monotonic() - t0
        assert result.returncode == 0 and "reloaded" in result.stdout, result.stderr
        served = assert_served(probe, mark, "a 1,000-model reload")
        report("1,000-model catalog via ctl reload", f"reloaded in {took:.2f} s", served)
        assert baseline
        nursery.cancel_scope.cancel()


async def test_placement_on_fully_linked_nodes_does_not_freeze_the_server(tmp_path: Path, procs: list[Proc]) -> None:
    """16 fully NVLinked GPUs choosing 8 took 0.82 s in the event loop, per placement."""
    certs = make_ca(tmp_path / "ca")
    config = FAST_FLEET + certs.server_tls_yaml() + """\
reconcile: {tick: 0.5s, settle: 0.2s}
models:
  - name: big
    replicas: 4
    profiles: [{name: tp8, engine: sim, gpus: 8}]
"""
    server = Server(tmp_path, config, insecure=False)
    procs.append(await trio.to_thread.run_sync(server.start))
    from llmgw import __version__
    from llmgw.wire import messages as m

    agents = [
        Agent(server.fleet_url, certs, node_id, m.Register(
            node_id=node_id, version=__version__, features=[m.FEATURE_START, m.FEATURE_STOP],
            inventory=m.Inventory(gpus=clique(16))))
        for node_id in ("nvl-01", "nvl-02")
    ]
    probe = Probe(server.public_port)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        mark = probe.mark()
        t0 = time.monotonic()
        for agent in agents:
            nursery.start_soon(agent.run, stop)
        await wait_until_async(lambda: sum(len(a.starts()) for a in agents) >= 4, "four tp8 replicas placed",
                               procs=[server.proc])
        took = time.monotonic() - t0
        served = assert_served(probe, mark, "placing 4 tp8 replicas on 16-GPU NVSwitch nodes")
        for agent in agents:
            chosen = sorted(tuple(s.spec.gpus) for s in agent.starts())
            assert chosen == [tuple(range(8)), tuple(range(8, 16))], chosen
        report("placement, 2 nodes x 16 fully linked GPUs, 4 x tp8", f"placed in {took:.2f} s", served)
        stop.set()
        nursery.cancel_scope.cancel()


def test_shard_state_holding_a_token_is_private(tmp_path: Path, procs: list[Proc]) -> None:
    """A profile's env (HF_TOKEN) lands in work_dir/shards/<shard>.json: 0600 in a 0700 dir."""
    import stat

    from tests.e2e.harness import engines_config, make_sim_node, replicas, start_agent, wait_until

    catalog = """\
models:
  - name: gated
    replicas: 1
    profiles: [{name: tp1, engine: sim, gpus: 1, env: {HF_TOKEN: hf_abuse_secret}}]
"""
    server = Server(tmp_path, engines_config(catalog))
    procs.append(server.start())
    config = make_sim_node(tmp_path, "gpu-01", server.fleet_url)
    work = tmp_path / "gpu-01" / "work"
    work.mkdir(mode=0o755, parents=True)  # as an older agent left it
    work.chmod(0o755)
    agent = start_agent(tmp_path, "gpu-01", config, "--stop-engines-on-exit")
    procs.append(agent)
    wait_until(lambda: [r for r in replicas(server) if r["state"] == "ready"], "the gated replica ready",
               procs=[server.proc, agent])
    files = list((work / "shards").glob("*.json"))
    assert files and all("hf_abuse_secret" in f.read_text() for f in files)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
             for p in [work, work / "shards", work / "logs", *files]}
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    assert "was open to other users (mode 755); now 0700" in agent.log()
    report("secrets in shard state", ", ".join(f"{k} {v:04o}" for k, v in modes.items()), "no other user can read them")


async def test_a_thousand_model_catalog_is_placed_without_stalling(tmp_path: Path, procs: list[Proc]) -> None:
    """Reconcile cost grew with models × replicas in the event loop (3,000 models: 2.3 s stalls)."""
    from llmgw import __version__
    from llmgw.wire import messages as m

    certs = make_ca(tmp_path / "ca")
    models = "".join(f"  - name: model-{i:04d}\n    replicas: 1\n    profiles: [{{engine: sim, gpus: 1}}]\n"
                     for i in range(1000))
    config = FAST_FLEET + certs.server_tls_yaml() + "reconcile: {tick: 0.5s, settle: 0.2s}\nmodels:\n" + models
    server = Server(tmp_path, config, insecure=False)
    procs.append(await trio.to_thread.run_sync(server.start))
    agents = []
    for i in range(8):
        agent = Agent(server.fleet_url, certs, f"wide-{i}", m.Register(
            node_id=f"wide-{i}", version=__version__, features=[m.FEATURE_START, m.FEATURE_STOP],
            inventory=m.Inventory(gpus=[m.Gpu(index=g, name="L4", memory_mib=23034) for g in range(125)])))
        agent.ack_starts = True
        agents.append(agent)
    probe = Probe(server.public_port)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        mark = probe.mark()
        t0 = time.monotonic()
        for agent in agents:
            nursery.start_soon(agent.run, stop)
        await wait_until_async(lambda: sum(len(a.starts()) for a in agents) >= 1000, "1,000 replicas placed",
                               deadline=120, procs=[server.proc])
        took = time.monotonic() - t0
        served = assert_served(probe, mark, "placing 1,000 replicas on 8 nodes and 1,000 ShardStatus answers")
        assert all(a.closed is None for a in agents), [a.closed for a in agents]
        assert not any(isinstance(x, m.Stop) for a in agents for x in a.received)
        report("reconcile, 1,000 models x 1 replica on 8 nodes x 125 GPUs", f"placed in {took:.1f} s", served)
        stop.set()
        nursery.cancel_scope.cancel()


def test_a_restart_does_not_wait_for_nodes_already_lost(tmp_path: Path, procs: list[Proc]) -> None:
    """known-nodes.json kept lost nodes: a restarted server waited out its settle period for
    them, 503ing with 'no ready replica: small-k94f5 ready; small-cd96h ready'."""
    import json
    import re

    import httpx

    from tests.e2e.harness import engines_config, make_sim_node, replicas, start_agent, wait_until

    catalog = """\
models:
  - name: small
    replicas: 2
    profiles: [{name: tp1, engine: sim, gpus: 1}]
"""
    server = Server(tmp_path, engines_config(catalog))
    procs.append(server.start())
    agents = {}
    for node in ("gpu-01", "gpu-02"):
        config = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT_FOR_RESTART, "--gpus", "2")
        agents[node] = start_agent(tmp_path, node, config, "--stop-engines-on-exit")
        procs.append(agents[node])
    wait_until(lambda: len([r for r in replicas(server) if r["state"] == "ready"]) == 2, "two ready replicas",
               procs=[server.proc, *agents.values()])

    # gpu-01 goes away for good: lost; its replica moves to gpu-02.
    agents["gpu-01"].stop()
    wait_until(lambda: server.nodes()["gpu-01"]["state"] == "lost", "gpu-01 lost", procs=[server.proc])
    wait_until(lambda: [r["shards"][0]["node"] for r in replicas(server)
                        if r["state"] == "ready"] == ["gpu-02", "gpu-02"],
               "both replicas on gpu-02", procs=[server.proc, agents["gpu-02"]])
    known = json.loads((server.state_dir / "known-nodes.json").read_text())
    assert known == ["gpu-02"], known

    # Restart with a long settle period: gpu-02 re-registers and its engines serve at once.
    server.proc.stop()
    server.config.write_text(server.config.read_text().replace("settle: 0.5s", "settle: 60s"))
    t0 = time.monotonic()
    procs.append(server.start())
    listening = time.monotonic() - t0
    refusals: list[str] = []

    def served() -> bool:
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                              json={"model": "small", "messages": [{"role": "user", "content": "hi"}]})
        if response.status_code == 503:
            refusals.append(response.json()["error"]["message"])
        return response.status_code == 200

    wait_until(served, "a chat answer after the restart", deadline=20, procs=[server.proc, agents["gpu-02"]])
    took = time.monotonic() - t0 - listening
    contradictions = [t for t in refusals if re.search(r"-[a-z0-9]{5} ready(;|$)", t)]
    assert not contradictions, contradictions
    assert took < 15, took
    line = refusals[-1] if refusals else "no 503 at all"
    report("restart with a lost node in known-nodes.json (settle 60 s)",
           f"served {took:.1f} s after listening; {len(refusals)} 503s, last: {line}", "gpu-01 not waited for")


FAST_AGENT_FOR_RESTART = """\
backoff:
  initial: 0.2s
  max: 1s
"""


BIG_MESSAGES = FAST_FLEET.replace("max_message: 256KiB", "max_message: 4MiB")


async def test_a_register_with_100000_gpus_is_refused(tmp_path: Path, procs: list[Proc]) -> None:
    from llmgw import __version__
    from llmgw.wire import messages as m
    from tests.abuse.door import metric

    certs = make_ca(tmp_path / "ca")
    server = Server(tmp_path, BIG_MESSAGES + certs.server_tls_yaml(), insecure=False)
    procs.append(await trio.to_thread.run_sync(server.start))
    liar = Agent(server.fleet_url, certs, "liar-01", m.Register(
        node_id="liar-01", version=__version__, features=[m.FEATURE_START],
        inventory=m.Inventory(gpus=[m.Gpu(index=i) for i in range(100_000)])))
    probe = Probe(server.public_port)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        mark = probe.mark()
        with trio.fail_after(30):
            await liar.run(stop)
        served = assert_served(probe, mark, "a 100,000-GPU Register")
        nursery.cancel_scope.cancel()
    assert liar.closed is not None and "100,000 GPUs (fleet.max_gpus is 256)" in liar.closed, liar.closed
    assert "liar-01" not in server.nodes()
    assert metric(server.url, "llmgw_fleet_refused_total", 'reason="too_big"') == 1
    lines = [line for line in server.proc.log().splitlines() if "100,000 GPUs" in line]
    assert len(lines) == 1, lines
    report("Register with 100,000 GPUs", f"refused: {liar.closed}", served)


async def test_refused_big_registers_give_their_memory_back(tmp_path: Path, procs: list[Proc]) -> None:
    """A refused 3.76 MB Register kept ~45 MB of the server's RSS (issue 41): the exception held the
    decoded Register in a cycle; refused in a row, the 400,000 objects of each pinned pymalloc arenas
    and glibc kept their buffers; a 3.4 MB advertise_host was repeated whole in the answer and the
    log. Ten of the first and five of the second in a row, over real mutual TLS, now leave the server
    where it was, and the last ten add nothing the first five did not (RSS growing per attempt is
    the DoS)."""
    from llmgw import __version__
    from llmgw.wire import messages as m
    from tests.abuse.door import metric, rss_mb

    certs = make_ca(tmp_path / "ca")
    server = Server(tmp_path, BIG_MESSAGES + certs.server_tls_yaml(), insecure=False)
    procs.append(await trio.to_thread.run_sync(server.start))
    pid = server.proc.pid
    big = m.Register(node_id="liar-01", version=__version__, features=[m.FEATURE_START],
                     inventory=m.Inventory(gpus=[m.Gpu(index=i, memory_mib=81559) for i in range(100_000)]))
    wordy = m.Register(node_id="liar-02", version=__version__, advertise_host="x" * 3_400_000)
    size = len(m.encode(big))
    assert 3_000_000 < size < 4 << 20, size  # within fleet.max_message: read whole, then refused
    # The baseline is a server that has served a stream (TLS, HTTP/2, a Register) once.
    stop = trio.Event()
    good = Agent(server.fleet_url, certs, "good-01")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(good.run, stop)
        await wait_until_async(lambda: server.nodes().get("good-01", {}).get("state") == "ready", "good-01 ready",
                               procs=[server.proc])
        stop.set()
    baseline = rss_mb(pid)
    after: list[float] = []
    for register, said in [(big, "100,000 GPUs (fleet.max_gpus is 256)")] * 10 + [(wordy,
                                                                                   "… (3,400,000 characters)")] * 5:
        liar = Agent(server.fleet_url, certs, register.node_id, register)
        with trio.fail_after(30):
            await liar.run(trio.Event())
        assert liar.closed is not None and said in liar.closed and len(liar.closed) < 1000, (liar.closed or "")[:2000]
        after.append(rss_mb(pid))
    assert metric(server.url, "llmgw_fleet_refused_total", 'reason="too_big"') == 10
    assert metric(server.url, "llmgw_fleet_refused_total", 'reason="address"') == 5
    assert len(server.proc.log()) < 200_000  # the advertise_host was logged whole: 51 MB for 15
    bound = 12.0  # MB over the baseline; unfixed: +26 MB after the first refusal, +37 after six, +5 per wordy one
    settled = await wait_until_async(lambda: (lambda r: r if r - baseline < bound else None)(rss_mb(pid)),
                                     f"the server's RSS back within {bound:g} MB of its {baseline:.1f} MB "
                                     f"(MB after each refusal: {', '.join(f'{r:.1f}' for r in after)})",
                                     deadline=10, procs=[server.proc])
    assert after[-1] - after[4] < 4.0, after  # unfixed: ~1 MB more per refusal, every refusal
    report("ten refused 3.5 MB Registers (100,000 GPUs), then five with a 3.4 MB advertise_host, in a row",
           f"server RSS {baseline:.1f} MB before, {after[0]:.1f} after the first, {after[9]:.1f} after the tenth, "
           f"{settled:.1f} after the fifteenth (bound +{bound:g} MB)", f"{size:,} bytes each")


async def test_a_heartbeat_flood_is_cut_off(tmp_path: Path, procs: list[Proc]) -> None:
    """One node heartbeating 6,169 times a second took 60 % of a core."""
    from llmgw import __version__
    from llmgw.agent.procs import cpu_seconds
    from llmgw.fleet import dial
    from llmgw.wire import messages as m
    from tests.abuse.door import metric

    certs = make_ca(tmp_path / "ca")
    server = Server(tmp_path, FAST_FLEET + certs.server_tls_yaml(), insecure=False)
    procs.append(await trio.to_thread.run_sync(server.start))
    steady = Agent(server.fleet_url, certs, "steady-01")
    flooder = Agent(server.fleet_url, certs, "flood-01")
    probe = Probe(server.public_port)
    stop = trio.Event()
    sent = 0
    closed = ""

    async def flood() -> None:
        nonlocal sent, closed
        from llmgw.fleet import ChannelClosed

        async with dial(server.fleet_url, ssl_context=flooder.context(), max_message=1 << 20) as ch:
            await ch.send(m.encode(m.Register(node_id="flood-01", version=__version__)))
            beat = m.encode(m.Heartbeat(seq=1))
            try:
                with trio.move_on_after(5):
                    while True:
                        await ch.send(beat)
                        sent += 1
                        if sent % 50 == 0:
                            await trio.lowlevel.checkpoint()
                while True:  # the server's answer, if it had one
                    await ch.receive()
            except ChannelClosed as exc:
                closed = exc.reason

    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        nursery.start_soon(steady.run, stop)
        await wait_until_async(lambda: server.nodes().get("steady-01", {}).get("state") == "ready", "steady-01 ready",
                               procs=[server.proc])
        mark = probe.mark()
        cpu0, t0 = cpu_seconds(server.proc.pid), time.monotonic()
        await flood()
        wall = time.monotonic() - t0
        cpu = cpu_seconds(server.proc.pid) - cpu0
        served = assert_served(probe, mark, "a heartbeat flood")
        assert server.nodes()["steady-01"]["state"] == "ready"
        stop.set()
        nursery.cancel_scope.cancel()
    reason = "far over the limit of 10/s (fleet.max_heartbeat_rate)"
    if "connection lost while sending" in closed:
        # Under load the flooder's own send can hit the closed socket before it reads the
        # server's GOAWAY (seen in CI); then the reason must be in the server's log.
        assert reason in server.proc.log(), closed
    else:
        assert reason in closed, closed
    assert metric(server.url, "llmgw_fleet_refused_total", 'reason="heartbeat_rate"') == 1
    assert metric(server.url, "llmgw_fleet_dropped_total", 'reason="heartbeat_rate"') >= 20
    # Over a cut-off of a few tens of ms the share is clock-tick noise: judge at least a second.
    share = cpu / max(wall, 1.0)
    assert share < 0.5, f"the server spent {cpu:.2f} CPU-s in {wall:.2f} s of flood"
    report("heartbeat flood from one node", f"{sent} heartbeats sent, stream closed after {wall:.2f} s: {closed}; "
           f"server CPU {share:.0%} of a core meanwhile", served)


async def test_stalled_tls_handshakes_do_not_flood_the_log(tmp_path: Path, procs: list[Proc]) -> None:
    """One WARNING line per stalled, unauthenticated TLS handshake: anyone could fill the log."""
    from tests.abuse.door import metric

    certs = make_ca(tmp_path / "ca")
    server = Server(tmp_path, FAST_FLEET + certs.server_tls_yaml(), insecure=False)
    procs.append(await trio.to_thread.run_sync(server.start))
    probe = Probe(server.public_port)
    async with trio.open_nursery() as nursery:
        await nursery.start(probe.run)
        mark = probe.mark()
        silent = [await trio.open_tcp_stream("127.0.0.1", server.fleet_port) for _ in range(60)]
        await wait_until_async(lambda: metric(server.url, "llmgw_fleet_refused_total", 'reason="tls_timeout"') >= 60,
                               "60 handshake timeouts counted", procs=[server.proc])
        served = assert_served(probe, mark, "60 stalled TLS handshakes")
        for stream in silent:
            await stream.aclose()
        nursery.cancel_scope.cancel()
    lines = [line for line in server.proc.log().splitlines() if "no TLS handshake within" in line]
    assert 1 <= len(lines) <= 2, lines
    report("60 stalled TLS handshakes", f"all 60 counted, {len(lines)} log line(s): {lines[0].split(': ', 1)[-1]}",
           served)
