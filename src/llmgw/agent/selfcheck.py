"""`llmgw ctl doctor --local`: this machine's facts for doctor's node checks, read the way the
agent reads them (its discovery, its host facts, its config), with no server (a node being
brought up). A simulated node's config points discovery at its fake sysfs and GPU inventory, so
`--local --config NODE/agent.yaml` checks a `llmgw sim node` exactly as its agent would report it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from llmgw.agent import discovery, hostfacts
from llmgw.catalog.schema import AgentConfig
from llmgw.doctor.facts import NodeFacts
from llmgw.errors import UsageError
from llmgw.fabric import declared


def cert_days_left(cfg: AgentConfig, wall: float) -> float | None:
    if cfg.tls is None or not cfg.tls.cert:
        return None
    from llmgw.tls import cert_not_after

    try:
        return round((cert_not_after(cfg.tls.cert) - wall) / 86400, 2)
    except (OSError, ValueError) as exc:
        raise UsageError(f"tls.cert {cfg.tls.cert}: cannot read the node certificate ({exc})") from None


def local_facts(cfg: AgentConfig, interval: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> NodeFacts:
    """Two readings of the port counters `interval` seconds apart (a rise needs two)."""
    inventory = discovery.discover(cfg.discovery, server=cfg.server or None, advertise_host=cfg.advertise_host)
    before = discovery.read_port_counters(cfg.discovery)
    sleep(interval)
    ports = discovery.read_port_counters(cfg.discovery)
    statuses = declared.check_fabrics(declared.from_config(cfg.fabrics), declared.with_live(inventory.ports, ports))
    return NodeFacts(
        id=cfg.node_id or socket.gethostname(),
        state="local",
        inventory=inventory,
        fabric_status=statuses,
        gpus=discovery.read_gpu_health(cfg.discovery),
        ports=ports,
        ports_before=before,
        window=interval,
        host=hostfacts.read_host_facts(cfg.work_dir, cfg.model_cache, cfg.discovery.sysfs_root),
        cert_days_left=cert_days_left(cfg, time.time()),
        checks_clock=False,
    )
