"""The agent's hardware readings, from discovery (real sysfs and NVML, or a simulated node)."""

from __future__ import annotations

from llmgw.agent import discovery, hostfacts
from llmgw.catalog.schema import Discovery
from llmgw.wire import messages as m


class DiscoveredHardware:
    def __init__(self, cfg: Discovery, server_host: str | None = None, *, work_dir: str = "", model_cache: str = "") -> None:
        self.cfg = cfg
        self.server_host = server_host
        self.work_dir = work_dir or "."
        self.model_cache = model_cache
        self.last: m.Inventory | None = None

    def inventory(self) -> m.Inventory:
        self.last = discovery.discover(self.cfg, server=self.server_host)
        return self.last

    def gpu_indexes(self) -> set[int] | None:
        """GPU indexes of the last inventory (None before the first discovery)."""
        return None if self.last is None else {g.index for g in self.last.gpus}

    def port_counters(self) -> list[m.PortCounters]:
        return discovery.read_port_counters(self.cfg)

    def gpu_health(self) -> list[m.GpuHealth]:
        return discovery.read_gpu_health(self.cfg)

    def host_facts(self) -> m.HostFacts:
        """Memlock limit and model-cache space, for heartbeats (`ctl doctor`)."""
        return hostfacts.read_host_facts(self.work_dir, self.model_cache, self.cfg.sysfs_root)
