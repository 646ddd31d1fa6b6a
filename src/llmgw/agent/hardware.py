"""The agent's hardware readings, from discovery (real sysfs and NVML, or a simulated node)."""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.agent import discovery, hostfacts, netif
from llmgw.agent.launch_env import LaunchFacts
from llmgw.catalog.schema import Discovery
from llmgw.wire import messages as m


class DiscoveredHardware:
    def __init__(self, cfg: Discovery, server_host: str | None = None, *, work_dir: str = "", model_cache: str = "",
                 advertise_host: str = "") -> None:
        self.cfg = cfg
        self.server_host = server_host
        self.work_dir = work_dir or "."
        self.model_cache = model_cache
        self.advertise_host = advertise_host
        self.last: m.Inventory | None = None
        # advertise_host's addresses, resolved with each inventory (in its worker thread: a name
        # may need the resolver); a launch matches them against the interfaces as they are then.
        self.advertise_addresses: list[str] = netif.resolve(advertise_host) if netif.is_ip(advertise_host) else []

    def inventory(self) -> m.Inventory:
        self.advertise_addresses = netif.resolve(self.advertise_host)
        self.last = discovery.discover(self.cfg, server=self.server_host, advertise_host=self.advertise_host)
        return self.last

    def launch_facts(self, fabrics: Sequence[m.FabricStatus]) -> LaunchFacts:
        """What a launch derives its environment from (launch_env): the fabrics' latest verdicts,
        the ports of the last inventory, and the interface holding advertise_host now (one
        SIOCGIFCONF and a read of /proc/net/if_inet6: no resolver, nothing that blocks)."""
        table = netif.interface_addresses()
        interface, address = netif.holding(self.advertise_addresses, table)
        return LaunchFacts(fabrics=list(fabrics), ports=self.last.ports if self.last else [], interface=interface,
                           address=address, advertise_host=self.advertise_host, interfaces=table)

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
