"""Fleet transport: one bidirectional HTTP/2 stream per node, on trio and h2, TLS or h2c."""

from llmgw.fleet.dial import DialError, dial, parse_fleet_url
from llmgw.fleet.h2conn import ChannelClosed, FleetChannel
from llmgw.fleet.listener import FleetListener, StreamRefused

__all__ = [
    "ChannelClosed",
    "DialError",
    "FleetChannel",
    "FleetListener",
    "StreamRefused",
    "dial",
    "parse_fleet_url",
]
