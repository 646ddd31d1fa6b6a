"""What an operator may change on a running server: reload the config, forget a node, restart a
replica, cordon, uncordon and drain a node (drain.py does those). The JSON API's mutating routes
(behind the operator door, auth.py) and SIGHUP call these, each a method that returns what
stands in the way in words, never raising for a request that cannot be done.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from llmgw.catalog import load_server_config, override
from llmgw.catalog.schema import RemedySettings, ServerConfig
from llmgw.errors import UsageError
from llmgw.server.auth import Auth
from llmgw.server.control import Controller
from llmgw.server.drain import Drainer, DrainView
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.gateway.workers import WorkerPool
from llmgw.server.gwfeed import GatewayFeedService
from llmgw.server.registry import NodeRegistry
from llmgw.server.restart import RestartResult, restart
from llmgw.tls.context import ServerTls
from llmgw.tls.revocation import Revocations

log = logging.getLogger("llmgw.server")

# Settings a reload reads but that take effect only after a restart (listeners, TLS, the fleet).
# The files public_tls names are read again on every reload all the same (ServerTls).
RESTART_ONLY = ("listen", "fleet_listen", "admin_listen", "tls", "public_tls", "fleet", "state_dir")


def workers_refusal(old: int, new: int) -> str:
    """Why a reload cannot change `gateway.workers` from `old` to `new` processes live, or "".
    N ↔ M is live (the pool starts or retires workers on the shared port). 1 ↔ N is not: the
    one-process server accepts on the public port with a socket bound without SO_REUSEPORT
    (no worker could bind beside it) and serves /api/v1 there itself; with workers it holds
    the port bound but not listening and serves the API on api.sock. Switching means closing
    a listening socket, which resets the connections in its accept queue."""
    if old == new or (old > 1 and new > 1):
        return ""
    return (f"gateway.workers {old} → {new} needs a restart of the server (one process accepts on the public port "
            f"itself, workers share it: only a change between two worker counts applies live); {old} kept")


class ReloadResult(msgspec.Struct, kw_only=True):
    ok: bool
    message: str
    models: list[str] = []


class Operator:
    """The operator actions, over the objects they change. `cfg` is the running config (a
    reload replaces its catalog, gateway, api, reconcile and placement sections)."""

    def __init__(
        self,
        cfg: ServerConfig,
        *,
        config_path: str | None,
        overrides: dict[str, Any] | None,
        auth: Auth,
        gateway: Gateway,
        controller: Controller,
        registry: NodeRegistry,
        revocations: Revocations,
        end_revoked_streams: Callable[[], int],
        drainer: Drainer | None = None,
        record: Callable[[str, str], None] = lambda kind, message: None,
        public_tls: ServerTls | None = None,
        feed: GatewayFeedService | None = None,
        worker_pool: Callable[[], WorkerPool | None] = lambda: None,
        cores: int = 1,
        set_remedy: Callable[[RemedySettings], None] = lambda settings: None,  # remedy_service.py
    ) -> None:
        self.set_remedy = set_remedy
        self.record = record  # into the event log (kind, message)
        self.feed = feed  # divides each model's admission among the local workers
        self.worker_pool = worker_pool  # the gateway workers (started once the public port is bound)
        self.cores = cores  # what `gateway.workers: auto` means here
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides or {}
        self.auth = auth
        self.gateway = gateway
        self.controller = controller
        self.registry = registry
        self.revocations = revocations
        self.end_revoked_streams = end_revoked_streams
        self.drainer = drainer
        self.public_tls = public_tls
        self._reload_lock = trio.Lock()

    async def reload(self) -> ReloadResult:
        """Re-read the config file; the catalog (models, static endpoints, gateway settings)
        takes effect at once, listener and TLS settings need a restart. The deny list
        (tls.deny_list) is re-read too, and fleet streams of certificates it now names end; so are
        the public port's certificate files (a certificate renewed in place reaches new handshakes,
        the gateway workers' too, which take the new digest with the gateway settings).

        The file is read and parsed in a worker thread: a big catalog (or a hostile one) must not
        hold the gateway and the fleet streams while it parses (a ~300-byte reload froze the
        gateway 2.4 s when it was parsed in the event loop, issue 9). Reloads run one at a time.
        """
        self._reload_deny_list()
        if not self.config_path:
            log.warning("reload: no config file to reload (the server was started without --config)")
            return ReloadResult(ok=False, message="the server was started without --config")
        path = self.config_path
        async with self._reload_lock:
            try:
                cfg = await trio.to_thread.run_sync(lambda: override(load_server_config(path), self.overrides))
            except UsageError as exc:
                log.error("reload failed, keeping the running config: %s", exc)
                self.record("reload", f"config reload refused, the running config stays: {exc}")
                return ReloadResult(ok=False, message=f"{exc}; the running config stays")
            tls_problem, renewed = await self._reload_public_tls()
            result = self._apply_reload(cfg)
            if tls_problem:
                result = ReloadResult(ok=False, message=f"{result.message}; but {tls_problem}", models=result.models)
            elif renewed:
                result.message += "; public port certificate re-read (new handshakes use it)"
            self.record("reload", f"config reloaded: {result.message}")
            return result

    async def _reload_public_tls(self) -> tuple[str, bool]:
        """Read the public port's certificate, key and CA files again (off the event loop): what
        went wrong (or ""), and whether they changed. A file that cannot be used leaves the
        running certificate in place."""
        tls = self.public_tls
        if tls is None:
            return "", False
        try:
            changed = await trio.to_thread.run_sync(tls.reload)
        except UsageError as exc:
            log.error("reload: public_tls: %s; the running certificate stays", exc)
            return f"public_tls: {exc}; the running certificate stays", False
        if changed:
            log.info("reload: public port certificate re-read from %s (new handshakes use it)", tls.cert)
        return "", changed

    def _apply_reload(self, cfg: ServerConfig) -> ReloadResult:
        changed = [k for k in RESTART_ONLY if getattr(cfg, k) != getattr(self.cfg, k)]
        if changed:
            log.warning("reload: changes to %s take effect only after a restart", ", ".join(changed))
        old, new = self.cfg.gateway.worker_count(self.cores), cfg.gateway.worker_count(self.cores)
        workers_note = workers_refusal(old, new)
        if workers_note:
            log.warning("reload: %s; the rest of the config is reloaded", workers_note)
            cfg = msgspec.structs.replace(
                cfg, gateway=msgspec.structs.replace(cfg.gateway, workers=self.cfg.gateway.workers))
        elif new != old:
            log.info("reload: gateway workers %d → %d", old, new)
            # The feed first: the catalog below goes out with admission divided by the new count.
            if self.feed is not None:
                self.feed.set_local_workers(new)
            if (pool := self.worker_pool()) is not None:
                pool.resize(new)
        self.cfg = msgspec.structs.replace(self.cfg, models=cfg.models, endpoints=cfg.endpoints, gateway=cfg.gateway,
                                           api=cfg.api, reconcile=cfg.reconcile, placement=cfg.placement,
                                           remedy=cfg.remedy)
        self.auth.configure(self.cfg)
        self.gateway.configure(cfg.models, cfg.endpoints, cfg.gateway)
        self.controller.set_placement(cfg.placement)
        self.set_remedy(cfg.remedy)  # auto_remediate: report during an incident takes effect at once
        self.controller.set_catalog(cfg.models)
        note = f"; restart needed for {', '.join(changed)}" if changed else ""
        note += f"; {workers_note}" if workers_note else ""
        return ReloadResult(ok=True, message=f"reloaded {self.config_path}{note}", models=[m.name for m in cfg.models])

    def _reload_deny_list(self) -> None:
        if not self.revocations.reload():
            return
        ended = self.end_revoked_streams()
        if ended:
            log.warning("deny list: ended %d fleet connections whose certificate is now revoked", ended)

    async def reload_on_sighup(self) -> None:
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                log.info("SIGHUP: reloading %s", self.config_path)
                await self.reload()

    def forget_node(self, node_id: str) -> str:
        """Forget a node that is gone for good; what stands in the way, or ""."""
        node = self.registry.get(node_id)
        if node is None:
            return "not found"
        if node.connected or node.state == "ready":
            return f"it is {node.state} and connected; stop its agent first"
        del self.registry.nodes[node_id]
        self.controller.node_forgotten(node_id)
        return ""

    def restart_replica(self, replica_id: str, who: str, *, force: bool = False) -> RestartResult | tuple[int, str]:
        """Replace a replica, its successor first (restart.py); what was done, or (status, why not)."""
        result = restart(self.controller.reconciler, replica_id, who, trio.current_time(), force=force)
        if not isinstance(result, tuple):
            log.info("%s", result.message)
            self.controller.wake()
        return result

    def cordon(self, node_id: str, who: str) -> str:
        return self.drainer.cordon(node_id, who) if self.drainer else "not found"

    def uncordon(self, node_id: str, who: str) -> str:
        return self.drainer.uncordon(node_id, who) if self.drainer else "not found"

    def drain(self, node_id: str, who: str, *, force: bool) -> DrainView | str:
        return self.drainer.drain(node_id, who, force=force) if self.drainer else "not found"

    def drain_status(self, node_id: str) -> DrainView | None:
        return self.drainer.view(node_id) if self.drainer else None
