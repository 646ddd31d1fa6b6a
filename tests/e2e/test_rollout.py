"""Rolling replacement end to end: change a profile's args, `ctl reload`, and the replicas are
replaced one at a time under steady openai-client load, never fewer ready than desired (sampled
throughout) and no request failing; a profile that cannot start halts the rollout with the old
replicas serving, and `ctl models` and `ctl rollout status` say why.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tests.e2e.harness import Load, Proc, one_error_line, replicas
from tests.e2e.test_drain import KEY, VIEWER, ctl, fleet, pids, ready_on


class ReadySampler:
    """The model's ready count, sampled from /api/v1/models until stopped: the lowest seen."""

    def __init__(self, server: object, model: str) -> None:
        self.server, self.model = server, model
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                models = self.server.get("/api/v1/models")  # type: ignore[attr-defined]
            except Exception:  # a slow answer: the next sample
                continue
            self.samples.extend(m["ready"] for m in models if m["name"] == self.model)

    def __enter__(self) -> ReadySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_a_changed_profile_rolls_one_by_one_under_load_never_below_desired(tmp_path: Path, procs: list[Proc]) -> None:
    server, _ = fleet(tmp_path, procs)
    before = pids(server)
    server.config.write_text(server.config.read_text().replace('"--ttft-ms", "5"', '"--ttft-ms", "6"'))
    with Load(server.url, "chat", threads=3, api_key=KEY) as load, ReadySampler(server, "chat") as sampler:
        assert ctl(server, "reload").returncode == 0
        result = ctl(server, "rollout", "status", "chat", "--timeout", "120", token=VIEWER, timeout=150)
        assert result.returncode == 0, result.stdout + result.stderr
    assert load.failures == [], load.failures[:5]
    assert load.ok > 10
    assert len(sampler.samples) > 10 and min(sampler.samples) >= 2, sampler.samples  # maxUnavailable 0
    # Every replica was replaced: new ids, new engines; the rollout says done 2/2.
    after = ready_on(server, 2)
    assert after is not None and not set(after) & set(before), (before, after)
    assert "done 2/2 (args)" in result.stdout, result.stdout
    [model] = json.loads(ctl(server, "models", "-o", "json", token=VIEWER).stdout)
    assert model["rollout"]["state"] == "done" and model["rollout"]["replaced"] == 2
    # One by one: the event log has each move begin after the one before ended.
    events = json.loads(ctl(server, "events", "--model", "chat", "-o", "json", token=VIEWER).stdout)
    lines = [e["message"] for e in events if e["kind"] == "rollout"]
    assert any(line.startswith("rollout of chat begins: args changed; 2 of 2") for line in lines), lines
    moves = [line for line in lines if line.startswith("move of")]
    order = [("asked" if " asked: " in line else "done") for line in moves if " asked: " in line or " done: " in line]
    assert order == ["asked", "done", "asked", "done"], lines


def test_a_profile_that_cannot_start_halts_the_rollout_with_the_old_replicas_serving(
        tmp_path: Path, procs: list[Proc]) -> None:
    server, _ = fleet(tmp_path, procs)
    before = pids(server)
    server.config.write_text(server.config.read_text().replace('"--ttft-ms", "5"', '"--no-such-flag", "5"'))
    with Load(server.url, "chat", threads=2, api_key=KEY) as load:
        assert ctl(server, "reload").returncode == 0
        result = ctl(server, "rollout", "status", "chat", "--timeout", "120", token=VIEWER, timeout=150)
    assert result.returncode == 1, result.stdout + result.stderr
    line = one_error_line(result)
    assert "rollout of chat halted" in line and "failed" in line and "old replicas serve on" in line, line
    assert load.failures == [], load.failures[:5]
    # The old replicas serve on, the same engines; nothing else is tried.
    assert ready_on(server, 2) is not None and pids(server) == before
    assert len(replicas(server)) == 2
    models_out = ctl(server, "models", token=VIEWER).stdout
    assert "halted:" in models_out, models_out
    [model] = json.loads(ctl(server, "models", "-o", "json", token=VIEWER).stdout)
    assert model["rollout"]["state"] == "halted" and "0 of 2 replaced" in model["rollout"]["note"], model
    events = json.loads(ctl(server, "events", "--model", "chat", "-o", "json", token=VIEWER).stdout)
    halted = [e for e in events if e["kind"] == "rollout" and "failed" in e["message"]]
    assert halted and any("no-such-flag" in "\n".join(e.get("detail") or []) for e in halted), halted
