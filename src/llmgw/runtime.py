"""Process-wide settings a long-running llmgw process (the server, a gateway) makes once it is
configured. Here rather than in server/app.py so that a gateway on its own needs no control plane
to make them (issue 42)."""

from __future__ import annotations

import gc


def settle_garbage_collector() -> None:
    """Keep full garbage collections short: they stop the whole event loop. With a 1,000-model
    catalog and 1,000 replicas a full collection took 0.25-0.46 s on the 2-core development
    machine (issue 9's abuse tests saw it as /healthz stalls). What exists once the server is
    configured (modules, the catalog, the gateway's routes) lives as long as the process:
    `gc.freeze()` takes it out of every later collection. Cycles are rare in what the server
    makes afterwards (reference counting frees the rest), so young collections run less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
