"""Stand-ins shared by the agent tests."""

from __future__ import annotations

from llmgw.wire import messages as m


class NoHardware:
    """A node with nothing to report: no GPUs, no ports (the link's logic is under test)."""

    def inventory(self) -> m.Inventory:
        return m.Inventory()

    def port_counters(self) -> list[m.PortCounters]:
        return []

    def gpu_health(self) -> list[m.GpuHealth]:
        return []
