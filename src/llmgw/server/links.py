"""The live fleet streams, by node: one owner changes them, everyone else reads them.

Before issue 42 this was a `dict[str, Session]` built in `app.py` and handed to five objects;
any of them could put or delete an entry, and the order "replace the old stream, then add the
new one; on the end, delete only if still mine" lived in the fleet service alone by habit. Now
the fleet service is the one writer (`add`, `remove`, keeping that order here), and the
controller, the fabric service, the fabric tests and the log hub get the reads (`get`,
`supports`, `ids`, `in`) through `Links`, which has no way to change anything.

Pure: a dict and its rules; no I/O, no clock (tests/unit/test_purity.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

import msgspec


class Link(Protocol):
    """A node's live stream, as a reader sends on it (fleet_service.Session)."""

    def supports(self, feature: str) -> bool: ...
    def send(self, msg: msgspec.Struct) -> None: ...


class Links(Protocol):
    """What the readers of the fleet's streams may do: look, never add or remove."""

    def get(self, node_id: str) -> Link | None: ...
    def supports(self, node_id: str, feature: str) -> bool: ...
    def ids(self) -> frozenset[str]: ...
    def __contains__(self, node_id: object) -> bool: ...


L = TypeVar("L", bound=Link)


class FleetLinks(Generic[L]):
    """The one map of node id → live stream (its owner: server/fleet_service.py)."""

    def __init__(self) -> None:
        self._by_node: dict[str, L] = {}

    # ---- the owner's ------------------------------------------------------------------------------

    def add(self, node_id: str, link: L) -> L | None:
        """`link` is the node's stream from now on; returns the one it replaces (which the owner
        ends), or None."""
        old = self._by_node.get(node_id)
        self._by_node[node_id] = link
        return old

    def remove(self, node_id: str, link: L) -> bool:
        """`link` ended: the node has no stream, unless a newer one replaced it already (then
        nothing changes and this is False)."""
        if self._by_node.get(node_id) is not link:
            return False
        del self._by_node[node_id]
        return True

    # ---- reads ------------------------------------------------------------------------------------

    def get(self, node_id: str) -> L | None:
        return self._by_node.get(node_id)

    def supports(self, node_id: str, feature: str) -> bool:
        """The node is connected now and its agent has `feature` (wire/messages.py FEATURE_*)."""
        link = self._by_node.get(node_id)
        return link is not None and link.supports(feature)

    def ids(self) -> frozenset[str]:
        """The nodes connected now (a copy: safe to hold across an await)."""
        return frozenset(self._by_node)

    def all(self) -> list[L]:
        """Every live stream (a copy), e.g. to end them all at shutdown."""
        return list(self._by_node.values())

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._by_node

    def __len__(self) -> int:
        return len(self._by_node)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_node))
