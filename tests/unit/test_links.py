"""FleetLinks (server/links.py): the one owner of the node → live stream map (issue 42)."""

from __future__ import annotations

import msgspec

from llmgw.server.links import FleetLinks, Links


class FakeLink:
    def __init__(self, *features: str) -> None:
        self.features = set(features)
        self.sent: list[msgspec.Struct] = []

    def supports(self, feature: str) -> bool:
        return feature in self.features

    def send(self, msg: msgspec.Struct) -> None:
        self.sent.append(msg)


def test_a_new_stream_replaces_the_old_one_and_the_old_ones_end_leaves_it() -> None:
    links = FleetLinks[FakeLink]()
    first, second = FakeLink("start"), FakeLink("start", "logs")
    assert links.add("gpu-01", first) is None
    assert links.add("gpu-01", second) is first  # the owner ends the one it replaced
    assert links.remove("gpu-01", first) is False  # the replaced stream's end changes nothing
    assert links.get("gpu-01") is second and "gpu-01" in links and len(links) == 1
    assert links.remove("gpu-01", second) is True
    assert links.get("gpu-01") is None and "gpu-01" not in links and not links.ids()


def test_the_reads_say_who_is_connected_and_what_its_agent_does() -> None:
    links = FleetLinks[FakeLink]()
    links.add("a", FakeLink("logs"))
    links.add("b", FakeLink())
    reads: Links = links
    assert reads.ids() == {"a", "b"}
    assert reads.supports("a", "logs") and not reads.supports("b", "logs") and not reads.supports("c", "logs")
    held = links.ids()
    links.add("c", FakeLink())
    assert held == {"a", "b"}  # a copy: safe across an await
    assert sorted(links) == ["a", "b", "c"] and len(links.all()) == 3
    assert not hasattr(reads, "__setitem__") and not hasattr(reads, "pop")
