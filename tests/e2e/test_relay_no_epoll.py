"""A real `llmgw server` process on a platform without epoll, simulated: a sitecustomize removes
select's epoll names while llmgw's relay hub is imported (trio, imported first, keeps its own
backend), then puts them back for trio. Streams then take the portable path (each in its own
task) through the real gateway, and arrive whole, as through the hub."""

from __future__ import annotations

import os
from pathlib import Path

import openai

from tests.e2e.harness import FAST_FLEET, Proc, Server, start_sim_engine

NO_EPOLL_SITE = """\
import select, sys
import trio
saved = {name: getattr(select, name) for name in dir(select) if name.lower().startswith("epoll")}
for name in saved:
    delattr(select, name)
import llmgw.web.relayhub
from llmgw.web.relay import RelayHub
for name, value in saved.items():
    setattr(select, name, value)
print(f"no-epoll simulation: relay hub splices={RelayHub().splices}", file=sys.stderr, flush=True)
"""


def test_streams_through_a_server_without_epoll_arrive_whole(tmp_path: Path, procs: list[Proc], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine, engine_url = start_sim_engine(tmp_path, "engine", "--served-model-name", "chat", "--ttft-ms", "1",
                                          "--itl-ms", "1",
                                          "--output-tokens", "30")
    procs.append(engine)
    site = tmp_path / "no-epoll-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_EPOLL_SITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p))
    server = Server(tmp_path, FAST_FLEET + f"endpoints:\n  - model: chat\n    url: {engine_url}\n")
    procs.append(server.start())
    assert "no-epoll simulation: relay hub splices=False" in server.proc.log()  # type: ignore[union-attr]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
    whole = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=30)
    for _ in range(3):  # keep-alive: several streams on one client connection
        pieces = [event.choices[0].delta.content for event in client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=30, stream=True)
            if event.choices and event.choices[0].delta.content]
        assert len(pieces) >= 2 and "".join(pieces) == whole.choices[0].message.content
