"""What a gateway worker says about its doors when its config comes on the feed. It holds the
client door only (API keys): the control plane's notes about viewers, operators and its public
port's TLS are not the worker's to repeat. Each of a server's workers logged "nobody can read
/api/v1" and "the public port has no TLS" on a server that had viewer tokens and public_tls."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from llmgw.catalog.schema import GatewaySettings
from llmgw.server.gateway.worker import Follow, GatewayWorker
from llmgw.tls import ca as store
from llmgw.tls.context import ServerTls
from llmgw.wire.gateway import GatewayConfig, encode

KEYED = encode(GatewayConfig(settings=GatewaySettings(api_keys=["sha256:" + "ab" * 32])))


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[str, str]:
    root = tmp_path / "ca"
    store.init_ca(root, now=time.time())
    store.issue_server(root, hosts=["gw"], ips=["127.0.0.1"], now=time.time())
    return str(root / "server.crt"), str(root / "server.key")


def notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.auth"]


def test_a_local_worker_repeats_none_of_the_control_planes_notes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    worker = GatewayWorker("worker-0", Follow(unix_path="/nonexistent"), local=True)
    worker._apply(KEYED)
    assert worker.configured.is_set()
    assert notes(caplog) == []


def test_a_remote_gateway_says_when_api_keys_cross_in_cleartext(caplog: pytest.LogCaptureFixture,
                                                                tls_files: tuple[str, str]) -> None:
    caplog.set_level(logging.WARNING)
    GatewayWorker("gw-1", Follow(url="http://cp:1"), local=False)._apply(KEYED)
    said = notes(caplog)
    assert len(said) == 1 and "client port has no TLS (--public-tls-cert)" in said[0] and "/api/v1" not in said[0]
    caplog.clear()
    cert, key = tls_files
    GatewayWorker("gw-2", Follow(url="http://cp:1"), local=False, public_tls=ServerTls(cert, key))._apply(KEYED)
    assert notes(caplog) == []
