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
    result = run_llmgw("server", "--config", str(bomb), "--insecure", "--state-dir", str(tmp_path / "state"), timeout=60)
    took = time.monotonic() - t0
    line = one_error_line(result)
    assert result.returncode == 2
    assert f"{bomb}:2: YAML alias *a0 is not accepted" in line, line
    assert took < 10, took
    report("YAML alias bomb at start", f"exit 2 in {took:.2f} s: {line}", f"{bomb.stat().st_size} bytes")


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
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in [work, work / "shards", work / "logs", *files]}
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
