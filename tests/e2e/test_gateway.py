"""The gateway end to end: the official `openai` client against `llmgw server` in front of
simulated engines that agents run, and the ways clients and engines misbehave."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    bearer,
    engines_config,
    make_sim_node,
    pid_alive,
    replicas,
    start_agent,
    wait_until,
)

KEY = "sk-test-0123456789"
KEY_HASH = "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
VIEWER = "view-test-4a7d"  # the test's own reads of /api/v1 and /metrics

CATALOG = """\
models:
  - name: chat
    replicas: 2
    profiles:
      - engine: sim
        gpus: 1
        args: ["--ttft-ms", "5", "--itl-ms", "2"]
  - name: slow
    replicas: 1
    balancer: prefix-affinity
    admission:
      max_in_flight: 1
      max_queue: 0
    profiles:
      - engine: sim
        gpus: 1
        args: ["--ttft-ms", "50", "--itl-ms", "200", "--output-tokens", "50"]
"""

GATEWAY = f"""\
gateway:
  max_body: 1MiB
  body_timeout: 2s
  breaker_failures: 2
  breaker_cooldown: 30s
  scrape_interval: 0.5s
  api_keys: ["{KEY_HASH}"]
api:
  viewer_tokens: ["sha256:{hashlib.sha256(VIEWER.encode()).hexdigest()}"]
"""


@pytest.fixture
def fleet(tmp_path: Path, procs: list[Proc]) -> Server:
    server = Server(tmp_path, engines_config(CATALOG, GATEWAY), token=VIEWER)
    procs.append(server.start())
    for node in ("gpu-01", "gpu-02"):
        cfg = make_sim_node(tmp_path, node, server.fleet_url, FAST_AGENT, "--gpus", "4")
        procs.append(start_agent(tmp_path, node, cfg, "--stop-engines-on-exit"))
    wait_until(lambda: len(ready(server)) == 3, "three replicas ready", procs=procs)
    wait_until(lambda: {m["id"] for m in models(server)} == {"chat", "slow"}, "gateway routes both models", procs=procs)
    return server


def ready(server: Server) -> list[dict[str, Any]]:
    return [r for r in replicas(server) if r["state"] == "ready"]


def models(server: Server) -> list[dict[str, Any]]:
    return httpx.get(f"{server.url}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=5).json()["data"]


def client(server: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)


def metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=bearer(server.token), timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(f'{k}="{v}"' in line
                                                                                for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_openai_client_through_the_gateway(fleet: Server) -> None:
    c = client(fleet)
    chat = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hello"}])
    assert chat.model == "chat" and chat.choices[0].message.content and chat.usage.completion_tokens > 0
    completion = c.completions.create(model="chat", prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 5
    emb = c.embeddings.create(model="chat", input=["one", "two"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 8
    assert {m.id for m in c.models.list()} == {"chat", "slow"}
    # models.retrieve (GET /v1/models/{id}, the id percent-encoded by the client): the listed object.
    got = c.models.retrieve("chat")
    assert (got.id, got.object, got.owned_by) == ("chat", "model", "llmgw")
    # Streaming: events arrive one by one, and the stream ends with [DONE] (the client stops).
    pieces = []
    first_at = None
    t0 = time.monotonic()
    for event in c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], stream=True,
                                           stream_options={"include_usage": True}):
        if event.choices and event.choices[0].delta.content:
            first_at = first_at or time.monotonic() - t0
            pieces.append(event.choices[0].delta.content)
    assert len(pieces) >= 2 and first_at is not None
    # x-request-id is passed through and returned; one is made up when absent.
    r = httpx.post(f"{fleet.url}/v1/chat/completions",
                   headers={"authorization": f"Bearer {KEY}", "x-request-id": "abc-123"},
                   json={"model": "chat", "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    r = httpx.post(f"{fleet.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "chat", "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    assert len(r.headers["x-request-id"]) >= 16
    assert metric(fleet, "llmgw_requests_total", model="chat", code="200") >= 6
    # Replicas wanted against serving, per model (issue 46, item 8): what a first alert compares.
    assert [metric(fleet, f"llmgw_model_replicas_{kind}", model="chat") for kind in ("desired", "ready")] == [2, 2]
    assert metric(fleet, "llmgw_model_replicas_desired", model="slow") == 1
    assert metric(fleet, "llmgw_model_replicas", model="chat", state="ready") == 2
    assert metric(fleet, "llmgw_time_to_first_token_seconds_count", model="chat") >= 1
    # The five plain requests (the SDK writes each head and body separately) went through the
    # fast lane: answered there, or resumed by a task (one with no idle engine connection yet: the
    # health checks usually leave one); the stream did not.
    answered = metric(fleet, "llmgw_gateway_fast_lane_requests_total", model="chat", outcome="answered")
    resumed = metric(fleet, "llmgw_gateway_fast_lane_requests_total", model="chat", outcome="resumed")
    assert answered >= 3 and answered + resumed == 5, (answered, resumed)


def test_api_keys_and_openai_error_shapes(fleet: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        client(fleet, key="wrong").chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert metric(fleet, "llmgw_auth_failures_total") >= 1
    assert "wrong" not in fleet.proc.log()  # counted, never logged
    with pytest.raises(openai.NotFoundError) as info:
        client(fleet).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client(fleet).models.retrieve("meta-llama/nope")
    assert (info.value.body["code"] == "model_not_found"
            and "`meta-llama/nope` does not exist" in info.value.body["message"])
    with pytest.raises(openai.AuthenticationError):
        client(fleet, key="wrong").models.retrieve("chat")
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(f"{fleet.url}/v1/chat/completions", headers=auth, content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{fleet.url}/v1/chat/completions", headers=auth, json={"messages": []}, timeout=10)
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]
    # 10 MB over a 1 MB limit: refused from the Content-Length, before the body is read.
    r = httpx.post(f"{fleet.url}/v1/chat/completions", headers=auth, content=b"x" * (10 * 1024 * 1024), timeout=30)
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]


def test_admission_queue_full_is_429_with_retry_after(fleet: Server) -> None:
    results: list[int] = []

    def slow_request() -> None:
        with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                          json={"model": "slow", "messages": [{"role": "user", "content": "x"}], "stream": True},
                          timeout=30) as r:
            results.append(r.status_code)
            for _ in r.iter_bytes():
                pass

    holder = threading.Thread(target=slow_request)
    holder.start()
    wait_until(lambda: metric(fleet, "llmgw_requests_in_flight", model="slow") == 1, "the slot taken")
    r = httpx.post(f"{fleet.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "slow", "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    holder.join(timeout=60)
    assert results == [200]


def test_slow_drip_body_is_cut_off_and_others_are_served(fleet: Server) -> None:
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "x"}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", fleet.public_port), timeout=10) as drip:
        drip.sendall(head + body[:5])
        # Meanwhile a normal client is served at once.
        assert client(fleet).chat.completions.create(model="chat", messages=[{"role": "user", "content": "y"}]).choices
        reply = b""
        while chunk := drip.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408")


def test_client_disconnect_mid_stream_cancels_the_engine_request(fleet: Server) -> None:
    slow = next(r for r in ready(fleet) if r["model"] == "slow")
    engine = slow["shards"][0]["endpoint"]

    def running() -> float:
        for line in httpx.get(f"{engine}/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:num_requests_running{"):
                return float(line.rsplit(" ", 1)[1])
        return -1.0

    with httpx.stream("POST", f"{fleet.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "slow", "messages": [{"role": "user", "content": "x"}], "stream": True},
                      timeout=30) as r:
        it = r.iter_bytes()
        assert next(it)  # the first event arrived: the engine is generating
        assert running() == 1
    # The client went away after one event (50 tokens at 200 ms would take 10 s).
    wait_until(lambda: running() == 0, "the engine's request cancelled", deadline=5)
    wait_until(lambda: metric(fleet, "llmgw_requests_in_flight", model="slow") == 0, "no request left in flight",
               deadline=5)
    assert metric(fleet, "llmgw_requests_total", model="slow", code="499") >= 1


def breaker_of(server: Server, endpoint: str) -> str:
    """The breaker state `/api/v1/endpoints` shows for one endpoint ("" when it is not listed)."""
    return next((ep["breaker"] for ep in server.get("/api/v1/endpoints") if ep["endpoint"] == endpoint), "")


def test_engine_killed_mid_run_loses_no_request(fleet: Server, procs: list[Proc]) -> None:
    chat = [r for r in ready(fleet) if r["model"] == "chat"]
    victim = chat[0]
    victim_pid, victim_ep = victim["shards"][0]["pid"], victim["shards"][0]["endpoint"]
    victim_agent = next(p for p in procs if p.name == f"agent-{victim['shards'][0]['node']}")
    stop = threading.Event()
    outcomes: list[str] = []

    def steady(n: int) -> None:
        c = client(fleet)
        while not stop.is_set():
            try:
                r = c.chat.completions.create(model="chat", messages=[{"role": "user", "content": f"req {n}"}],
                                              max_tokens=4)
                outcomes.append("ok" if r.choices else "empty")
            except Exception as exc:
                outcomes.append(f"error: {exc!r}")

    threads = [threading.Thread(target=steady, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(outcomes) >= 30, "traffic flowing")

        def victim_busy() -> bool:
            text = httpx.get(f"{victim_ep}/metrics", timeout=5).text
            return any(line.startswith("vllm:num_requests_running{") and float(line.rsplit(" ", 1)[1]) > 0
                       for line in text.splitlines())

        # Kill it with a request inside: otherwise, if the agent's report takes the endpoint out
        # of rotation before any request picks it, nothing fails and nothing is retried.
        wait_until(victim_busy, "a request running on the victim")
        # The victim's agent is frozen first, so that only the requests can tell the gateway the
        # engine died: its report would take the endpoint out of rotation, racing the breaker
        # (about a millisecond apart on loopback). The node stays ready for 0.75 s without
        # heartbeats, much longer than two failed requests take.
        victim_agent.signal(signal.SIGSTOP)
        try:
            os.kill(victim_pid, signal.SIGKILL)
            # Each failed request is reported to the endpoint's breaker: breaker_failures (2) in
            # a row open it.
            wait_until(lambda: breaker_of(fleet, victim_ep) == "open", "the dead engine's breaker open", deadline=10)
        finally:
            victim_agent.signal(signal.SIGCONT)
        wait_until(lambda: not pid_alive(victim_pid), "engine gone", deadline=5)
        replaced = wait_until(
            lambda: next((r for r in ready(fleet) if r["id"] == victim["id"] and r["shards"][0]["pid"] != victim_pid),
                         None),
            "the replica replaced", procs=procs)
        new_ep = replaced["shards"][0]["endpoint"]

        def new_engine_served() -> bool:
            text = httpx.get(f"{new_ep}/metrics", timeout=5).text
            return any(line.startswith("vllm:request_success_total{") and float(line.rsplit(" ", 1)[1]) > 0
                       for line in text.splitlines())

        wait_until(new_engine_served, "the new engine taking traffic")
        count = len(outcomes)
        wait_until(lambda: len(outcomes) >= count + 30, "traffic after the replacement")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    errors = [o for o in outcomes if o != "ok"]
    assert errors == [], errors[:5]
    # The traffic took the fast lane (the failures it met were retried by a task, below).
    assert metric(fleet, "llmgw_gateway_fast_lane_requests_total", model="chat", outcome="answered") > 30
    assert len(outcomes) > 60
    assert metric(fleet, "llmgw_upstream_retries_total", model="chat") >= 1
