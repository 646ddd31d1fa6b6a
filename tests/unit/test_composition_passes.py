"""What runs after every pass of the controller is wired in the composition root (issue 37):
the gateway gets the endpoints, the event feeds look, and the drainer asks for a drain's next
move. The e2e drains move one replica per node, which `Drainer.drain` asks for itself, so a
root that left the drainer out of the pass went unseen: a node with two replicas would drain
one and stop. Built as `llmgw server` builds it (ControlPlane, no listener opened)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.catalog.schema import ServerConfig
from llmgw.server import app
from llmgw.server.drain import Drainer
from llmgw.server.events import EventFeeds


async def test_after_every_pass_the_gateway_the_event_feeds_and_the_drainer_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(app, "_hand_endpoints", lambda gateway, feed: calls.append("gateway"))
    monkeypatch.setattr(EventFeeds, "after_pass", lambda self: calls.append("event feeds"))
    monkeypatch.setattr(Drainer, "after_pass", lambda self: calls.append("drainer"))
    plane = app.ControlPlane(ServerConfig(state_dir=str(tmp_path)), insecure=True)
    plane.controller.on_pass()
    assert calls == ["gateway", "event feeds", "drainer"]
