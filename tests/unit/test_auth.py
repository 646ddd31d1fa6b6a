"""The public port's doors (llmgw.server.auth): which credential opens which door, and what a
refusal says. The real HTTP path is walked route by route in tests/e2e/test_doors.py; here the
decision table itself, including certificates of each kind (OU), which need no handshake to read."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest

from llmgw.catalog.schema import ApiSettings, GatewaySettings, ServerConfig, TlsPublic
from llmgw.server.auth import Auth, Door, Role

KEY, VIEW, OP = "sk-client", "view-token", "op-token"


def h(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


class FakeTls:
    def __init__(self, cn: str, ou: str) -> None:
        self.cert = {"subject": ((("organizationName", "llmgw"),), (("organizationalUnitName", ou),),
                                 (("commonName", cn),))}

    def getpeercert(self, binary_form: bool = False) -> Any:
        return self.cert


class FakeHead:
    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers

    def get(self, name: bytes) -> bytes | None:
        return self.headers.get(name)


class FakeRequest:
    def __init__(self, token: str | None = None, cert: FakeTls | None = None, method: str = "GET",
                 path: str = "/api/v1/nodes") -> None:
        self.head = FakeHead({b"authorization": f"Bearer {token}".encode()} if token else {})
        self.tls = cert
        self.method = method
        self.path = path
        self.peer = "10.0.0.9:4000"


def config(keys: bool = True, operators: bool = True, viewers: bool = True, certs: bool = False,
           metrics: str = "viewer") -> ServerConfig:
    return ServerConfig(
        gateway=GatewaySettings(api_keys=[h(KEY)] if keys else []),
        api=ApiSettings(operator_tokens=[h(OP)] if operators else [], viewer_tokens=[h(VIEW)] if viewers else [],
                        metrics=metrics),  # type: ignore[arg-type]
        public_tls=TlsPublic(cert="s.crt", key="s.key", ca="ca.crt") if certs else None,
    )


def auth(cfg: ServerConfig, insecure: bool = False) -> tuple[Auth, list[str]]:
    counted: list[str] = []
    return Auth(cfg, insecure=insecure, count=counted.append), counted


# (token, certificate OU) → (client door, viewer door, operator door): 200 passes, else the refusal's status
TABLE = [
    (None, None, (401, 401, 401)),
    (KEY, None, (200, 401, 401)),
    (VIEW, None, (401, 200, 403)),
    (OP, None, (401, 200, 200)),
    ("wrong", None, (401, 401, 401)),
    (None, "viewers", (401, 200, 403)),
    (None, "operators", (401, 200, 200)),
    (None, "nodes", (401, 401, 401)),  # a node's certificate opens the fleet port only
    (VIEW, "operators", (401, 200, 200)),  # the strongest credential presented counts
    (OP, "nodes", (401, 200, 200)),
]


@pytest.mark.parametrize(("token", "ou", "expected"), TABLE)
def test_which_credential_opens_which_door(token: str | None, ou: str | None, expected: tuple[int, int, int]) -> None:
    doors, counted = auth(config(certs=True))
    request = FakeRequest(token, FakeTls("someone", ou) if ou else None)
    got = tuple(200 if (v := doors.check(door, request)).ok else v.status
                for door in (Door.CLIENT, Door.VIEWER, Door.OPERATOR))
    assert got == expected
    assert counted == [d.value for d, status in zip(Door, got, strict=True) if status != 200]


def test_refusals_say_what_to_do_and_never_the_secret() -> None:
    doors, _ = auth(config(certs=True))
    for request, door, words in [
        (FakeRequest(), Door.VIEWER, ["viewer or operator credential", "api.viewer_tokens", "cert viewer"]),
        (FakeRequest(KEY), Door.VIEWER, ["API key opens only /v1"]),
        (FakeRequest("wrong"), Door.VIEWER, ["token was refused", "api.viewer_tokens"]),
        (FakeRequest(cert=FakeTls("gpu-01", "nodes")), Door.VIEWER, ["'gpu-01'", "cert viewer"]),
        (FakeRequest(VIEW, method="POST"), Door.OPERATOR, ["may read the fleet but not change it", "operator"]),
        (FakeRequest(), Door.OPERATOR, ["needs an operator credential", "--token", "cert operator"]),
        (FakeRequest("wrong"), Door.OPERATOR, ["operator token was refused"]),
        (FakeRequest(cert=FakeTls("gpu-01", "nodes")), Door.OPERATOR, ["'gpu-01' is not an operator certificate"]),
    ]:
        verdict = doors.check(door, request)
        assert not verdict.ok and all(w in verdict.message for w in words), (words, verdict.message)
        assert "\n" not in verdict.message and "wrong" not in verdict.message and VIEW not in verdict.message


def test_no_credential_configured_is_a_lab_open_for_reads_and_under_insecure_for_changes() -> None:
    bare = config(keys=False, operators=False, viewers=False)
    doors, _ = auth(bare)
    assert doors.check(Door.VIEWER, FakeRequest()).ok and doors.metrics_open
    refused = doors.check(Door.OPERATOR, FakeRequest(method="POST"))
    assert refused.status == 401 and "no operator credential is configured" in refused.message
    lab, _ = auth(bare, insecure=True)
    assert lab.check(Door.OPERATOR, FakeRequest(method="POST")).who == (
        "anyone (--insecure and no credentials configured)")
    assert any("open to anyone" in note for note in lab.notes(public_tls=False))


def test_api_keys_alone_close_the_fleet_to_everyone() -> None:
    doors, _ = auth(config(operators=False, viewers=False), insecure=True)
    assert doors.check(Door.CLIENT, FakeRequest(KEY)).ok
    verdict = doors.check(Door.VIEWER, FakeRequest(KEY))
    assert verdict.status == 401 and "none is configured" in verdict.message
    # --insecure opens nothing once keys exist
    assert not doors.check(Door.OPERATOR, FakeRequest(KEY, method="POST")).ok
    assert not doors.metrics_open


def test_metrics_open_and_the_cleartext_warning() -> None:
    doors, _ = auth(config(metrics="open"))
    assert doors.metrics_open
    notes = doors.notes(public_tls=False)
    assert any("cleartext" in n and "api.operator_tokens" in n for n in notes)
    assert any("api.metrics: open" in n for n in notes)
    assert not any("cleartext" in n for n in doors.notes(public_tls=True))


def test_reload_takes_the_new_credentials() -> None:
    doors, _ = auth(config(viewers=False))
    assert not doors.check(Door.VIEWER, FakeRequest(VIEW)).ok
    doors.configure(config())
    assert doors.check(Door.VIEWER, FakeRequest(VIEW)).ok
    assert doors.identify(FakeRequest(VIEW)).role is Role.VIEWER


def test_refusals_are_all_counted_but_logged_at_most_once_a_second(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    counted: list[str] = []
    doors = Auth(config(), insecure=False, count=counted.append, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="llmgw.auth"):
        for _ in range(50):
            doors.check(Door.VIEWER, FakeRequest("wrong"))
        now[0] += 1.5
        doors.check(Door.VIEWER, FakeRequest("wrong"))
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert counted == ["viewer"] * 51
    assert len(lines) == 2 and "49 more refusals" in lines[1], lines
    assert "refused at the viewer door: GET '/api/v1/nodes' from 10.0.0.9:4000" in lines[0]
    assert not any("wrong" in line for line in lines)
