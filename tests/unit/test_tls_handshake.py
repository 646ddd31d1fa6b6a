"""Real TLS handshakes on loopback (trio.SSLStream over TCP on 127.0.0.1) with certificates from
the CA: who gets in, who is refused, what the server reads, and what explain_tls_error says."""

from __future__ import annotations

import dataclasses
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from llmgw.tls import ca as store
from llmgw.tls import (
    client_context,
    explain_tls_error,
    net,
    peer_common_name,
    peer_is_operator,
    server_context,
)

DEADLINE = 10  # seconds; every wait below is bounded by it


@dataclasses.dataclass
class Pki:
    root: Path
    other: Path  # a second, unrelated CA

    def ca(self) -> str:
        return str(self.root / "ca.crt")

    def pair(self, name: str, root: Path | None = None) -> tuple[str, str]:
        base = (root or self.root) / name
        return f"{base}.crt", f"{base}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    now = time.time()
    root = tmp_path_factory.mktemp("pki")
    pki = Pki(root=root / "ca", other=root / "other")
    store.init_ca(pki.root, now=now)
    store.init_ca(pki.other, now=now)
    store.issue_server(pki.root, hosts=["ctrl"], ips=["127.0.0.1"], now=now)
    store.issue_server(pki.root, hosts=["ctrl"], ips=["127.0.0.2"], now=now, out=str(pki.root / "wrong-ip"))
    store.issue_server(pki.root, hosts=["ctrl"], ips=["127.0.0.1"], now=now, out=str(pki.root / "expired-server"),
                       not_after=now - 86400)
    store.issue_server(pki.other, hosts=["ctrl"], ips=["127.0.0.1"], now=now)
    store.issue_client(pki.root, "node", "gpu-01", now=now)
    store.issue_client(pki.root, "node", "gpu-old", now=now, not_after=now - 86400)
    store.issue_client(pki.other, "node", "intruder", now=now)
    store.issue_client(pki.root, "operator", "alice", now=now)
    store.issue_client(pki.root, "viewer", "grafana", now=now)
    for key_type in ("rsa-3072", "ed25519"):
        store.init_ca(root / key_type, now=now, key_type=key_type)
        store.issue_server(root / key_type, hosts=["ctrl"], ips=["127.0.0.1"], now=now, key_type=key_type)
        store.issue_client(root / key_type, "node", "gpu-01", now=now, key_type=key_type)
    return pki


@dataclasses.dataclass
class Accepted:
    common_name: str | None
    is_operator: bool
    alpn: str | None
    # What the server's getpeercert() returned, for the checks made from it (kinds, revocation).
    peercert: dict = dataclasses.field(default_factory=dict, compare=False)

    def getpeercert(self, binary_form: bool = False) -> dict:
        return self.peercert


@dataclasses.dataclass
class Refused:
    error: BaseException


@dataclasses.dataclass
class Server:
    port: int
    outcomes: trio.MemoryReceiveChannel[Accepted | Refused]

    async def next(self) -> Accepted | Refused:
        with trio.fail_after(DEADLINE):
            return await self.outcomes.receive()


@asynccontextmanager
async def tls_server(ctx: ssl.SSLContext, *, send_alerts: bool = True) -> AsyncIterator[Server]:
    """A TLS listener on 127.0.0.1 that reports each connection's outcome."""
    send, receive = trio.open_memory_channel[Accepted | Refused](100)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handle(tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, ctx, server_side=True)
        try:
            if send_alerts:
                await net.handshake(stream)
            else:
                await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            await send.send(Refused(exc))
            await tcp.aclose()
            return
        await send.send(Accepted(peer_common_name(stream), peer_is_operator(stream), stream.selected_alpn_protocol(),
                                 stream.getpeercert() or {}))
        try:
            await stream.send_all(b"hello")
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await tcp.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        yield Server(port, receive)
        nursery.cancel_scope.cancel()


async def dial(port: int, ctx: ssl.SSLContext, server_hostname: str = "127.0.0.1") -> bytes:
    """Connect, handshake and read the greeting; raises trio.BrokenResourceError on refusal
    (with TLS 1.3 a refused client certificate shows up at this first read)."""
    with trio.fail_after(DEADLINE):
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = trio.SSLStream(tcp, ctx, server_hostname=server_hostname)
        try:
            await net.handshake(stream)
            return await stream.receive_some(5)
        finally:
            await tcp.aclose()


def fleet_server_ctx(pki: Pki, name: str = "server") -> ssl.SSLContext:
    cert, key = pki.pair(name)
    return server_context(cert, key, pki.ca(), require_client_cert=True)


async def test_node_certificate_is_accepted_and_its_cn_read(pki: Pki) -> None:
    async with tls_server(fleet_server_ctx(pki)) as server:
        client = client_context(pki.ca(), *pki.pair("node-gpu-01"))
        assert await dial(server.port, client) == b"hello"
        outcome = await server.next()
    assert outcome == Accepted(common_name="gpu-01", is_operator=False, alpn="h2")


async def test_operator_certificate_is_told_from_a_node(pki: Pki) -> None:
    cert, key = pki.pair("server")
    public = server_context(cert, key, pki.ca(), require_client_cert=False)
    async with tls_server(public) as server:
        await dial(server.port, client_context(pki.ca(), *pki.pair("operator-alice"), alpn=("h2", "http/1.1")))
        operator = await server.next()
        # No client certificate at all is allowed on the public port; it is nobody.
        await dial(server.port, client_context(pki.ca(), alpn=("http/1.1",)))
        anonymous = await server.next()
    assert operator == Accepted(common_name="alice", is_operator=True, alpn="h2")
    assert anonymous == Accepted(common_name=None, is_operator=False, alpn="http/1.1")


async def test_certificate_from_another_ca_is_refused(pki: Pki) -> None:
    async with tls_server(fleet_server_ctx(pki)) as server:
        client = client_context(pki.ca(), *pki.pair("node-intruder", pki.other))
        with pytest.raises(trio.BrokenResourceError) as refused:
            await dial(server.port, client)
        outcome = await server.next()
    assert isinstance(outcome, Refused)
    assert isinstance(outcome.error.__cause__, ssl.SSLCertVerificationError)
    assert "not issued by our CA" in explain_tls_error(outcome.error, "127.0.0.1", side="server")
    line = explain_tls_error(refused.value, "127.0.0.1")
    assert line.startswith("127.0.0.1 refused our client certificate: it is not issued by the CA the server trusts")


async def test_expired_client_certificate_is_refused(pki: Pki) -> None:
    async with tls_server(fleet_server_ctx(pki)) as server:
        with pytest.raises(trio.BrokenResourceError) as refused:
            await dial(server.port, client_context(pki.ca(), *pki.pair("node-gpu-old")))
        outcome = await server.next()
    assert isinstance(outcome, Refused)
    assert outcome.error.__cause__.verify_code == 10  # X509_V_ERR_CERT_HAS_EXPIRED
    assert "presented an expired certificate" in explain_tls_error(outcome.error, "127.0.0.1", side="server")
    assert "refused our client certificate: it has expired" in explain_tls_error(refused.value, "127.0.0.1")


async def test_missing_client_certificate_is_refused_on_the_fleet_port(pki: Pki) -> None:
    async with tls_server(fleet_server_ctx(pki)) as server:
        with pytest.raises(trio.BrokenResourceError) as refused:
            await dial(server.port, client_context(pki.ca()))
        outcome = await server.next()
    assert isinstance(outcome, Refused)
    assert "requires a client certificate and we sent none" in explain_tls_error(refused.value, "127.0.0.1")
    assert "sent no client certificate" in explain_tls_error(outcome.error, "127.0.0.1", side="server")


async def test_server_certificate_as_client_certificate_is_refused(pki: Pki) -> None:
    async with tls_server(fleet_server_ctx(pki)) as server:
        with pytest.raises(trio.BrokenResourceError) as refused:
            await dial(server.port, client_context(pki.ca(), *pki.pair("server")))
        await server.next()
    assert "lacks clientAuth" in explain_tls_error(refused.value, "127.0.0.1")


async def test_server_certificate_lacking_the_dialed_ip_is_rejected_and_explained(pki: Pki) -> None:
    async with tls_server(fleet_server_ctx(pki, "wrong-ip")) as server:
        with pytest.raises(trio.BrokenResourceError) as rejected:
            await dial(server.port, client_context(pki.ca(), *pki.pair("node-gpu-01")))
        assert rejected.value.__cause__.verify_code == 64  # X509_V_ERR_IP_ADDRESS_MISMATCH
        # The agent fetches what the server presented, for the message only.
        presented = await net.fetch_server_certificate("127.0.0.1", server.port)
    assert presented is not None
    assert explain_tls_error(rejected.value, "127.0.0.1", peer_cert=presented, ca_dir="/etc/llmgw/ca") == (
        "server certificate is not valid for 127.0.0.1 (its SANs: DNS:ctrl, IP:127.0.0.2); reissue it with "
        "`llmgw ctl cert server --dir /etc/llmgw/ca --host ctrl --ip 127.0.0.2 --ip 127.0.0.1 --force`"
    )
    # Without the certificate the line still names the address and the fix.
    bare = explain_tls_error(rejected.value, "127.0.0.1")
    assert bare.startswith("server certificate is not valid for 127.0.0.1 (127.0.0.1 is not among its SANs)")
    assert "--ip 127.0.0.1" in bare


async def test_server_certificate_lacking_the_dialed_name_is_rejected(pki: Pki) -> None:
    async with tls_server(fleet_server_ctx(pki)) as server:
        with pytest.raises(trio.BrokenResourceError) as rejected:
            await dial(server.port, client_context(pki.ca(), *pki.pair("node-gpu-01")),
                       server_hostname="control.example")
    line = explain_tls_error(rejected.value, "control.example")
    assert line.startswith("server certificate is not valid for control.example")
    assert "--host control.example" in line
    # The CN is not a name clients accept: "ctrl" is a SAN, so dialing it works.
    async with tls_server(fleet_server_ctx(pki)) as server:
        assert await dial(server.port, client_context(pki.ca(), *pki.pair("node-gpu-01")),
                          server_hostname="ctrl") == b"hello"


async def test_expired_and_foreign_server_certificates_are_rejected(pki: Pki) -> None:
    client = client_context(pki.ca(), *pki.pair("node-gpu-01"))
    async with tls_server(fleet_server_ctx(pki, "expired-server")) as server:
        with pytest.raises(trio.BrokenResourceError) as expired:
            await dial(server.port, client)
    assert explain_tls_error(expired.value, "127.0.0.1").startswith("the server certificate of 127.0.0.1 expired")
    foreign_cert, foreign_key = pki.pair("server", pki.other)
    foreign = server_context(foreign_cert, foreign_key, pki.ca(), require_client_cert=True)
    async with tls_server(foreign) as server:
        with pytest.raises(trio.BrokenResourceError) as unknown:
            await dial(server.port, client)
        presented = await net.fetch_server_certificate("127.0.0.1", server.port)
    line = explain_tls_error(unknown.value, "127.0.0.1", peer_cert=presented)
    assert "is not signed by the CA we trust (issued by CN=llmgw CA,O=llmgw)" in line


async def test_bare_eof_from_a_server_that_sends_no_alert_is_still_explained(pki: Pki) -> None:
    # trio.SSLStream.do_handshake alone drops the alert OpenSSL queued: the client sees EOF.
    async with tls_server(fleet_server_ctx(pki), send_alerts=False) as server:
        with pytest.raises(trio.BrokenResourceError) as refused:
            await dial(server.port, client_context(pki.ca(), *pki.pair("node-intruder", pki.other)))
        await server.next()
    assert "client certificate" in explain_tls_error(refused.value, "127.0.0.1")


@pytest.mark.parametrize("key_type", ["rsa-3072", "ed25519"])
@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_other_key_types_handshake(pki: Pki, key_type: str, version: ssl.TLSVersion) -> None:
    root = pki.root.parent / key_type
    server = server_context(str(root / "server.crt"), str(root / "server.key"), str(root / "ca.crt"), True)
    client = client_context(str(root / "ca.crt"), str(root / "node-gpu-01.crt"), str(root / "node-gpu-01.key"))
    client.maximum_version = version
    async with tls_server(server) as listening:
        assert await dial(listening.port, client) == b"hello"
        outcome = await listening.next()
    assert isinstance(outcome, Accepted) and outcome.common_name == "gpu-01"


async def test_versions_below_1_2_are_off_and_a_version_mismatch_is_explained(pki: Pki) -> None:
    server = fleet_server_ctx(pki)
    client = client_context(pki.ca(), *pki.pair("node-gpu-01"))
    assert server.minimum_version == client.minimum_version == ssl.TLSVersion.TLSv1_2
    server.maximum_version = ssl.TLSVersion.TLSv1_2
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    async with tls_server(server) as listening:
        with pytest.raises(trio.BrokenResourceError) as refused:
            await dial(listening.port, client)
        await listening.next()
    assert "no TLS version in common with 127.0.0.1" in explain_tls_error(refused.value, "127.0.0.1")


async def test_plain_text_peer_is_explained() -> None:
    async def plain(tcp: trio.SocketStream) -> None:
        await tcp.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await tcp.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, plain, listeners)
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with pytest.raises(trio.BrokenResourceError) as err:
            await dial(port, ctx)
        nursery.cancel_scope.cancel()
    assert "did not answer in TLS" in explain_tls_error(err.value, "127.0.0.1")


async def test_connection_refused_is_explained() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    with pytest.raises(OSError) as err:
        await trio.open_tcp_stream("127.0.0.1", port)
    assert "connection refused" in explain_tls_error(err.value, "127.0.0.1")
    assert await net.fetch_server_certificate("127.0.0.1", port) is None


async def test_fleet_port_takes_only_node_certificates_and_no_revoked_serial(pki: Pki) -> None:
    """peer_kind/peer_serial read what a real handshake verified; fleet_refusal decides from them."""
    from llmgw.tls.identity import peer_kind, peer_serial
    from llmgw.tls.info import load_certificate
    from llmgw.tls.revocation import Revocations, fleet_refusal

    cert, key = pki.pair("server")
    seen: dict[str, Accepted] = {}
    async with tls_server(server_context(cert, key, pki.ca(), require_client_cert=True)) as server:
        for name in ("node-gpu-01", "operator-alice", "viewer-grafana"):
            await dial(server.port, client_context(pki.ca(), *pki.pair(name)))
            outcome = await server.next()
            assert isinstance(outcome, Accepted)
            seen[name] = outcome
    assert {name: peer_kind(a) for name, a in seen.items()} == {
        "node-gpu-01": "node", "operator-alice": "operator", "viewer-grafana": "viewer"}
    node_serial = load_certificate(pki.pair("node-gpu-01")[0]).serial_number
    assert peer_serial(seen["node-gpu-01"]) == node_serial
    revocations = Revocations()
    assert fleet_refusal(seen["node-gpu-01"], revocations, require_node=True) is None
    reason, message = fleet_refusal(seen["operator-alice"], revocations, require_node=True) or ("", "")
    assert reason == "not_node" and "'alice' is an operator certificate, not a node certificate" in message
    assert fleet_refusal(seen["operator-alice"], revocations, require_node=False) is None
    revocations.denied = frozenset({node_serial})
    reason, message = fleet_refusal(seen["node-gpu-01"], revocations, require_node=True) or ("", "")
    assert reason == "revoked" and f"(serial {node_serial:x}) is revoked" in message
