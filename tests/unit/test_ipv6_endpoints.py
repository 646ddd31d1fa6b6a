"""IPv6 engine endpoints: hosts bracketed where a URL needs them, and an endpoint that is not a
usable URL left out of the gateway's rotation instead of breaking it."""

from __future__ import annotations

from llmgw.agent.shardfiles import connect_host as _connect_host
from llmgw.catalog.schema import GatewaySettings, Model, StaticEndpoint
from llmgw.server.gateway.metrics import GatewayMetrics
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.metrics import ServerMetrics
from llmgw.web.client import Upstream
from llmgw.web.relay import RelayHub


def test_ipv6_hosts_are_bracketed() -> None:
    assert (_connect_host("::") == "[::1]" and _connect_host("fd00::1") == "[fd00::1]"
            and _connect_host("0.0.0.0") == "127.0.0.1")
    up = Upstream("http://[fd00::1]:20001")
    assert up.host == "fd00::1" and up.port == 20001 and up.authority == b"[fd00::1]:20001"


async def test_gateway_leaves_an_unusable_endpoint_out_of_rotation() -> None:
    gw = Gateway(GatewaySettings(), GatewayMetrics(ServerMetrics(lambda: {}).registry),
                 relay_hub=RelayHub(), client_door=lambda request: True)
    gw.configure([Model(name="chat")], [StaticEndpoint(model="chat", url="http://127.0.0.1:9")])
    gw.set_endpoints({"chat": {"http://fd00::1:20001", "http://127.0.0.1:20002"}})  # the first is not a URL
    assert sorted(gw.routes["chat"].balancer.endpoints) == ["http://127.0.0.1:20002", "http://127.0.0.1:9"]
