"""The server's view of a node diverges and heals within `resync_every` heartbeats, on the same
stream: a real server (in this process, on loopback sockets), a real agent and supervisor, and a
real simulated engine process. The server loses the agent's "ready" status on its way in; the
agent's next shard list, carried by a heartbeat, sets it right, and the engine enters the
gateway's rotation without a reconnect."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.agent.agent import Agent, make_dialer
from llmgw.agent.supervisor import Supervisor
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig, ServerConfig
from llmgw.server.app import ControlPlane
from llmgw.web.listen import bind_socket
from llmgw.wire import messages as m
from tests.e2e.harness import DEFAULT_DEADLINE, Proc
from tests.unit.fakes import NoHardware

NODE = "gpu-01"
RESYNC_EVERY = 4

SERVER = """\
listen: 127.0.0.1:0
fleet_listen: 127.0.0.1:0
fleet:
  heartbeat_interval: 0.2s
  unreachable_after: 5
  lost_after: 30s
reconcile:
  tick: 0.5s
  settle: 0s
models:
  - name: chat
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
"""


class OneGpu(NoHardware):
    def inventory(self) -> m.Inventory:
        return m.Inventory(gpus=[m.Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_mib=81559)])


async def _until(condition: Any, what: str) -> None:
    with trio.fail_after(DEFAULT_DEADLINE):
        while not condition():  # noqa: ASYNC110
            await trio.sleep(0.02)  # ok: poll interval of a deadline-bounded wait
    assert condition(), what


async def test_a_lost_ready_status_heals_within_resync_every_heartbeats_without_a_reconnect(
    tmp_path: Path, procs: list[Proc], caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.server.reconcile")
    cfg = parse_config(SERVER + f"state_dir: {tmp_path / 'state'}\n", ServerConfig)
    plane = ControlPlane(cfg, insecure=True)
    public, fleet = bind_socket(cfg.listen, "public port", "--listen"), bind_socket(cfg.fleet_listen, "fleet port",
                                                                                    "--fleet-listen")
    dropped: list[m.ShardStatus] = []
    registry = plane.registry
    heartbeats_at_drop = 0
    real = plane.controller.shard_status

    def lossy(node_id: str, msg: m.ShardStatus) -> None:
        """The server loses the first "ready" status (a bug, a restart of the observer, …)."""
        nonlocal heartbeats_at_drop
        if msg.state == "ready" and not dropped:
            dropped.append(msg)
            heartbeats_at_drop = registry.nodes[node_id].heartbeats
            return
        real(node_id, msg)

    plane.controller.shard_status = lossy  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(lambda task_status: plane.run(public_sock=public, fleet_sock=fleet,
                                                                  task_status=task_status))
        agent_cfg = parse_config(f"server: {bound.fleet_url}\nnode_id: {NODE}\nresync_every: {RESYNC_EVERY}\n"
                                 f"work_dir: {tmp_path / NODE}\nbackoff:\n  initial: 0.2s\n  max: 1s\n", AgentConfig)
        supervisor = Supervisor(agent_cfg.work_dir)
        agent = Agent(agent_cfg, hardware=OneGpu(), dialer=make_dialer(agent_cfg, insecure=True, ssl_context=None),
                      engines=supervisor)
        await nursery.start(supervisor.run)
        nursery.start_soon(agent.run)
        reconciler = plane.controller.reconciler

        def replica_state() -> str:
            return next((str(r.state) for r in reconciler.replicas.values()), "")

        await _until(lambda: dropped, "the engine to turn ready on the node (and its status to be lost)")
        assert replica_state() == "starting"  # the server's view diverged from the node's
        await _until(lambda: replica_state() == "ready", "the server's view to heal")
        healed_after = registry.nodes[NODE].heartbeats - heartbeats_at_drop
        assert healed_after <= RESYNC_EVERY, f"healed after {healed_after} heartbeats"
        [replica] = reconciler.replicas.values()
        endpoint = replica.shards[0].endpoint
        assert endpoint
        # The gateway's rotation follows the replica book on its own sync, not within the pass.
        await _until(lambda: [e.endpoint for e in plane.reads.endpoints()] == [endpoint], "the endpoint in rotation")
        assert agent.sessions == 1 and registry.nodes[NODE].session == 1  # one stream all along
        assert any("resync found the server's view" in r.getMessage() for r in caplog.records)
        plane.shutdown_event.set()
        with trio.fail_after(DEFAULT_DEADLINE):
            await supervisor.stop_all()
        nursery.cancel_scope.cancel()
