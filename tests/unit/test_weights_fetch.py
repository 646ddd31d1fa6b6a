"""The agent's weight fetcher (llmgw.agent.weights) against the simulated file server on real
loopback sockets: what the server saw (Range, If-Range, how many GETs) is asserted, not assumed."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from llmgw.agent.engines import LaunchError
from llmgw.agent.fetch import DISK_MARGIN, partial_paths
from llmgw.agent.weights import Weights, WeightsPlan
from llmgw.catalog.sources import SourceKind
from llmgw.sim.fileserver import FileServerHandle, FileServerOptions, serve_files
from llmgw.wire import messages as m

DEADLINE = 20.0  # seconds any one test may take waiting on a condition
SIZE = 4 * 1024 * 1024 + 123


@asynccontextmanager
async def file_server(root: Path, **options: object) -> AsyncIterator[FileServerHandle]:
    async with trio.open_nursery() as nursery:
        handle: FileServerHandle = await nursery.start(
            partial(serve_files, FileServerOptions(root=str(root), **options)))  # type: ignore[arg-type]
        yield handle
        nursery.cancel_scope.cancel()


def make_file(root: Path, name: str = "model.safetensors", size: int = SIZE) -> bytes:
    data = random.Random(size).randbytes(size)
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(data)
    return data


def make_sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def content(path: str | Path) -> bytes:
    return Path(path).read_bytes()


def exists(*paths: str | Path) -> bool:
    return any(Path(p).exists() for p in paths)


def size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def put(path: str | Path, data: bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)


def spec(source: str, shard: str = "s1", sha256: str = "") -> m.ShardSpec:
    return m.ShardSpec(shard_id=shard, replica_id="r1", model="m", profile="p", engine="sim", source=source,
                       sha256=sha256)


class Sent:
    def __init__(self) -> None:
        self.messages: list[m.Progress] = []
        self.moving = trio.Event()  # set at the first report with bytes in it

    def __call__(self, msg: msgspec.Struct) -> None:
        assert isinstance(msg, m.Progress)
        self.messages.append(msg)
        if msg.done_bytes:
            self.moving.set()


def weights(tmp_path: Path, **kw: object) -> Weights:
    kw.setdefault("rng", random.Random(1))
    kw.setdefault("retry_initial", 0.01)
    kw.setdefault("report_interval", 0.2)
    return Weights(tmp_path / "work", tmp_path / "cache", **kw)  # type: ignore[arg-type]


async def fetch(w: Weights, plan: WeightsPlan, sent: Sent, shard: str = "s1", within: float = DEADLINE) -> None:
    """One shard's wait, in a nursery of its own (as the supervisor's); its LaunchError unwrapped."""
    failed: LaunchError | None = None
    async with trio.open_nursery() as nursery:
        try:
            await w.ensure(shard, plan, trio.current_time() + within, nursery, sent)
        except LaunchError as exc:
            failed = exc
    if failed is not None:
        raise failed


async def test_a_cut_download_resumes_from_its_offset_with_range_and_if_range(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    cut = int(SIZE * 0.4)
    async with file_server(tmp_path / "srv", drop_after=cut) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        await fetch(w, plan, Sent())
        seen = srv.server.seen
    assert [s.status for s in seen] == [200, 206]
    assert seen[0].range is None
    assert seen[1].range == f"bytes={cut}-"  # resumed where the cut left it, not from 0
    assert seen[1].if_range is not None and seen[1].if_range.startswith('"')  # the ETag the first answer gave
    assert content(plan.target) == data
    assert not exists(*partial_paths(Path(plan.target)))


async def test_resume_validates_with_last_modified_when_there_is_no_etag(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", drop_after=SIZE // 2, validator="last-modified") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        await fetch(w, plan, Sent())
        seen = srv.server.seen
    assert seen[1].range == f"bytes={SIZE // 2}-"
    assert seen[1].if_range is not None and seen[1].if_range.endswith("GMT")
    assert content(plan.target) == data


async def test_a_server_that_ignores_range_restarts_the_file_cleanly(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", drop_after=SIZE // 3, ignore_range=True) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        await fetch(w, plan, Sent())
        seen = srv.server.seen
    assert seen[1].range == f"bytes={SIZE // 3}-" and seen[1].status == 200  # asked to resume, got it all
    assert content(plan.target) == data  # not the first third twice


async def test_a_partial_file_left_by_an_earlier_agent_is_resumed(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", rate=SIZE) as srv:
        w = weights(tmp_path, report_interval=0.05)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        first = Sent()
        # The "agent" stops once bytes are in (not after a fixed 0.3 s, which a loaded machine
        # could spend before the first byte); the partial file stays.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch, w, plan, first)
            with trio.fail_after(30):
                await first.moving.wait()
            nursery.cancel_scope.cancel()
        assert not exists(plan.target)
        w2 = weights(tmp_path)
        await fetch(w2, plan, Sent())
        seen = srv.server.seen
    assert content(plan.target) == data
    assert all(s.range is None or s.if_range for s in seen)
    assert seen[-1].status == 206


async def test_no_content_length_reports_bytes_without_a_total(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv", size=1_000_000)
    async with file_server(tmp_path / "srv", no_length=True, rate=4_000_000) as srv:
        w = weights(tmp_path, report_interval=0.05)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        sent = Sent()
        await fetch(w, plan, sent)
    assert content(plan.target) == data
    assert len(sent.messages) >= 3
    assert all(p.total_bytes is None for p in sent.messages)
    done = [p.done_bytes for p in sent.messages]
    assert done == sorted(done) and done[-1] == len(data) and done[0] < len(data)
    assert all(p.source == plan.url and p.shard_id == "s1" for p in sent.messages)


async def test_progress_carries_the_total_and_a_rate_and_is_at_most_once_per_interval(tmp_path: Path) -> None:
    make_file(tmp_path / "srv", size=2_000_000)
    async with file_server(tmp_path / "srv", rate=4_000_000) as srv:
        w = weights(tmp_path, report_interval=0.1)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        sent = Sent()
        times: list[float] = []

        def record(msg: msgspec.Struct) -> None:
            times.append(trio.current_time())
            sent(msg)

        async with trio.open_nursery() as nursery:
            await w.ensure("s1", plan, trio.current_time() + DEADLINE, nursery, record)
    assert all(p.total_bytes == 2_000_000 for p in sent.messages[1:])
    assert any(p.rate > 0 for p in sent.messages)
    gaps = [b - a for a, b in itertools.pairwise(times[:-1])]  # the last one goes out at the end, at once
    assert min(gaps) >= 0.1 * 0.9
    assert sent.messages[-1].done_bytes == 2_000_000 and sent.messages[-1].fetched == 2_000_000


async def test_eight_shards_starting_together_make_one_get(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", rate=SIZE * 4) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        sent = Sent()
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(partial(w.ensure, f"s{i}", plan, trio.current_time() + DEADLINE, nursery, sent))
        gets = [s for s in srv.server.seen if s.method == "GET"]
    assert len(gets) == 1
    assert w.downloads == 1
    assert content(plan.target) == data
    assert {p.shard_id for p in sent.messages} == {f"s{i}" for i in range(8)}  # every waiting shard hears of it


async def test_a_sha256_mismatch_fails_and_leaves_no_file_under_the_final_name(tmp_path: Path) -> None:
    make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors", sha256="0" * 64))
        sent = Sent()
        with pytest.raises(LaunchError, match=r"sha256 is [0-9a-f]{64}, the profile says 0{64}"):
            await fetch(w, plan, sent)
    target = Path(plan.target)
    assert not exists(target, *partial_paths(target))
    assert [p.failure for p in sent.messages if p.failure] == ["checksum"]


async def test_a_matching_sha256_is_verified_across_a_resume(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", drop_after=SIZE // 2) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors", sha256=hashlib.sha256(data).hexdigest().upper()))
        await fetch(w, plan, Sent())
    assert content(plan.target) == data


async def test_the_final_path_never_holds_a_partial_file(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", rate=SIZE * 2, drop_after=SIZE // 2) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        target = Path(plan.target)
        partial_file = partial_paths(target)[0]
        observed: list[int] = []
        grew = False

        seen = trio.Event()

        async def watch() -> None:
            nonlocal grew
            while True:
                size = size_of(target)
                if size is not None:
                    observed.append(size)
                    seen.set()
                elif size_of(partial_file):
                    grew = True
                await trio.sleep(0.002)  # ok: the watcher's poll interval

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await w.ensure("s1", plan, trio.current_time() + DEADLINE, nursery, Sent())
            with trio.fail_after(5):
                await seen.wait()  # the watcher has seen the finished file at least once
            nursery.cancel_scope.cancel()
    assert grew  # the check ran while bytes were arriving
    assert observed and set(observed) == {len(data)}  # whenever the name existed, the file was whole


@pytest.mark.parametrize(("name", "status"), [("missing.bin", 404), ("adir", 403)])
async def test_an_http_error_fails_at_once_with_the_status(tmp_path: Path, name: str, status: int) -> None:
    make_file(tmp_path / "srv")
    (tmp_path / "srv" / "adir").mkdir()
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/{name}"))
        sent = Sent()
        with pytest.raises(LaunchError, match=f"HTTP {status}"):
            await fetch(w, plan, sent)
        assert len(srv.server.seen) == 1  # not retried
    assert not exists(plan.target)
    assert [p.failure for p in sent.messages if p.failure] == ["http"]


async def test_a_server_whose_content_length_lies_fails_with_one_line(tmp_path: Path) -> None:
    make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", extra_length=1000) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        with pytest.raises(LaunchError, match="shorter than the server announced") as info:
            await fetch(w, plan, Sent())
    assert "\n" not in str(info.value)
    assert not exists(plan.target)


async def test_no_room_for_the_announced_size_fails_before_writing(tmp_path: Path) -> None:
    make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path, disk_free=lambda _: 1000)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        with pytest.raises(LaunchError, match=f"{SIZE} bytes to fetch, 1000 free"):
            await fetch(w, plan, Sent())
    assert not exists(plan.target)
    assert not exists(partial_paths(Path(plan.target))[0])


async def test_weights_already_in_the_cache_are_not_fetched(tmp_path: Path) -> None:
    make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        put(plan.target, b"already here")
        sent = Sent()
        await fetch(w, plan, sent)
        assert srv.server.seen == []
    assert sent.messages == [] and w.downloads == 0


async def test_a_download_that_outlasts_its_deadline_fails_though_bytes_arrive(tmp_path: Path) -> None:
    make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", rate=SIZE // 4) as srv:
        w = weights(tmp_path, report_interval=0.1)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        sent = Sent()
        with pytest.raises(LaunchError, match="not fetched within the start_timeout"):
            await fetch(w, plan, sent, within=0.6)
    assert [p.failure for p in sent.messages if p.failure] == ["timeout"]
    assert any(p.done_bytes > 0 for p in sent.messages)  # bytes were arriving all along
    assert not exists(plan.target)


async def test_a_download_nobody_waits_on_is_cancelled_and_resumed_later(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", rate=SIZE // 2) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        with trio.move_on_after(0.5):
            await fetch(w, plan, Sent())
        with trio.fail_after(DEADLINE):
            for job in list(w.jobs.values()):  # the worker thread saw the stop and returned
                await job.done.wait()
        kept = size_of(partial_paths(Path(plan.target))[0]) or 0
        assert 0 < kept < SIZE
        await fetch(w, plan, Sent())
        seen = srv.server.seen
    assert seen[-1].range == f"bytes={kept}-"
    assert content(plan.target) == data


# -- plan: what a source means on this node ---------------------------------------------------------------


def test_a_model_id_goes_to_the_engine_untouched(tmp_path: Path) -> None:
    plan = weights(tmp_path).plan(spec("Qwen/Qwen2.5-7B-Instruct"))
    assert plan.kind is SourceKind.MODEL_ID and plan.engine_source == "Qwen/Qwen2.5-7B-Instruct" and not plan.url


def test_a_path_must_exist_on_the_node(tmp_path: Path) -> None:
    w = weights(tmp_path)
    with pytest.raises(LaunchError, match="no such file or directory on this node"):
        w.plan(spec(str(tmp_path / "nope")))
    (tmp_path / "work" / "local").mkdir(parents=True)
    assert w.plan(spec("./local")).engine_source == "./local"  # relative to the work dir, the engine's cwd
    with pytest.raises(LaunchError, match="relative to the agent's work dir"):
        w.plan(spec("./elsewhere"))
    model_dir = tmp_path / "models" / "x"
    model_dir.mkdir(parents=True)
    assert w.plan(spec(str(model_dir))).engine_source == str(model_dir)  # a directory of weights is fine


@pytest.mark.parametrize(("source", "message"), [
    ("http:///model.bin", "has no host"),
    ("https://host.example/", "names no file"),
    ("s3://bucket/model.bin", "scheme 's3' is not supported"),
])
def test_a_bad_url_fails_before_launch_with_one_line(tmp_path: Path, source: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        weights(tmp_path).plan(spec(source))


def test_a_url_is_given_to_the_engine_as_the_local_path(tmp_path: Path) -> None:
    plan = weights(tmp_path).plan(spec("https://mirror.example/org/model/model.safetensors?sig=secret"))
    assert plan.kind is SourceKind.URL
    assert plan.engine_source == plan.target
    assert plan.target.startswith(str(tmp_path / "cache")) and plan.target.endswith("/model.safetensors")
    assert plan.for_engine(spec(plan.url)).source == plan.target


def test_a_cache_entry_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    w = weights(tmp_path)
    plan = w.plan(spec("http://h/model.bin"))
    os.makedirs(plan.target)
    with pytest.raises(LaunchError, match="is a directory"):
        w.plan(spec("http://h/model.bin"))


DISK_FULL_CHILD = """
import resource, signal, sys
from pathlib import Path
from llmgw.agent.fetch import FetchError, Transfer, download
from llmgw.agent.weights import default_client
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))  # the disk "fills" at 1 MB
try:
    with default_client() as client:
        download(client, sys.argv[1], sys.argv[1], Path(sys.argv[2]), "", Transfer())
except FetchError as exc:
    print(exc.reason.value, exc)
"""


async def test_a_disk_that_fills_mid_download_leaves_nothing_under_the_final_name(tmp_path: Path) -> None:
    import sys

    make_file(tmp_path / "srv")
    target = tmp_path / "cache" / "x" / "model.safetensors"
    async with file_server(tmp_path / "srv") as srv:
        result = await trio.run_process([sys.executable, "-c", DISK_FULL_CHILD, f"{srv.url}/model.safetensors",
                                         str(target)],
                                        capture_stdout=True, capture_stderr=True, check=False)
    out = result.stdout.decode()
    assert out.startswith("disk "), (out, result.stderr.decode()[-2000:])
    assert "after" in out and "removed the partial file" in out
    assert not exists(target, *partial_paths(target))


# -- the catalog refuses what no node could use, when the config loads --------------------------------------


@pytest.mark.parametrize(("model", "message"), [
    ("{name: m, source: 's3://bucket/w.bin', profiles: [{engine: sim}]}", "scheme 's3' is not supported"),
    ("{name: m, source: 'http:///w.bin', profiles: [{engine: sim}]}", "the URL has no host"),
    ("{name: m, profiles: [{engine: sim, source: 'https://h/dir/'}]}", "names no file"),
    ("{name: m, profiles: [{engine: sim, sha256: abc}]}", "sha256 'abc' is not 64 hex digits"),
    ("{name: m, source: Org/Model, profiles: [{engine: sim, sha256: " + "a" * 64 + "}]}", "only for an http(s) source"),
])
def test_the_catalog_refuses_a_source_no_node_could_use_in_one_line(model: str, message: str) -> None:
    from llmgw.catalog import ConfigError, ServerConfig, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(f"models:\n  - {model}\n", ServerConfig, "server.yaml")
    text = str(info.value)
    assert message in text and text.startswith("server.yaml:2 models[0]") and "\n" not in text


def test_a_profile_source_overrides_the_models_and_travels_with_its_sha256() -> None:
    from llmgw.catalog import ServerConfig, parse_config
    from llmgw.server.reconcile import shard_spec

    digest = "b" * 64
    cfg = parse_config(f"models:\n  - {{name: m, source: Org/M, profiles: [{{name: a, engine: sim}}, "
                       f"{{name: b, engine: sim, source: 'https://mirror/m.gguf', sha256: {digest}}}]}}\n",
                       ServerConfig, "server.yaml")
    model = cfg.models[0]
    a = shard_spec(model, model.profiles[0], "r", "s", [0], 20000)
    b = shard_spec(model, model.profiles[1], "r", "s", [0], 20000)
    assert (a.source, a.sha256) == ("Org/M", "")
    assert (b.source, b.sha256) == ("https://mirror/m.gguf", digest)


async def test_the_event_loop_stays_free_while_a_fast_download_runs(tmp_path: Path) -> None:
    """The download is the worker thread's: the loop (heartbeats, health checks) keeps ticking."""
    size = 64 * 1024 * 1024
    make_sparse(tmp_path / "srv" / "big.bin", size)
    gaps: list[float] = []
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/big.bin"))

        async def tick() -> None:
            last = trio.current_time()
            while True:
                await trio.sleep(0.005)  # ok: the probe's own interval
                now = trio.current_time()
                gaps.append(now - last)
                last = now

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            began = trio.current_time()
            await w.ensure("s1", plan, trio.current_time() + DEADLINE, nursery, Sent())
            took = trio.current_time() - began
            nursery.cancel_scope.cancel()
    assert size_of(Path(plan.target)) == size
    assert len(gaps) > 5
    # A download on the loop would show one gap about as long as the download; a loaded machine
    # stretches both the download and the scheduler's gaps, so the bar scales with the download.
    assert max(gaps) < max(0.25, 0.5 * took), (took, sorted(gaps)[-5:])


async def test_a_shard_that_comes_as_the_last_one_leaves_gets_the_whole_file(tmp_path: Path) -> None:
    """A Stop and a Start together (a restart): the new shard must not take the cancelled
    download for a finished one; it begins it again, from the partial file."""
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", rate=SIZE * 2) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        sent = Sent()
        async with trio.open_nursery() as nursery:
            first = trio.CancelScope()

            async def leaver() -> None:
                with first:
                    await w.ensure("old", plan, trio.current_time() + DEADLINE, nursery, sent)

            nursery.start_soon(leaver)
            with trio.fail_after(DEADLINE):
                await sent.moving.wait()
            first.cancel()
            await trio.testing.wait_all_tasks_blocked()  # the old shard has left: the download is cancelled
            [job] = w.jobs.values()
            assert job.scope.cancel_called and not job.done.is_set()  # ... and still winding down
            await w.ensure("new", plan, trio.current_time() + DEADLINE, nursery, sent)
        seen = srv.server.seen
    assert content(plan.target) == data
    assert len(seen) == 2 and seen[1].status == 206


# -- redirects (issue 40, finding 4): the source's host or the catalog's list, bounded, never inward ----------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_redirect_to_a_metadata_service_on_another_host_or_port_is_refused_and_nothing_is_saved(
        tmp_path: Path, host: str) -> None:
    """The issue's attack: the source's server answers 302 to the node's metadata service (here
    another port on loopback, and another name for it): refused, never fetched, nothing saved."""
    put(tmp_path / "meta" / "latest" / "meta-data" / "iam", b'{"AccessKeyId": "AKIA..."}')
    (tmp_path / "srv").mkdir()
    async with file_server(tmp_path / "meta") as meta:
        location = f"http://{host}:{meta.port}/latest/meta-data/iam"
        async with file_server(tmp_path / "srv", redirects={"/model.safetensors": location}) as srv:
            w = weights(tmp_path)
            plan = w.plan(spec(f"{srv.url}/model.safetensors"))
            sent = Sent()
            with pytest.raises(LaunchError) as info:
                await fetch(w, plan, sent)
            assert [s.status for s in srv.server.seen] == [302]  # asked once: a refusal is not retried
        assert meta.server.seen == []  # the metadata service was never asked
    text = str(info.value)
    assert text == (f"weights {srv.url}/model.safetensors: redirect to {location} refused: {host}:{meta.port} is not "
                    f"the source's host (127.0.0.1:{srv.port}) nor in the catalog's allow_redirect_hosts")
    target = Path(plan.target)
    assert not exists(target, *partial_paths(target))
    assert [p.failure for p in sent.messages if p.failure] == ["redirect"]


async def test_a_same_host_redirect_is_followed_and_a_cut_download_resumes_through_it(tmp_path: Path) -> None:
    """The legitimate use beside the attack: a mirror that hands the file off on its own host
    (relative and absolute Location) still works, and the resume goes through the redirect."""
    data = make_file(tmp_path / "srv" / "store")
    async with file_server(tmp_path / "srv", drop_after=SIZE // 3) as srv:
        srv.server.options.redirects = {"/model.safetensors": "/hop", "/hop": f"{srv.url}/store/model.safetensors"}
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        await fetch(w, plan, Sent())
        seen = srv.server.seen
    assert [(s.path, s.status) for s in seen] == [("/model.safetensors", 302), ("/hop", 302),
                                                  ("/store/model.safetensors", 200),
                                                  ("/model.safetensors", 302), ("/hop", 302),
                                                  ("/store/model.safetensors", 206)]
    assert seen[-1].range == f"bytes={SIZE // 3}-" and seen[-1].if_range
    assert content(plan.target) == data


@pytest.mark.parametrize(("hops", "ok"), [(5, True), (6, False)])
async def test_redirects_are_followed_for_at_most_five_hops(tmp_path: Path, hops: int, ok: bool) -> None:
    data = make_file(tmp_path / "srv")
    chain = {f"/r{i}": f"/r{i + 1}" for i in range(hops - 1)} | {f"/r{hops - 1}": "/model.safetensors"}
    async with file_server(tmp_path / "srv", redirects=chain) as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/r0"))
        if ok:
            await fetch(w, plan, Sent())
            assert content(plan.target) == data
        else:
            with pytest.raises(LaunchError, match=f"refused to follow more than 5 redirects "
                                                  f"\\(the last to {srv.url}/model.safetensors\\)"):
                await fetch(w, plan, Sent())
            assert not exists(plan.target)
        assert len(srv.server.seen) == hops + ok  # no request after the refusal


async def test_a_host_the_catalog_allows_is_followed_unless_it_resolves_to_an_internal_address(tmp_path: Path) -> None:
    """allow_redirect_hosts lets a source hand off to its CDN; the CDN's name resolving to the
    metadata address (a DNS answer the source's owner controls) is still refused."""
    data = make_file(tmp_path / "cdn")
    (tmp_path / "srv").mkdir()
    async with file_server(tmp_path / "cdn") as cdn:
        allowed = f"localhost:{cdn.port}"
        location = f"http://{allowed}/model.safetensors"
        async with file_server(tmp_path / "srv", redirects={"/model.safetensors": location}) as srv:
            source = spec(f"{srv.url}/model.safetensors")
            source.allow_redirect_hosts.append(allowed)
            w = weights(tmp_path, resolve=lambda host, port: ["127.0.0.1"])  # localhost, whatever /etc/hosts says
            plan = w.plan(source)
            await fetch(w, plan, Sent())
            assert content(plan.target) == data and [s.status for s in cdn.server.seen] == [200]

            os.unlink(plan.target)
            poisoned = weights(tmp_path, resolve=lambda host, port: ["169.254.169.254"] if host == "localhost"
                               else ["127.0.0.1"])
            with pytest.raises(LaunchError, match=f"redirect to {location} refused: localhost resolves to "
                                                  "169.254.169.254, a metadata address"):
                await fetch(poisoned, poisoned.plan(source), Sent())
            assert len(cdn.server.seen) == 1  # not asked again


# -- the cache (issue 40, finding 8): no link followed, 0700/0600, no credentials at rest ------------------


@pytest.mark.parametrize("link", ["entry", "target", ".partial", ".partial.json"])
async def test_a_symbolic_link_in_the_cache_is_refused_and_never_written_through(tmp_path: Path, link: str) -> None:
    """Whoever can write into a shared model_cache plants a link: the fetcher neither writes
    through it (a victim file truncated or appended to) nor hands it to the engine as weights."""
    make_file(tmp_path / "srv")
    victim = tmp_path / "victim"
    put(victim / "secret", b"not weights")
    async with file_server(tmp_path / "srv") as srv:
        w = weights(tmp_path)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        target = Path(plan.target)
        partial_file, meta = partial_paths(target)
        if link == "entry":
            target.parent.parent.mkdir(parents=True)
            target.parent.symlink_to(victim, target_is_directory=True)
            planted = target.parent
        else:
            target.parent.mkdir(parents=True)
            planted = {"target": target, ".partial": partial_file, ".partial.json": meta}[link]
            planted.symlink_to(victim / "secret")
        with pytest.raises(LaunchError,
                           match=f"{planted} in the model cache is a symbolic link; the fetcher follows none"):
            await fetch(w, plan, Sent())
        with pytest.raises(LaunchError, match="is a symbolic link"):
            w.plan(spec(plan.url))  # refused before launch as well, once the link is there
    assert sorted(p.name for p in victim.iterdir()) == ["secret"]
    assert (victim / "secret").read_bytes() == b"not weights"


async def test_cache_dirs_are_0700_files_0600_and_the_partial_record_holds_no_credentials(tmp_path: Path) -> None:
    data = make_file(tmp_path / "srv")
    async with file_server(tmp_path / "srv", rate=SIZE) as srv:
        source = f"http://alice:s3cret@127.0.0.1:{srv.port}/model.safetensors?X-Amz-Signature=topsecret"
        w = weights(tmp_path)
        plan = w.plan(spec(source))
        target = Path(plan.target)
        partial_file, meta = partial_paths(target)
        sent = Sent()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(fetch, w, plan, sent))
                with trio.fail_after(DEADLINE):
                    await sent.moving.wait()
                scope.cancel()  # the agent stops mid-download: the partial file and its record stay
        with trio.fail_after(DEADLINE):
            for job in list(w.jobs.values()):
                await job.done.wait()
        record = meta.read_bytes()
        assert b"s3cret" not in record and b"alice" not in record and b"topsecret" not in record
        assert json.loads(record)["source"] == f"http://127.0.0.1:{srv.port}/model.safetensors"
        modes = {p: mode_of(p) for p in (tmp_path / "cache", target.parent, partial_file, meta)}
        assert modes == {tmp_path / "cache": 0o700, target.parent: 0o700, partial_file: 0o600, meta: 0o600}
        kept = size_of(partial_file)
        await fetch(weights(tmp_path), plan, Sent())  # the record, without the URL, still matches a resume
        assert srv.server.seen[-1].status == 206 and srv.server.seen[-1].range == f"bytes={kept}-"
    assert content(target) == data
    assert mode_of(target) == 0o600


# -- free space without a length (issue 40, finding 9) ---------------------------------------------------------


async def test_a_download_without_a_length_that_outgrows_the_free_space_stops_with_the_reason(tmp_path: Path) -> None:
    """No Content-Length, so no size to check up front: the free space is checked as the file
    grows (every space_step bytes), and the download stops before the disk's margin is eaten."""
    make_file(tmp_path / "srv")
    step = 1 << 20
    probes: list[int] = []

    def disk_free(directory: Path) -> int:  # a disk with room for 3.5 MiB beyond the margin
        written = sum(p.stat().st_size for p in directory.glob("*.partial"))
        probes.append(written)
        return DISK_MARGIN + 3 * step + step // 2 - written

    async with file_server(tmp_path / "srv", no_length=True) as srv:
        w = weights(tmp_path, disk_free=disk_free, space_step=step)
        plan = w.plan(spec(f"{srv.url}/model.safetensors"))
        sent = Sent()
        with pytest.raises(LaunchError) as info:
            await fetch(w, plan, sent)
        assert len(srv.server.seen) == 1  # not retried: the disk will not have grown
    text = str(info.value)
    assert re.fullmatch(r"weights \S+: the server sent no Content-Length and the disk is filling: \d+ free in \S+ "
                        r"after "
                        r"\d+ bytes \(keeping 64 MiB spare\); stopped and removed the partial file", text), text
    assert 3 <= len(probes) <= 1 + SIZE // step  # bounded steps, not a probe per read
    target = Path(plan.target)
    assert not exists(target, *partial_paths(target))
    assert [p.failure for p in sent.messages if p.failure] == ["disk"]
