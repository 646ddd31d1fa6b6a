"""The sha256 check comes before the rename into place (issue 37): a scan of the cache entry
between every step the fetcher takes on it (each rename and each removal) never finds a file
under the model's name whose bytes are not the ones the profile names. The end state alone
cannot tell: renaming first and removing the file after a mismatch ends the same way, with a
window in which an engine starting from the cache loads a bad file, the failure the weights
design exists to prevent."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from llmgw.agent import fetch as fetch_module
from llmgw.agent.engines import LaunchError
from tests.unit.test_weights_fetch import SIZE, Sent, fetch, file_server, make_file, spec, weights


class Scans:
    """Wraps the cache entry's rename and unlink: the target's state before and after each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.target: Path | None = None
        self.seen: list[tuple[str, str | None]] = []  # (step, sha256 of the target or None)
        real_publish, real_unlink = fetch_module._Entry.publish, fetch_module._Entry.unlink

        def publish(entry: fetch_module._Entry, tmp: str, name: str) -> None:
            self.scan(f"before rename {tmp} -> {name}")
            real_publish(entry, tmp, name)
            self.scan(f"after rename {tmp} -> {name}")

        def unlink(entry: fetch_module._Entry, name: str) -> None:
            self.scan(f"before unlink {name}")
            real_unlink(entry, name)
            self.scan(f"after unlink {name}")

        monkeypatch.setattr(fetch_module._Entry, "publish", publish)
        monkeypatch.setattr(fetch_module._Entry, "unlink", unlink)

    def scan(self, step: str) -> None:
        assert self.target is not None
        try:
            digest: str | None = hashlib.sha256(self.target.read_bytes()).hexdigest()
        except FileNotFoundError:
            digest = None
        self.seen.append((step, digest))


async def test_a_mismatch_never_shows_a_file_under_the_models_name(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    scans = Scans(monkeypatch)
    make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors", sha256="0" * 64))
        scans.target = Path(plan.target)
        with pytest.raises(LaunchError, match="sha256 is"):
            await fetch(w, plan, Sent())
    assert scans.seen, "the fetcher took no step the scan could see"
    assert [s for s in scans.seen if s[1] is not None] == [], scans.seen
    assert not any(step.startswith("before rename") for step, _ in scans.seen)


async def test_a_match_is_renamed_once_whole_and_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scans = Scans(monkeypatch)
    data = make_file(tmp_path / "srv", size=SIZE // 4)
    digest = hashlib.sha256(data).hexdigest()
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors", sha256=digest))
        scans.target = Path(plan.target)
        await fetch(w, plan, Sent())
    renames = [i for i, (step, _) in enumerate(scans.seen) if step.startswith("after rename")]
    assert len(renames) == 1
    assert {d for _, d in scans.seen[:renames[0]]} == {None}  # nothing there before it
    assert {d for _, d in scans.seen[renames[0]:]} == {digest}  # and only the whole file after
