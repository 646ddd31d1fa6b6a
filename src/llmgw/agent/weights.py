"""Weights before launch (issue 12): check a path source, fetch a URL source into the model
cache, and report the download while the shard waits on it.

- **Single-flight.** One download per (URL, sha256): eight shards starting together produce
  one GET, and all wait on it. A download nobody waits on any more (every shard stopped) is
  cancelled; its partial file stays for the next one to resume.
- **Off the event loop.** Each attempt runs in a worker thread (llmgw.agent.fetch) that
  writes, hashes and fsyncs; the loop only reads its counters once a second.
- **Retries.** An attempt that fails for a reason another may not (a reset, a 5xx, a cut
  body) is retried after a jittered backoff, resuming where it stopped; after MAX_FAILURES in a
  row without a byte of progress the shard fails with the last reason. A 403, 404, a sha256
  mismatch or a full disk fail at once.
- **Progress** goes out on its own message (m.Progress), at most once a second per source
  (and once more when the download ends: its last bytes, or why it failed), one per waiting
  shard: never as a state change, which would reset the server's view of how
  long the shard has been starting. Its `total_bytes` is None when the server sent no length.
- **start_timeout** bounds the download too: a shard still downloading when it runs out
  fails, however many bytes keep arriving.
"""

from __future__ import annotations

import logging
import random
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import trio

from llmgw.agent.backoff import Backoff
from llmgw.agent.engines import LaunchError
from llmgw.agent.fetch import (
    SPACE_STEP,
    FetchError,
    Reason,
    Resolve,
    Stopped,
    Transfer,
    cache_problem,
    download,
    resolve_host,
)
from llmgw.catalog.redirects import allowed_host_problem
from llmgw.catalog.sources import (
    SourceError,
    SourceKind,
    cache_name,
    classify,
    parse_url,
    sha256_problem,
)
from llmgw.catalog.units import format_duration
from llmgw.wire import messages as m

log = logging.getLogger("llmgw.agent.weights")

REPORT_INTERVAL = 1.0  # seconds between two Progress reports of one source (the bar)
MAX_FAILURES = 5  # attempts in a row that fail without progress before the shard fails
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0  # seconds without a byte before an attempt is given up (and retried)

Send = Callable[[msgspec.Struct], None]
ClientFactory = Callable[[], httpx.Client]


class WeightsPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a shard's source means on this node: what the engine is given, and what (if anything)
    must be fetched first."""

    kind: SourceKind
    engine_source: str  # what the engine gets: the source as is, or the local path of a URL
    url: str = ""
    target: str = ""  # the file in the model cache
    sha256: str = ""
    allow_redirect_hosts: tuple[str, ...] = ()  # besides the source's own host (llmgw.catalog.redirects)

    def for_engine(self, spec: m.ShardSpec) -> m.ShardSpec:
        return spec if self.engine_source == spec.source else msgspec.structs.replace(spec, source=self.engine_source)


class _Job:
    def __init__(self, url: str, target: Path, sha256: str, allow_redirect_hosts: tuple[str, ...] = ()) -> None:
        self.url = url
        self.allow_redirect_hosts = allow_redirect_hosts
        self.display = parse_url(url).display
        self.name = parse_url(url).file_name
        self.target = target
        self.sha256 = sha256
        self.transfer = Transfer()
        self.watchers: dict[str, None] = {}  # shard ids, in the order they came
        self.done = trio.Event()
        self.error: FetchError | None = None
        self.completed = False  # the file is in place
        self.scope = trio.CancelScope()
        self.last_report = -1e9  # trio time of the last Progress
        self.last_done = 0
        self.rate = 0.0
        self.reported_fetched = 0


def default_client() -> httpx.Client:
    # Redirects are followed by the fetcher itself, hop by hop, under llmgw.catalog.redirects' rules.
    return httpx.Client(follow_redirects=False, timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
                        headers={"user-agent": "llmgw-agent-fetch"})


class Weights:
    def __init__(self, work_dir: Path, cache_dir: Path | None = None, *, client: ClientFactory = default_client,
                 disk_free: Callable[[Path], int] | None = None, rng: random.Random | None = None,
                 report_interval: float = REPORT_INTERVAL, retry_initial: float = 1.0, resolve: Resolve = resolve_host,
                 space_step: int = SPACE_STEP) -> None:
        self.resolve = resolve  # host -> addresses, for the redirect rules (tests answer for names)
        self.space_step = space_step
        self.work_dir = work_dir
        self.cache_dir = cache_dir if cache_dir is not None else work_dir / "models"
        self.client = client
        self.disk_free = disk_free
        self.rng = rng or random.Random()
        self.report_interval = report_interval
        self.retry_initial = retry_initial
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.fetched: dict[str, int] = {}  # URL -> bytes received since the agent started (for the metric)
        self.downloads = 0  # downloads begun (tests: eight shards, one download)

    # -- before launch (sync, in Supervisor.start) -----------------------------------------------

    def plan(self, spec: m.ShardSpec) -> WeightsPlan:
        """What the shard's source means here; LaunchError when it cannot be used (a path that
        is not on this node, a URL with no host): the shard fails before anything is launched."""
        source = spec.source or spec.model
        try:
            kind = classify(source)
        except SourceError as exc:
            raise LaunchError(str(exc)) from None
        problem = sha256_problem(spec.sha256)
        if problem:
            raise LaunchError(problem)
        if spec.sha256 and kind is not SourceKind.URL:
            raise LaunchError(f"sha256 is checked only for an http(s) source, not {source!r}")
        if kind is SourceKind.MODEL_ID:
            return WeightsPlan(kind=kind, engine_source=source)
        if kind is SourceKind.PATH:
            path = Path(source) if source.startswith("/") else self.work_dir / source
            if not path.exists():
                where = "" if source.startswith("/") else f" (relative to the agent's work dir: {path})"
                raise LaunchError(f"source {source}: no such file or directory on this node{where}")
            return WeightsPlan(kind=kind, engine_source=source)
        target = (self.cache_dir / cache_name(source)).absolute()
        problem = cache_problem(target)
        if problem:
            raise LaunchError(f"source {parse_url(source).display}: {problem}")
        for host in spec.allow_redirect_hosts:
            problem = allowed_host_problem(host)
            if problem:
                raise LaunchError(problem)
        return WeightsPlan(kind=kind, engine_source=str(target), url=source, target=str(target),
                           sha256=spec.sha256.lower(), allow_redirect_hosts=tuple(spec.allow_redirect_hosts))

    # -- the wait (async, before the launch) ---------------------------------------------------------

    async def ensure(self, shard_id: str, plan: WeightsPlan, deadline: float, nursery: trio.Nursery,
                     send: Send) -> None:
        """Return once `plan.target` holds the whole file (at once if it does already); raise
        LaunchError when the download fails or is still running at `deadline` (trio time)."""
        job: _Job | None = None
        with trio.move_on_at(deadline):
            while True:
                job = await self._join(plan, nursery, send)
                if job is None:
                    return  # already here (an earlier download, a shared filesystem): nothing to fetch
                job.watchers[shard_id] = None
                try:
                    await job.done.wait()
                finally:
                    job.watchers.pop(shard_id, None)
                    if not job.watchers and not job.done.is_set():
                        job.scope.cancel()  # nobody waits on it any more; the partial file stays for later
                if job.error is not None:
                    raise LaunchError(f"weights {job.error}")
                if job.completed:
                    return
                # Cancelled just as this shard came (every other one had left): begin it again.
        assert job is not None
        t = job.transfer
        send(self._progress(job, shard_id, failure=Reason.TIMEOUT))
        raise LaunchError(f"weights {job.display} not fetched within the start_timeout "
                          f"({_amount(t.done, t.total)} so far); "
                          "a larger start_timeout or a closer mirror would let it finish")

    async def _join(self, plan: WeightsPlan, nursery: trio.Nursery, send: Send) -> _Job | None:
        """The download of `plan` under way, or a new one; None when the file is already there."""
        key = (plan.url, plan.sha256)
        while True:
            job = self.jobs.get(key)
            if job is not None and job.scope.cancel_called:
                await job.done.wait()  # a cancelled one still winding down: its partial file is next
                continue
            if job is not None:
                return job
            # lstat, not stat: a link planted at the name is no cached file (and is refused).
            problem = await trio.to_thread.run_sync(cache_problem, Path(plan.target))
            if problem:
                raise LaunchError(f"weights {parse_url(plan.url).display}: {problem}")
            present = await trio.to_thread.run_sync(_is_file, Path(plan.target))
            if key in self.jobs:
                continue  # another shard began it while we looked
            if present:
                return None
            job = self.jobs[key] = _Job(plan.url, Path(plan.target), plan.sha256, plan.allow_redirect_hosts)
            self.downloads += 1
            nursery.start_soon(self._run, job, send)
            return job

    async def _run(self, job: _Job, send: Send) -> None:
        log.info("fetching %s into %s", job.display, job.target)
        started = time.monotonic()
        try:
            with job.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._reporter, job, send)
                    try:
                        await self._attempts(job)
                    finally:
                        nursery.cancel_scope.cancel()
            if job.error is None and not job.scope.cancelled_caught:
                job.completed = True
                took = time.monotonic() - started
                log.info("fetched %s (%s in %s)", job.display, _amount(job.transfer.done, None), format_duration(took))
            elif job.error is not None:
                log.warning("fetching %s failed: %s", job.display, job.error)
            if job.watchers:
                # One last report at the end, at once (the final bytes for the metric; the failure's
                # reason, once): waiting out the interval would hold every launch up to a second.
                self._report(job, send, final=True)
        finally:
            del self.jobs[(job.url, job.sha256)]
            job.done.set()

    async def _attempts(self, job: _Job) -> None:
        backoff = Backoff(self.retry_initial, max(30.0, self.retry_initial), self.rng)
        failures = 0
        while True:
            before = job.transfer.fetched
            try:
                await self._attempt(job)
                return
            except FetchError as exc:
                if job.transfer.fetched > before:
                    failures = 0
                    backoff.reset()
                failures += 1
                if not exc.retry or failures >= MAX_FAILURES:
                    job.error = exc
                    return
                delay = backoff.next()
                log.info("fetching %s: %s; retrying in %.1fs (resuming at byte %d)", job.display, exc, delay,
                         job.transfer.done)
                await trio.sleep(delay)

    async def _attempt(self, job: _Job) -> None:
        """One attempt in a worker thread. A cancel sets the transfer's stop flag; the worker sees
        it within one read (or its read timeout) and returns, and only then does this return."""
        transfer = job.transfer
        transfer.stop = threading.Event()

        def work() -> FetchError | None:
            try:
                with self.client() as client:
                    download(client, job.url, job.display, job.target, job.sha256, transfer, disk_free=self.disk_free,
                             allow_redirect_hosts=job.allow_redirect_hosts, resolve=self.resolve,
                             space_step=self.space_step)
            except Stopped:
                pass
            except FetchError as exc:
                return exc
            except Exception as exc:  # a bug must fail the shard, not the supervisor
                log.exception("fetching %s failed unexpectedly", job.display)
                return FetchError(Reason.NETWORK, f"{job.display}: unexpected error {type(exc).__name__}: {exc}")
            return None

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_cancel, transfer.stop)
            try:
                failed = await trio.to_thread.run_sync(work)
            finally:
                nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def _reporter(self, job: _Job, send: Send) -> None:
        job.last_report = trio.current_time()
        while True:
            await trio.sleep_until(job.last_report + self.report_interval)
            if job.transfer.answered:  # before the server answers there is no total to tell
                self._report(job, send)
            else:
                job.last_report = trio.current_time()

    def _report(self, job: _Job, send: Send, final: bool = False) -> None:
        now = trio.current_time()
        elapsed = now - job.last_report
        t = job.transfer
        job.rate = max(0.0, (t.done - job.last_done) / elapsed) if 0 < elapsed < 10 * self.report_interval else 0.0
        job.last_done = t.done
        job.last_report = now
        self.fetched[job.url] = self.fetched.get(job.url, 0) + t.fetched - job.reported_fetched
        job.reported_fetched = t.fetched
        failure = job.error.reason if final and job.error is not None else None
        for i, shard_id in enumerate(list(job.watchers)):
            # The failure is counted once, on the first shard's report.
            send(self._progress(job, shard_id, failure=failure if i == 0 else None))

    def _progress(self, job: _Job, shard_id: str, failure: Reason | None = None) -> m.Progress:
        t = job.transfer
        # The URL as logs show it (no user info, no query): a viewer reads this, and a source's
        # credentials or presigned signature must not leave the node (issue 40, finding 3).
        return m.Progress(shard_id=shard_id, source=job.display, done_bytes=t.done, total_bytes=t.total,
                          rate=round(job.rate, 1), fetched=self.fetched.get(job.url, 0),
                          failure=failure.value if failure is not None else "")


async def _stop_on_cancel(stop: threading.Event) -> None:
    try:
        await trio.sleep_forever()
    finally:
        stop.set()


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _amount(done: int, total: int | None) -> str:
    scale, unit = (1e9, "GB") if max(done, total or 0) >= 1e9 else (1e6, "MB")
    if total is None:
        return f"{done / scale:.1f} {unit}"
    return f"{done / scale:.1f} of {total / scale:.1f} {unit}"
