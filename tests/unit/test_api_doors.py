"""The doors of the API as unit tests (issue 37): every GET stands behind the viewer door and
every change behind the operator door, read from the route table itself, and the dispatcher
checks each route's own door before any handler runs. tests/e2e/test_doors.py knocks on every
route of a real server; this is what `make unit` sees, so a route behind the wrong door fails
here in milliseconds."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.server.api import API_ROUTES, PublicHandler
from llmgw.server.auth import Door, Verdict

IDS = {"node": "gpu-01", "replica": "small-abcde", "fabric": "0xfab", "name": "small", "move": "1"}


def test_every_read_is_behind_the_viewer_door_and_every_change_behind_the_operator_door() -> None:
    wrong = [(r.method, r.path, r.door.value) for r in API_ROUTES
             if r.door is not (Door.VIEWER if r.method == "GET" else Door.OPERATOR)]
    assert wrong == [], f"routes behind the wrong door: {wrong}"
    assert {r.method for r in API_ROUTES} == {"GET", "POST", "DELETE"}
    assert sum(r.method == "GET" for r in API_ROUTES) >= 7 and sum(r.method != "GET" for r in API_ROUTES) >= 3
    # One row per method and path: a second row could not be reached, and its door would mislead.
    assert len({(r.method, r.path) for r in API_ROUTES}) == len(API_ROUTES)


class Refuses:
    """An Auth that records the door it was asked about and lets nobody through."""

    metrics_open = False

    def __init__(self) -> None:
        self.doors: list[Door] = []

    def check(self, door: Door, request: object) -> Verdict:
        self.doors.append(door)
        return Verdict(False, status=401, message="no credential")


class Knock:
    def __init__(self, method: str, path: str) -> None:
        self.method, self.path = method, path


class Answer:
    def __init__(self) -> None:
        self.statuses: list[int] = []

    async def respond(self, status: int, headers: Any, body: bytes) -> None:
        self.statuses.append(status)


class Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a handler ran ({name}) before its door was passed")


@pytest.mark.parametrize("route", API_ROUTES, ids=lambda r: f"{r.method} {r.path}")
async def test_the_dispatcher_checks_the_routes_own_door_before_any_handler(route: Any) -> None:
    auth = Refuses()
    handler = PublicHandler(reads=Untouchable(), actions=Untouchable(), auth=auth,  # type: ignore[arg-type]
                            gateway=Untouchable(), render_metrics=lambda: b"")  # type: ignore[arg-type]
    answer = Answer()
    path = "/api/v1/" + route.path.format(**IDS)
    await handler(Knock(route.method, path), answer)  # type: ignore[arg-type]
    assert auth.doors == [route.door] and answer.statuses == [401], (route.method, path, auth.doors)


async def test_an_unknown_route_is_behind_the_door_its_method_needs() -> None:
    for method, door in (("GET", Door.VIEWER), ("POST", Door.OPERATOR), ("DELETE", Door.OPERATOR)):
        auth = Refuses()
        handler = PublicHandler(reads=Untouchable(), actions=Untouchable(), auth=auth,  # type: ignore[arg-type]
                                gateway=Untouchable(), render_metrics=lambda: b"")  # type: ignore[arg-type]
        await handler(Knock(method, "/api/v1/no-such-thing"), Answer())  # type: ignore[arg-type]
        assert auth.doors == [door], method
