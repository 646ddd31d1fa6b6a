"""The states of one shard (one attempt to run one engine process), as the fleet protocol
names them. Pure.

Both sides use the enum: the agent sets a shard's state and reports it (`ShardStatus.state`,
`ShardReport.state`), the server's state table (server/states.py) checks each change it hears of.
The wire format is the value, a plain string: the message fields stay `str`, so an agent newer
than its server (a state this server does not know) is refused per message by the server's table,
not by the decoder for the whole stream. A `StrEnum` member is a `str`, and msgspec sends its value.
"""

from __future__ import annotations

import enum


class ShardState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    # Ready once; its agent's health checks now fail (a hung engine). The gateway's own health
    # checks decide whether it gets traffic.
    UNHEALTHY = "unhealthy"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    EXITED = "exited"
    # The server's verdict only (the node went away, or stopped reporting the shard): an agent
    # never reports it.
    LOST = "lost"
