"""`llmgw sim engine` as a real process, spoken to by the official `openai` client and raw HTTP.

The engine is started with `--port 0` and prints `llmgw-sim-engine listening on HOST:PORT`
on stdout once bound; these tests read the port from that line. Every wait is "until the
condition holds, up to a deadline", never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
DEADLINE = float(os.environ.get("LLMGW_TEST_DEADLINE", "20"))
MODEL = "llmgw/sim-model"


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    proc: EngineProc | None = None,
    deadline: float = DEADLINE,
) -> T:
    end = time.monotonic() + deadline
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if proc is not None and not proc.alive():
            raise AssertionError(
                f"engine exited ({proc.popen.returncode}) while waiting for {what}:\n{proc.output()}"
            )
        if time.monotonic() > end:
            raise AssertionError(
                f"timed out after {deadline}s waiting for {what}"
                + (f":\n{proc.output()}" if proc else "")
            )
        time.sleep(0.02)  # ok: poll interval of a deadline-bounded wait


class EngineProc:
    """One `python -m llmgw sim engine --port 0 ...`, its stdout and stderr in files."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.out_path = tmp / "engine.out"
        self.err_path = tmp / "engine.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llmgw",
                    "sim",
                    "engine",
                    "--port",
                    "0",
                    "--log-stats-interval",
                    "0",
                    *args,
                ],
                stdout=out,
                stderr=err,
                env={**os.environ, "NO_COLOR": "1"},
            )
        self.port = 0

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def output(self) -> str:
        return self.stdout() + self.err_path.read_text(errors="replace")

    def wait_listening(self) -> int:
        def bound() -> int | None:
            m = re.search(
                r"^llmgw-sim-engine listening on 127\.0\.0\.1:(\d+)$", self.stdout(), re.M
            )
            return int(m.group(1)) if m else None

        self.port = wait_for("the listening line", bound, self)
        return self.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        wait_for("/health 200", lambda: self.health() == 200, self)

    def health(self) -> int | None:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_exit(self, deadline: float = DEADLINE) -> int:
        try:
            return self.popen.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"engine still running after {deadline}s:\n{self.output()}"
            ) from None

    def terminate(self) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        return self.wait_exit()

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
            self.popen.wait()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., EngineProc]]:
    procs: list[EngineProc] = []

    def _start(*args: str, ready: bool = True) -> EngineProc:
        d = tmp_path / f"engine{len(procs)}"
        d.mkdir()
        p = EngineProc(d, *args)
        procs.append(p)
        p.wait_listening()
        if ready:
            p.wait_ready()
        return p

    yield _start
    for p in procs:
        p.kill()


@pytest.fixture
def engine(start: Callable[..., EngineProc]) -> Iterator[EngineProc]:
    p = start()
    yield p
    assert p.terminate() == 0, p.output()


def client(p: EngineProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="sim", max_retries=0, timeout=DEADLINE)


def metrics(p: EngineProc) -> dict[str, Any]:
    text = httpx.get(p.url + "/metrics", timeout=5).text
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("finished_reason"))] = s.value
            for key in ("model_name", "engine"):
                assert key in s.labels or fam.name == "vllm:cache_config_info", (fam.name, s.labels)
    return out


# ---- the OpenAI API with the official client ----------------------------------------------------


def test_chat_completion(engine: EngineProc) -> None:
    r = client(engine).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].message.content.split()) == 5
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_is_bounded_by_max_tokens_and_deterministic(engine: EngineProc) -> None:
    c = client(engine)
    a = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    b = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
    assert a.object == "text_completion" and a.usage is not None and a.usage.completion_tokens == 3
    assert a.choices[0].text == b.choices[0].text and len(a.choices[0].text.split()) == 3
    free = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=500)
    assert free.choices[0].finish_reason == "stop" and free.usage is not None
    assert free.usage.completion_tokens == 16  # --output-tokens default


def test_streaming_chat_with_usage(engine: EngineProc) -> None:
    stream = client(engine).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(content) == 6
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_without_usage(engine: EngineProc) -> None:
    chunks = list(
        client(engine).completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
    )
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]
    assert all(c.usage is None for c in chunks)


def test_embeddings_float_and_default_base64(engine: EngineProc) -> None:
    c = client(engine)
    one = c.embeddings.create(model=MODEL, input="hello", encoding_format="float")
    many = c.embeddings.create(model=MODEL, input=["hello", "world"])  # the client asks for base64
    assert len(one.data) == 1 and len(many.data) == 2
    assert one.data[0].embedding == pytest.approx(many.data[0].embedding, abs=1e-6)
    assert many.data[0].embedding != many.data[1].embedding
    assert abs(sum(v * v for v in one.data[0].embedding) - 1.0) < 1e-6
    assert many.usage.prompt_tokens == 4  # two tokens each: about four bytes a token


def test_models_list(engine: EngineProc) -> None:
    models = client(engine).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "vllm"


def test_wrong_model_is_404_not_found(engine: EngineProc) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(engine).chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.status_code == 404
    body = info.value.response.json()
    assert body["error"]["type"] == "NotFoundError" and "gpt-4" in body["error"]["message"]


def test_bad_json_is_400_in_openai_error_shape(engine: EngineProc) -> None:
    r = httpx.post(
        engine.url + "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
    with pytest.raises(openai.BadRequestError):
        client(engine).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0
        )


# ---- health, metrics, version ----------------------------------------------------------------------


def test_health_is_503_during_the_startup_delay_then_200(start: Callable[..., EngineProc]) -> None:
    p = start("--startup-delay", "1.5", ready=False)
    assert p.health() == 503
    r = httpx.post(p.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    wait_for("/health to turn 200", lambda: p.health() == 200, p)
    assert "Application startup complete." in p.output()
    assert p.terminate() == 0


def test_metrics_parse_and_count_requests(engine: EngineProc) -> None:
    before = metrics(engine)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert (name, None) in before, name
    client(engine).completions.create(model=MODEL, prompt="x", max_tokens=3)
    after = metrics(engine)
    assert (
        after[("vllm:request_success_total", "length")]
        == before[("vllm:request_success_total", "length")] + 1
    )
    assert (
        after[("vllm:generation_tokens_total", None)]
        == before[("vllm:generation_tokens_total", None)] + 3
    )
    assert after[("vllm:time_to_first_token_seconds_count", None)] == 1
    assert after[("vllm:inter_token_latency_seconds_count", None)] == 2
    r = httpx.get(engine.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert httpx.get(engine.url + "/version").json()["version"]


# ---- cancellation --------------------------------------------------------------------------------


def test_a_client_that_leaves_mid_stream_aborts_its_request(
    start: Callable[..., EngineProc],
) -> None:
    p = start("--itl-ms", "20")
    body = json.dumps(
        {"prompt": "x", "max_tokens": 10000, "ignore_eos": True, "stream": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", p.port), timeout=DEADLINE) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        got = b""
        while b"data: " not in got:
            data = s.recv(65536)
            assert data, "the engine closed the stream"
            got += data
        assert metrics(p)[("vllm:num_requests_running", None)] == 1
    wait_for(
        "num_requests_running back to 0",
        lambda: metrics(p)[("vllm:num_requests_running", None)] == 0,
        p,
    )
    m = metrics(p)
    assert m[("vllm:request_success_total", "abort")] == 1
    assert m[("vllm:kv_cache_usage_perc", None)] == 0
    assert m[("vllm:generation_tokens_total", None)] < 10000
    assert p.terminate() == 0


# ---- failure injection -----------------------------------------------------------------------------


def test_crash_after_n_requests_exits_non_zero(start: Callable[..., EngineProc]) -> None:
    p = start("--crash-after", "2")
    c = client(p)
    for _ in range(2):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1)
    rc = p.wait_exit()
    assert rc != 0
    assert "fatal error" in p.output()
    with pytest.raises(openai.APIConnectionError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_fail_startup_exits_non_zero_with_its_lines(tmp_path: Path) -> None:
    p = EngineProc(tmp_path, "--fail-startup", "--startup-delay", "0.2")
    rc = p.wait_exit()
    out = p.output()
    assert rc == 1, out
    assert "Starting to load model" in out
    assert "EngineCore failed to start." in out
    assert "llmgw: error: simulated engine failed to load" in out
    assert "Traceback" in out  # the engine's own (simulated) one, as an operator would see it
    assert "llmgw/cli" not in out  # but no traceback of llmgw itself


def test_error_rate_answers_500_or_503_in_error_shape(start: Callable[..., EngineProc]) -> None:
    p = start("--error-rate", "1", "--seed", "3")
    statuses = set()
    for _ in range(12):
        r = httpx.post(
            p.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        statuses.add(r.status_code)
        assert r.json()["error"]["code"] == r.status_code
    assert statuses == {500, 503}
    assert p.health() == 200  # health is not part of the injected failure


def test_hang_accepts_and_never_answers_and_still_stops_on_sigterm(
    start: Callable[..., EngineProc],
) -> None:
    p = start("--hang", ready=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(p.url + "/health", timeout=httpx.Timeout(5.0, read=0.5))
    assert p.alive()
    assert p.terminate() == 0


def test_sigterm_mid_stream_exits_zero_promptly(start: Callable[..., EngineProc]) -> None:
    p = start("--itl-ms", "20", "--shutdown-grace", "0.5")
    body = json.dumps(
        {"prompt": "x", "max_tokens": 10000, "ignore_eos": True, "stream": True}
    ).encode()
    with socket.create_connection(("127.0.0.1", p.port), timeout=DEADLINE) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        p.popen.send_signal(signal.SIGTERM)
        assert p.wait_exit() == 0
        assert time.monotonic() - t0 < 5
    assert "Received SIGTERM; shutting down." in p.output()


def test_sigint_stops_gracefully_too(start: Callable[..., EngineProc]) -> None:
    p = start()
    p.popen.send_signal(signal.SIGINT)
    assert p.wait_exit() == 0
    assert "Received SIGINT" in p.output()


# ---- fixed-response mode -------------------------------------------------------------------------


def test_fixed_mode_answers_at_once_in_shape(start: Callable[..., EngineProc]) -> None:
    p = start(
        "--fixed", "--fixed-chunks", "3", "--ttft-ms", "5000"
    )  # the latency model is not used
    c = client(p)
    t0 = time.monotonic()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert time.monotonic() - t0 < 2
    assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens == 3
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) == 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    comp = c.completions.create(model=MODEL, prompt="x")
    assert comp.choices[0].text
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="x")
    assert p.terminate() == 0


def test_address_in_use_is_one_clear_error(engine: EngineProc) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "llmgw", "sim", "engine", "--port", str(engine.port)],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert r.returncode == 1
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(f"llmgw: error: cannot listen on 127.0.0.1:{engine.port}")
    )
    assert "Traceback" not in r.stderr
