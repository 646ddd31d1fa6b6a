"""Node side: discovery, supervisor, engine adapters, weight fetcher, fabric tools, heartbeat."""
