"""A broken-into edge gateway, through the doors production uses: a gateway certificate's own
stream on the real mutual-TLS fleet port of a real `llmgw server` (issue 40, findings 2 and 5).

- What it is sent: the catalog's routing view, never a profile's env (HF_TOKEN) nor a source URL
  with its user:pass@ and presigned query; a real `llmgw gateway` still routes with it.
- What it may write: one stream per certificate (a second replaces the first, `ctl gateways`
  lists it once); of its metrics report only a gateway's own families and labels, up to its
  series cap, reach /metrics, and the rest is counted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio

from llmgw import __version__
from llmgw.fleet import ChannelClosed, FleetChannel, dial
from llmgw.server.gwfeed import SERIES_BASE, SERIES_PER_ENDPOINT, SERIES_PER_MODEL
from llmgw.tls import client_context
from llmgw.wire.gateway import (
    GATEWAY_PATH,
    REPLACED,
    GatewayConfig,
    GatewayEndpoints,
    GatewayHello,
    GatewayStats,
    decode_to_gateway,
    encode,
)
from tests.abuse.door import Certs, make_ca, report
from tests.e2e.harness import Proc, Server, ctl_json, start_sim_engine, wait_until, wait_until_async
from tests.e2e.test_gateway_remote import start_gateway

SECRETS = (b"hf_secret_token_123", b"HF_TOKEN", b"s3cret-pass", b"alice", b"X-Amz-Signature", b"sig-abc123",
           b"--secret-arg", b"weights.example")
CATALOG = """\
fleet:
  heartbeat_interval: 0.25s
  # The hand-spoken followers send nothing of their own between steps: the listener's idle
  # timeout (2 x silence + register_timeout, 3.5 s at 2 s) cut them on a loaded machine.
  register_timeout: 10s
models:
  - name: chat
    source: https://alice:s3cret-pass@weights.example/chat.safetensors?X-Amz-Signature=sig-abc123
    replicas: 1
    admission:
      max_in_flight: 7
      max_queue: 11
    profiles:
      - engine: sim
        gpus: 1
        args: ["--secret-arg", "1"]
        env:
          HF_TOKEN: hf_secret_token_123
endpoints:
  - model: chat
    url: {engine}
"""


class Site(msgspec.Struct):
    tmp: Path
    certs: Certs
    server: Server
    engine: str
    procs: list[Proc]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("gwfeed")
    certs = make_ca(tmp / "ca")
    procs: list[Proc] = []
    try:
        engine_proc, engine = start_sim_engine(tmp, "engine", "--served-model-name", "chat", "--ttft-ms", "1",
                                               "--itl-ms", "1")
        procs.append(engine_proc)
        server = Server(tmp, CATALOG.format(engine=engine) + certs.server_tls_yaml(), insecure=False)
        procs.append(server.start())
        yield Site(tmp=tmp, certs=certs, server=server, engine=engine, procs=procs)
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
            p.kill_group()


class Follower:
    """A gateway certificate's own stream, spoken by hand: what arrives, byte for byte."""

    def __init__(self, site: Site, name: str) -> None:
        crt, key = site.certs.gateway(name)
        self.context = client_context(str(site.certs.ca), str(crt), str(key), alpn=("h2",))
        self.url = site.server.fleet_url
        self.name = name

    async def open(self, nursery: trio.Nursery) -> Stream:
        """Dial, say hello, and return once the config and endpoints came (the raw payloads)."""
        stream = Stream()
        ready = trio.Event()

        async def follow(task_status: trio.TaskStatus[None]) -> None:
            async with dial(self.url, ssl_context=self.context, path=GATEWAY_PATH, idle_timeout=None,
                            max_message=4 << 20) as ch:
                await ch.send(encode(GatewayHello(name="says-anything", version=__version__, pid=1)))
                stream.channel = ch
                task_status.started()
                try:
                    while True:
                        stream.got.append(await ch.receive())
                        if len(stream.got) >= 2:
                            ready.set()
                except ChannelClosed as exc:
                    stream.ended = exc.reason

        await nursery.start(follow)
        with trio.fail_after(10):
            await ready.wait()
        return stream


class Stream:
    def __init__(self) -> None:
        self.channel: FleetChannel | None = None
        self.got: list[bytes] = []  # what the control plane sent, as it came
        self.ended = ""  # why it ended, when it did

    async def send(self, payload: bytes) -> None:
        assert self.channel is not None
        await self.channel.send(payload)


def metrics(site: Site) -> str:
    return httpx.get(f"{site.server.url}/metrics", timeout=10).text


def gateways(site: Site) -> list[str]:
    return [g["name"] for g in site.server.get("/api/v1/gateways")]


async def test_a_gateway_certificate_is_sent_no_env_and_no_source_url(site: Site) -> None:
    """Finding 2: before, the GatewayConfig held the whole catalog, each secret above included."""
    async with trio.open_nursery() as nursery:
        got = (await Follower(site, "gw-wire").open(nursery)).got
        nursery.cancel_scope.cancel()
    for payload in got:
        leaked = [s.decode() for s in SECRETS if s in payload]
        assert not leaked, f"the feed sent a gateway certificate {leaked}: {payload[:600]!r}"
    config = next(m for p in got if isinstance(m := decode_to_gateway(p), GatewayConfig))
    endpoints = next(m for p in got if isinstance(m := decode_to_gateway(p), GatewayEndpoints))
    assert [(m.name, m.balancer, m.admission.max_in_flight, m.admission.max_queue) for m in config.models] == [
        ("chat", "least-outstanding", 7, 11)]
    raw = msgspec.json.decode(next(p for p in got if b'"GatewayConfig"' in p), type=dict)
    assert set(raw["models"][0]) == {"name", "balancer", "admission"}, raw["models"][0]
    assert [ep.url for ep in config.static] == [site.engine] and endpoints.ready == {}
    report("a gateway certificate's feed", f"config of {len(got[0])} bytes: the routing view only "
           f"({', '.join(sorted(raw['models'][0]))}); no env, no source URL", "n/a")


def test_a_real_gateway_still_routes_with_the_routing_view(site: Site) -> None:
    crt, key = site.certs.gateway("gw-route")
    proc, url, _ = start_gateway(site.tmp, "gateway-route", site.server.fleet_url, "--cert", str(crt),
                                       "--key", str(key), "--ca", str(site.certs.ca))
    site.procs.append(proc)
    wait_until(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, "the gateway to serve",
               procs=[proc, *site.procs])
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["chat"]
    wait_until(lambda: 'worker="gw-route"' in metrics(site),
               "its metrics in the control plane's scrape", procs=[proc])
    proc.stop(timeout=5)


async def test_a_second_stream_of_one_certificate_replaces_the_first(site: Site) -> None:
    """Finding 5: four streams of one certificate were four followers, listed four times."""
    follower = Follower(site, "gw-twice")
    async with trio.open_nursery() as nursery:
        first = await follower.open(nursery)
        await wait_until_async(lambda: gateways(site).count("gw-twice") == 1, "the first stream listed")
        second = await follower.open(nursery)
        await wait_until_async(lambda: first.ended, "the first stream to be ended")
        assert REPLACED in first.ended, first.ended
        assert gateways(site).count("gw-twice") == 1 and not second.ended
        listed = await trio.to_thread.run_sync(ctl_json, site.server.url, "gateways")
        assert [g["name"] for g in listed].count("gw-twice") == 1, listed  # `ctl gateways`: once
        # The second is the one followed: its report is the one read.
        await second.send(encode(GatewayStats(metrics='# TYPE llmgw_requests_total counter\n'
                                                      'llmgw_requests_total{code="200",model="chat"} 3\n', requests=3)))
        await wait_until_async(lambda: 'llmgw_requests_total{code="200",model="chat",worker="gw-twice"} 3.0'
                               in metrics(site), "the second's report shown")
        nursery.cancel_scope.cancel()
    text = await trio.to_thread.run_sync(metrics, site)
    assert re.search(r'^llmgw_fleet_refused_total\{reason="replaced"\} [1-9]', text, re.M)
    report("a second stream of one gateway certificate", f"the first ended: {first.ended}; listed once", "n/a")


async def test_forged_series_are_refused_counted_and_metrics_stay_bounded(site: Site) -> None:
    """Finding 5: 20,000 made-up series took /metrics from ~10 KB to 9.3 MB. Now: a family of the
    control plane's, a label no gateway sets and series past the cap are left out and counted."""
    cap = SERIES_BASE + SERIES_PER_MODEL * 1 + SERIES_PER_ENDPOINT * 1  # one model, one static endpoint
    lines = ['# TYPE llmgw_nodes gauge', 'llmgw_nodes{state="ready"} 999999',
             '# TYPE llmgw_engine_up gauge', 'llmgw_engine_up{endpoint="e",model="chat",evil="x"} 1',
             '# TYPE llmgw_requests_total counter', 'llmgw_requests_total{code="200",model="chat"} 5']
    lines += [f'llmgw_requests_total{{code="200",model="forged-{i:05d}"}} 1' for i in range(20_000)]
    forged = "\n".join(lines) + "\n"
    before = len(await trio.to_thread.run_sync(metrics, site))
    async with trio.open_nursery() as nursery:
        forger = await Follower(site, "gw-forge").open(nursery)
        await forger.send(encode(GatewayStats(metrics=forged, requests=5)))

        def refused() -> str | None:
            text = metrics(site)
            return text if 'llmgw_gateway_series_refused_total{reason="cap",worker="gw-forge"}' in text else None

        text = await wait_until_async(refused, "the forged report read and counted")
        nursery.cancel_scope.cancel()
    ours = [line for line in text.splitlines() if 'worker="gw-forge"' in line
            and not line.startswith("llmgw_gateway_series")]
    assert len(ours) == cap, len(ours)
    assert 'llmgw_requests_total{code="200",model="chat",worker="gw-forge"} 5.0' in text  # its own, first, kept
    assert "999999" not in text and 'evil="x"' not in text
    counts = dict(re.findall(r'^llmgw_gateway_series_refused_total\{reason="(\w+)",worker="gw-forge"\} (\S+)', text,
                             re.M))
    assert counts == {"cap": f"{20_001 - cap}.0", "labels": "1.0", "family": "1.0"}, counts
    assert len(text) < before + cap * 120 + 4096, (before, len(text))
    report("20,000 forged series from a gateway certificate", f"/metrics {before} -> {len(text)} bytes: {cap} series "
           f"kept (its cap), refused {counts}", "n/a")
