"""Placement: which node, GPUs and port a replica gets. Pure: no trio, no I/O."""

from llmgw.placement.single import (
    NodeCapacity,
    NoFit,
    Placement,
    Request,
    choose_gpus,
    choose_port,
    place,
)

__all__ = ["NoFit", "NodeCapacity", "Placement", "Request", "choose_gpus", "choose_port", "place"]
