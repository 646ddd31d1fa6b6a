"""Ids that become paths, checked at every door (issue 21, finding 1) and quoted in logs (finding 8).

`../`, absolute paths, newlines and NUL go into every id of every fleet message that carries
one: the pure check flags each; the server's door (the production FleetService on a real
loopback stream) refuses and counts them before the control plane hears of them; the agent's
supervisor refuses them before it touches the filesystem, and refuses any path that resolves
outside its work dir.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from llmgw import __version__
from llmgw.agent.decide import StateFile
from llmgw.agent.supervisor import Supervisor
from llmgw.fleet import dial
from llmgw.server.fleet_service import FleetService
from llmgw.server.metrics import ServerMetrics
from llmgw.server.registry import NodeRegistry, Transition
from llmgw.wire import messages as m
from llmgw.wire.ids import id_problem, message_problems, model_problem, quote
from tests.unit.test_fleet_flow import DEADLINE, MAX, fleet_port, until

BAD = ["../../etc/cron.d/x", "/tmp/x/owned", "a\nINFO llmgw.server: forged", "a\x00b", "..", "a/../../b", "a\rb",
       "é\u2028x"]


def spec(**kw: str) -> m.ShardSpec:
    base = {"shard_id": "small-kq7xz.1", "replica_id": "small-kq7xz", "model": "meta-llama/Llama-3.1-8B",
            "profile": "tp1",
            "engine": "sim", "port": 20001, "served_name": "llama"}
    base.update(kw)
    return m.ShardSpec(**base)  # type: ignore[arg-type]


Build = Callable[[str], msgspec.Struct]

# Every id position of every message that carries one, in both directions.
POSITIONS: dict[type, list[Build]] = {
    m.Register: [
        lambda v: m.Register(node_id=v, version="1"),
        *[lambda v, f=f: m.Register(node_id="gpu-01", version="1", shards=[m.ShardReport(spec=spec(**{f: v}))])
          for f in ("shard_id", "replica_id", "model", "profile", "served_name")],
    ],
    m.Heartbeat: [lambda v, f=f: m.Heartbeat(shards=[m.ShardReport(spec=spec(**{f: v}))])
                  for f in ("shard_id", "replica_id", "model", "profile", "served_name")],
    m.ShardStatus: [lambda v: m.ShardStatus(shard_id=v, replica_id="r", state="ready"),
                    lambda v: m.ShardStatus(shard_id="r.1", replica_id=v, state="ready")],
    m.Progress: [lambda v: m.Progress(shard_id=v, source="hf")],
    m.Start: [lambda v, f=f: m.Start(spec=spec(**{f: v}))
              for f in ("shard_id", "replica_id", "model", "profile", "served_name")],
    m.Stop: [lambda v: m.Stop(shard_id=v)],
    m.Drain: [lambda v: m.Drain(shard_id=v)],
    m.LogTail: [lambda v: m.LogTail(request_id="logs-1", shard_id=v)],
}
ID_FIELDS = {"node_id", "shard_id", "replica_id", "spec", "shards"}


def test_every_message_carrying_an_id_is_covered() -> None:
    kinds = [*typing.get_args(m.AgentMessage), *typing.get_args(m.ServerMessage)]
    carrying = {k for k in kinds if ID_FIELDS & set(typing.get_type_hints(k))}
    missing = sorted(k.__name__ for k in carrying - POSITIONS.keys())
    assert not missing, f"messages carrying ids with no row in POSITIONS (and maybe no check in wire/ids.py): {missing}"


@pytest.mark.parametrize("kind", list(POSITIONS), ids=lambda k: k.__name__)
def test_bad_ids_are_flagged_in_every_position(kind: type) -> None:
    for build in POSITIONS[kind]:
        assert message_problems(build("ok-1.2")) == []  # a good id passes
        for value in BAD:
            problems = message_problems(build(value))
            assert problems, (kind.__name__, value)
            assert all("\n" not in p and "\x00" not in p for p in problems)  # safe to log as they are


def test_the_patterns() -> None:
    for good in ("gpu-01", "llama-3-1-8b-instruct-829sn.1", "a_b.c-d", "x" * 128):
        assert id_problem(good) is None, good
    for bad in ("", "x" * 129, "-x", ".x", "a..b", "a b", "a/b", *BAD):
        assert id_problem(bad) is not None, bad
    for good in ("meta-llama/Llama-3.1-8B-Instruct", "qwen2.5:7b", "org/model@rev", "llama-3.1-8b-instruct"):
        assert model_problem(good) is None, good
    for bad in ("", "/abs", "a//b", "a/./b", "a/", *BAD):
        assert model_problem(bad) is not None, bad
    assert quote("0.1\nINFO x") == "'0.1\\nINFO x'"


def test_replica_ids_keep_the_model_name() -> None:
    """Issue 46: `llama-3.1-8b-instruct`'s replicas were `llama-3-1-8b-instruct-…`, not guessable."""
    import random

    from llmgw.server.replicas import ReplicaBook, Settings

    book = ReplicaBook(Settings(), random.Random(1))
    assert book._new_id("llama-3.1-8b-instruct").startswith("llama-3.1-8b-instruct-")
    assert book._new_id("meta-llama/Llama-3.1-8B").startswith("meta-llama-llama-3.1-8b-")
    for name in ("a..b", "x.-y/..", "..", "Qwen2.5-72B@v1+x:y", "a" * 256, "-.-"):
        rid = book._new_id(name)
        for shard_id in (f"{rid}.3", f"{rid}.3.1"):
            assert id_problem(shard_id) is None, (name, shard_id)
        assert f"{rid}.3.1".rpartition(".")[0] == f"{rid}.3"  # the rank splits off from the right


class Heard:
    """The control plane's side of FleetObserver: what got past the door."""

    def __init__(self) -> None:
        self.registers: list[m.Register] = []
        self.messages: list[msgspec.Struct] = []

    def node_registered(self, node_id: str, msg: m.Register) -> None:
        self.registers.append(msg)

    def node_disconnected(self, node_id: str) -> None:
        pass

    def shard_status(self, node_id: str, msg: m.ShardStatus) -> None:
        self.messages.append(msg)

    def progress(self, node_id: str, msg: m.Progress) -> None:
        self.messages.append(msg)

    def transitions(self, items: list[Transition]) -> None:
        pass


async def test_the_server_door_refuses_bad_ids_and_quotes_what_it_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    heard = Heard()
    metrics = ServerMetrics(lambda: {})
    fleet = FleetService(NodeRegistry(1.0), metrics, register_timeout=DEADLINE, require_identity=False, observer=heard)
    good = m.ShardReport(spec=spec())
    reports = [good, *[m.ShardReport(spec=spec(shard_id=v)) for v in BAD],
               *[m.ShardReport(spec=spec(model=v)) for v in BAD]]
    register = m.Register(node_id="gpu-01",
                          version=__version__ + "\n2026-12-01 INFO llmgw.server: "
                                                "reload requested by operator alice: ok",
                          shards=reports)
    sentinel = m.ShardStatus(shard_id="small-kq7xz.1", replica_id="small-kq7xz", state="ready")
    async with fleet_port(fleet.handle) as (_, url), dial(url, ssl_context=None, insecure=True,
                                                          max_message=MAX) as client:
        await client.send(m.encode(register))
        with trio.fail_after(DEADLINE):
            assert isinstance(m.decode_server_message(await client.receive()), m.Welcome)
        bad_messages = [build(v) for build in (*POSITIONS[m.ShardStatus], *POSITIONS[m.Progress]) for v in BAD]
        for msg in [*bad_messages, sentinel]:
            await client.send(m.encode(msg))
        await until(lambda: sentinel in heard.messages, "the good status to get through")
    [heard_register] = heard.registers
    assert heard_register.shards == [good]
    assert heard.messages == [sentinel]
    refused = metrics.registry.get_sample_value("llmgw_fleet_refused_total", {"reason": "bad id"})
    assert refused == len(reports) - 1 + len(bad_messages)
    server_lines = [r.getMessage() for r in caplog.records if r.name.startswith("llmgw.server")]
    assert any("registered" in line and "\\n2026-12-01" in line for line in server_lines), server_lines
    assert not any("\n" in line or "\x00" in line for line in server_lines), server_lines
    # once per node
    assert sum("refused" in line and "bad id" not in line and "invalid" in line for line in server_lines) == 1


async def supervised(work: Path, body: Callable[[Supervisor, list[Any]], Any]) -> None:
    supervisor = Supervisor(str(work), gpu_indexes=lambda: {0, 1})
    sent: list[Any] = []
    supervisor.attach(sent.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        await body(supervisor, sent)
        nursery.cancel_scope.cancel()


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


async def test_the_agent_refuses_bad_ids_before_touching_the_filesystem(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    work = tmp_path / "work"
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "owned.1.json"
    victim.write_text("keep me")
    values = [*BAD, str(outside / "owned"), "../outside/owned"]

    async def body(supervisor: Supervisor, sent: list[Any]) -> None:
        before = files(tmp_path)
        for kind in (m.Start, m.Stop, m.Drain):
            for build in POSITIONS[kind]:
                for value in values:
                    await supervisor.handle(build(value), sent.append)
        assert files(tmp_path) == before  # no log, no state file, anywhere
        assert sent == [] and supervisor.runs == {}
        assert victim.read_text() == "keep me"

    await supervised(work, body)
    agent_lines = [r.getMessage() for r in caplog.records if r.name.startswith("llmgw.agent")]
    assert agent_lines and all("refusing" in line for line in agent_lines)
    assert not any("\n" in line or "\x00" in line for line in agent_lines)


async def test_the_agent_refuses_paths_that_resolve_outside_its_work_dir(tmp_path: Path) -> None:
    work = tmp_path / "work"
    outside = tmp_path / "outside"
    outside.mkdir()
    (work / "logs").parent.mkdir(parents=True)
    (work / "logs").symlink_to(outside)  # a directory swapped for a link: ids alone cannot catch this

    async def body(supervisor: Supervisor, sent: list[Any]) -> None:
        await supervisor.handle(m.Start(spec=spec(port=1)), sent.append)
        assert supervisor.runs == {} and sent == []
        assert list(outside.iterdir()) == []

    await supervised(work, body)


async def test_a_state_file_with_a_hostile_id_is_not_adopted_and_nothing_outside_is_unlinked(tmp_path: Path) -> None:
    work = tmp_path / "work"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "owned.1.json").write_text("keep me")
    (work / "shards").mkdir(parents=True)
    hostile = StateFile(spec=spec(shard_id=str(outside / "owned.1")), pid=0, pgid=0, start_ticks=0, started_at=0.0,
                        log_path=str(outside / "owned.1.log"), endpoint="")
    (work / "shards" / "x.json").write_bytes(msgspec.json.encode(hostile))

    async def body(supervisor: Supervisor, sent: list[Any]) -> None:
        assert supervisor.runs == {}
        assert supervisor.reports() == []

    await supervised(work, body)
    assert (outside / "owned.1.json").read_text() == "keep me"
    assert not (outside / "owned.1.log").exists()
    assert not (work / "shards" / "x.json").exists()  # the unreadable record is removed, as any other


def test_the_catalog_refuses_names_the_agents_would_refuse() -> None:
    from llmgw.catalog.load import parse_config
    from llmgw.catalog.schema import ServerConfig
    from llmgw.errors import UsageError

    for text, what in (('models:\n  - name: "../x"\n', "invalid model name"),
                       ('models:\n  - name: ok\n    profiles:\n      - {name: "a/b", engine: sim}\n',
                        "invalid profile name")):
        with pytest.raises(UsageError) as info:
            parse_config(text, ServerConfig, "server.yaml")
        assert what in str(info.value) and "server.yaml:" in str(info.value)


async def test_peer_mode_refuses_a_node_that_advertises_another_address() -> None:
    from llmgw.fleet import ChannelClosed

    registry = NodeRegistry(1.0)
    fleet = FleetService(registry, ServerMetrics(lambda: {}), register_timeout=DEADLINE, require_identity=False,
                         endpoint_host="peer")
    async with fleet_port(fleet.handle) as (_, url):
        async with dial(url, ssl_context=None, insecure=True, max_message=MAX) as client:
            await client.send(m.encode(m.Register(node_id="gpu-01", version="1", advertise_host="10.9.9.9")))
            with trio.fail_after(DEADLINE), pytest.raises(ChannelClosed) as info:
                await client.receive()
        assert "advertises 10.9.9.9" in info.value.reason and "127.0.0.1" in info.value.reason
        assert "gpu-01" not in registry.nodes
        async with dial(url, ssl_context=None, insecure=True, max_message=MAX) as client:
            await client.send(m.encode(m.Register(node_id="gpu-01", version="1", advertise_host="127.0.0.1")))
            with trio.fail_after(DEADLINE):
                assert isinstance(m.decode_server_message(await client.receive()), m.Welcome)
            assert registry.nodes["gpu-01"].endpoint_host == "127.0.0.1"
