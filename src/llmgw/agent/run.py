"""`llmgw agent` main: check the config, build TLS, run the link until SIGINT/SIGTERM.

Stopping the agent does not stop engines (unless --stop-engines-on-exit): traffic goes
gateway → engine directly, and the next agent adopts them.
"""

from __future__ import annotations

import logging
import signal
import ssl
import time
from pathlib import Path

import trio

from llmgw.agent.agent import Agent, make_dialer
from llmgw.agent.fabric_test import FabricTester
from llmgw.agent.fabric_tools import FabricTools
from llmgw.agent.hardware import DiscoveredHardware
from llmgw.agent.supervisor import Supervisor
from llmgw.agent.weights import Weights
from llmgw.catalog.schema import AgentConfig
from llmgw.errors import UsageError
from llmgw.fleet import parse_fleet_url

log = logging.getLogger("llmgw.agent")

EXPIRY_WARNING_DAYS = 30


def agent_ssl_context(cfg: AgentConfig) -> tuple[ssl.SSLContext | None, float]:
    """The client TLS context and the client certificate's expiry (0 without one)."""
    if cfg.tls is None:
        return None, 0.0
    from llmgw.tls import cert_not_after, client_context

    if bool(cfg.tls.cert) != bool(cfg.tls.key):
        raise UsageError("tls: set both tls.cert and tls.key (the node certificate and its key), or neither")
    if not cfg.tls.ca:
        raise UsageError("tls.ca: set the CA certificate that signed the server's certificate "
                         "(ca.crt from `llmgw ctl cert init`)")
    ctx = client_context(cfg.tls.ca, cfg.tls.cert or None, cfg.tls.key or None, alpn=("h2",))
    not_after = cert_not_after(cfg.tls.cert) if cfg.tls.cert else 0.0
    return ctx, not_after


async def run_agent(cfg: AgentConfig, *, insecure: bool = False, stop_engines_on_exit: bool = False) -> None:
    if not cfg.server:
        raise UsageError("no server URL: set `server:` in the agent config, --server or LLMGW_FLEET_URL")
    scheme, host, _port = parse_fleet_url(cfg.server, insecure)
    if insecure:
        log.warning("--insecure: the fleet stream may be plain h2c; use TLS outside a lab")
    ssl_context, not_after = (None, 0.0) if scheme == "http" else agent_ssl_context(cfg)
    if not_after:
        days = (not_after - time.time()) / 86400
        if days < 0:
            log.error("the node certificate %s expired %.0f days ago; the server will refuse it",
                      cfg.tls.cert, -days)  # type: ignore[union-attr]
        elif days < EXPIRY_WARNING_DAYS:
            log.warning("the node certificate %s expires in %.0f days; reissue it with `llmgw ctl cert node`",
                        cfg.tls.cert, days)  # type: ignore[union-attr]
    hardware = DiscoveredHardware(cfg.discovery, server_host=host, work_dir=cfg.work_dir, model_cache=cfg.model_cache,
                                  advertise_host=cfg.advertise_host)
    bind_host = cfg.bind_host or cfg.advertise_host
    if bind_host in ("0.0.0.0", "::"):
        log.warning("bind_host %s: engines listen on every interface of this node; bind them to the "
                    "management address (advertise_host, the default) unless something else must reach them", bind_host)
    supervisor = Supervisor(
        cfg.work_dir,
        bind_host=bind_host,
        advertise_host=cfg.advertise_host,
        gpu_indexes=hardware.gpu_indexes,
        health=cfg.engine_health,
        allow=cfg.allow,
        launch_facts=lambda: hardware.launch_facts(agent.fabric_status),
        weights=Weights(Path(cfg.work_dir), Path(cfg.model_cache) if cfg.model_cache else None),
    )
    agent = Agent(
        cfg,
        hardware=hardware,
        dialer=make_dialer(cfg, insecure=insecure, ssl_context=ssl_context),
        engines=supervisor,
        cert_not_after=not_after,
        tools=FabricTools(cfg.discovery.tools_dir),
        tester=FabricTester(cfg.fabric_test, cfg.discovery.tools_dir,
                            ports=lambda: hardware.last.ports if hardware.last else [],
                            gpus=lambda: hardware.last.gpus if hardware.last else []),
    )
    log.info("llmgw agent for node %s, server %s, work dir %s", agent.node_id, cfg.server, cfg.work_dir)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        nursery.start_soon(agent.run)
        await _wait_for_signal()
        if stop_engines_on_exit:
            log.info("stopping engines before exit (--stop-engines-on-exit)")
            with trio.move_on_after(60):
                await supervisor.stop_all()
        nursery.cancel_scope.cancel()


async def _wait_for_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s; stopping", signal.Signals(signum).name)
            return
