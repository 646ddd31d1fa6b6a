"""Who may register as which node, through the production FleetService on a real FleetListener:
the node-id rule (ids reach file paths and terminals) and, over real mutual TLS, that a node
certificate's common name must equal the node id it registers as (`require_identity`); and that
what a Register says reaches the reconciler through the Controller."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from llmgw import __version__
from llmgw.catalog.schema import ReconcileSettings
from llmgw.fleet import ChannelClosed, FleetChannel, FleetListener, dial
from llmgw.server.control import Controller, Settle, make_reconciler
from llmgw.server.fleet_service import FleetService
from llmgw.server.links import FleetLinks
from llmgw.server.metrics import ServerMetrics
from llmgw.server.registry import NodeRegistry
from llmgw.server.states import ReplicaState
from llmgw.tls import ca as store
from llmgw.tls import client_context, server_context
from llmgw.wire import messages as m
from tests.unit.test_reconcile import bring_up, catalog, nodes

MAX = 64 * 1024
DEADLINE = 10.0  # every wait below is for a condition, bounded by this


@asynccontextmanager
async def fleet(require_identity: bool, pki: Path | None = None) -> AsyncIterator[tuple[FleetService, list[str], str]]:
    """A FleetService behind a FleetListener on loopback (mutual TLS when `pki` is given);
    yields the service, the refusal codes the listener counted, and the URL agents dial."""
    service = FleetService(NodeRegistry(1.0), ServerMetrics(lambda: {}), register_timeout=DEADLINE,
                           require_identity=require_identity)
    refused: list[str] = []
    ctx = None
    if pki is not None:
        ctx = server_context(str(pki / "server.crt"), str(pki / "server.key"), str(pki / "ca.crt"),
                             require_client_cert=True)
    listener = FleetListener(service.handle, ssl_context=ctx, max_message=MAX, handshake_timeout=DEADLINE,
                             on_refused=refused.append)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.serve, listeners)
        yield service, refused, f"{'https' if pki else 'http'}://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def register(channel: FleetChannel, node_id: str) -> m.ServerMessage | ChannelClosed:
    """Send a Register; the server's first answer (Welcome), or how it ended the stream."""
    await channel.send(m.encode(m.Register(node_id=node_id, version=__version__)))
    with trio.fail_after(DEADLINE):
        try:
            return m.decode_server_message(await channel.receive())
        except ChannelClosed as exc:
            return exc


# -- the node-id rule ---------------------------------------------------------------------------

BAD_IDS = [
    "",  # empty
    "-gpu-01",  # must start with a letter or digit (would read as an option)
    ".gpu-01",  # hidden file
    "_gpu",
    "../../etc/passwd",  # a path
    "gpu/01",
    "gpu 01",  # whitespace
    "gpu-01\n",
    "gpu\x1b[31m01",  # a terminal escape
    "gpu:01",
    "a" * 254,  # longer than a DNS name
]
GOOD_IDS = ["gpu-01", "g", "7", "node_7.rack-2", "A" * 253]


@pytest.mark.parametrize("node_id", BAD_IDS)
async def test_a_bad_node_id_is_refused_before_it_is_registered(node_id: str) -> None:
    async with fleet(require_identity=False) as (service, refused, url), \
            dial(url, ssl_context=None, insecure=True, max_message=MAX) as channel:
        answer = await register(channel, node_id)
    assert isinstance(answer, ChannelClosed), answer
    assert answer.error and answer.reason == f"invalid node id {node_id!r}"
    assert refused == ["bad_node_id"]
    assert service.registry.nodes == {} and not service.links.ids()


@pytest.mark.parametrize("node_id", GOOD_IDS)
async def test_a_good_node_id_is_welcomed(node_id: str) -> None:
    async with fleet(require_identity=False) as (service, refused, url), \
            dial(url, ssl_context=None, insecure=True, max_message=MAX) as channel:
        answer = await register(channel, node_id)
        assert isinstance(answer, m.Welcome), answer
        assert list(service.registry.nodes) == [node_id] and refused == []


# -- the certificate's common name is the node id ---------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    now = time.time()
    root = tmp_path_factory.mktemp("pki")
    store.init_ca(root, now=now)
    store.issue_server(root, hosts=["ctrl"], ips=["127.0.0.1"], now=now)
    store.issue_client(root, "node", "gpu-01", now=now)
    return root


def node_context(pki: Path, node_id: str) -> object:
    return client_context(str(pki / "ca.crt"), str(pki / f"node-{node_id}.crt"), str(pki / f"node-{node_id}.key"))


async def test_a_node_certificate_registers_as_its_own_id(pki: Path) -> None:
    async with fleet(require_identity=True, pki=pki) as (service, refused, url), \
            dial(url, ssl_context=node_context(pki, "gpu-01"), max_message=MAX) as channel:  # type: ignore[arg-type]
        assert channel.tls_identity is None  # the agent's end knows no peer identity; the server's does
        answer = await register(channel, "gpu-01")
        assert isinstance(answer, m.Welcome), answer
        assert list(service.registry.nodes) == ["gpu-01"] and refused == []
        link = service.links.get("gpu-01")
        assert link is not None and link.channel.tls_identity == "gpu-01"


async def test_a_node_certificate_cannot_register_as_another_node(pki: Path) -> None:
    async with fleet(require_identity=True, pki=pki) as (service, refused, url), \
            dial(url, ssl_context=node_context(pki, "gpu-01"), max_message=MAX) as channel:  # type: ignore[arg-type]
        answer = await register(channel, "gpu-02")
    assert isinstance(answer, ChannelClosed), answer
    assert answer.error
    assert answer.reason == "client certificate is for 'gpu-01' but the agent registered as 'gpu-02'"
    assert refused == ["identity"]
    assert service.registry.nodes == {} and not service.links.ids()


async def test_without_require_identity_the_common_name_is_not_checked(pki: Path) -> None:
    """The flag is what turns the check on (a lab may share one certificate among nodes)."""
    async with fleet(require_identity=False, pki=pki) as (service, refused, url), \
            dial(url, ssl_context=node_context(pki, "gpu-01"), max_message=MAX) as channel:  # type: ignore[arg-type]
        answer = await register(channel, "gpu-02")
        assert isinstance(answer, m.Welcome), answer
        assert list(service.registry.nodes) == ["gpu-02"] and refused == []


# -- what a Register says reaches the reconciler --------------------------------------------------

async def test_an_agent_that_registers_with_nothing_has_its_replicas_disowned_through_the_real_path() -> None:
    """The seed's lesson (issue 37): the disowning of an engine a restarted agent no longer runs
    was tested only by calling the reconciler, and a caller that never called it went unseen.
    Here the agent registers with no shards over a real stream, through the production
    FleetService and Controller, and the replica the server believed in on it is let go."""
    registry = NodeRegistry(1.0)
    controller = Controller(make_reconciler(catalog(small=1, big=0), ReconcileSettings()), registry,
                            settle=Settle(ReconcileSettings(), registry), links=FleetLinks())
    bring_up(controller.reconciler, nodes("gpu-01"))
    [replica] = controller.reconciler.replicas.values()
    assert replica.state == ReplicaState.READY
    service = FleetService(registry, ServerMetrics(lambda: {}), register_timeout=DEADLINE, require_identity=False,
                           observer=controller)
    listener = FleetListener(service.handle, ssl_context=None, max_message=MAX, handshake_timeout=DEADLINE)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.serve, listeners)
        async with dial(url, ssl_context=None, insecure=True, max_message=MAX) as channel:
            assert isinstance(await register(channel, "gpu-01"), m.Welcome)  # shards: none
            assert replica.state == ReplicaState.FAILED and "no longer runs" in replica.reason, replica.reason
        nursery.cancel_scope.cancel()
