"""The gateway's defences against an engine that accepts and never answers, and against a client
that gives up (issue 9 item 1), on router-only configs in front of engines this test starts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai

from tests.e2e.harness import (
    ENGINE_LISTENING,
    FAST_FLEET,
    Proc,
    Server,
    get_json,
    start_sim_engine,
    wait_until,
)


def hung_engine(tmp: Path, procs: list[Proc]) -> str:
    """`llmgw sim engine --hang`: it listens, accepts, and never answers anything."""
    proc = Proc("hung", ["sim", "engine", "--port", "0", "--served-model-name", "chat", "--hang"], tmp)
    procs.append(proc)
    host, port = wait_until(lambda: (m := ENGINE_LISTENING.search(proc.log())) and m.groups(), "the hung engine's port",
                            procs=[proc])
    return f"http://{host}:{port}"


def metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_a_stream_without_its_head_in_time_goes_to_another_engine(tmp_path: Path, procs: list[Proc]) -> None:
    """Active health off, so only stream_head_timeout can save a stream sent to the hung engine:
    no stream waits longer than about that before it is served elsewhere."""
    good_proc, good = start_sim_engine(tmp_path, "good", "--served-model-name", "chat", "--ttft-ms", "1",
                                       "--itl-ms", "1")
    procs.append(good_proc)
    hung = hung_engine(tmp_path, procs)
    config = FAST_FLEET + """\
gateway:
  health_interval: 0s
  stream_head_timeout: 1s
  breaker_failures: 100
  retry_budget: 1.0
endpoints:
""" + "".join(f"  - model: chat\n    url: {u}\n" for u in (good, hung))
    server = Server(tmp_path, config)
    procs.append(server.start())
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    took: list[float] = []

    def streams(n: int) -> None:
        for i in range(3):
            t0 = time.monotonic()
            events = list(client.chat.completions.create(model="chat",
                                                         messages=[{"role": "user", "content": f"s{n}.{i}"}],
                                                         max_tokens=2, stream=True))
            took.append(time.monotonic() - t0)
            assert events

    # Concurrent, so that the least-outstanding choice sends some to the idle-looking hung engine.
    threads = [threading.Thread(target=streams, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(took) == 12, took
    assert max(took) < 5, took  # the 600 s upstream_timeout would have been the limit before
    assert any(t >= 1 for t in took), took  # some did land on the hung engine first
    assert metric(server, "llmgw_upstream_retries_total", model="chat", reason="no_head") >= 1


def test_a_plain_request_whose_client_gave_up_frees_its_slot_at_once(tmp_path: Path, procs: list[Proc]) -> None:
    """Non-streamed requests whose client hung up kept their admission slot and engine request
    for the whole generation (600 s upstream_timeout against a hung engine)."""
    engine_proc, engine = start_sim_engine(tmp_path, "slow", "--served-model-name", "chat", "--ttft-ms", "50",
                                           "--itl-ms", "200", "--output-tokens", "50")
    procs.append(engine_proc)
    config = FAST_FLEET + f"""\
models:
  - name: chat
    replicas: 0
    admission: {{max_in_flight: 1, max_queue: 0}}
endpoints:
  - model: chat
    url: {engine}
"""
    server = Server(tmp_path, config)
    procs.append(server.start())

    def running() -> float:
        text = httpx.get(f"{engine}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running{"))

    def give_up() -> None:
        try:  # 50 tokens at 200 ms: ~10 s; the client waits 1 s
            httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": "chat", "messages": [{"role": "user", "content": "x"}]},
                       timeout=1.0)
        except httpx.TimeoutException:
            pass

    impatient = threading.Thread(target=give_up)
    impatient.start()
    wait_until(lambda: running() == 1, "the engine generating")
    impatient.join()
    gone_at = time.monotonic()
    wait_until(lambda: metric(server, "llmgw_requests_in_flight", model="chat") == 0, "the slot freed", deadline=3)
    wait_until(lambda: running() == 0, "the engine's request cancelled", deadline=3)
    assert time.monotonic() - gone_at < 3
    assert metric(server, "llmgw_requests_total", model="chat", code="499") == 1
    # The slot is usable at once.
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": "chat", "messages": [{"role": "user", "content": "y"}], "max_tokens": 1}, timeout=10)
    assert r.status_code == 200
    assert get_json(f"{server.url}/api/v1/endpoints")[0]["healthy"]
