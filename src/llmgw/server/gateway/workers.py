"""The control plane's gateway workers (`gateway.workers: N`): N processes, each running
`llmgw gateway --worker I` (llmgw.server.gateway.worker), each accepting on the public port with
SO_REUSEPORT. This module owns them: each runs in the pool's nursery, one task per worker slot;
a worker that exits for any reason (a crash, kill -9) is started again, with a backoff when it
dies at once, while the others serve on (the kernel sends new connections to the sockets that
are still listening). Cancelling the pool ends them all (SIGTERM, then SIGKILL).

A worker ends with the server however the server ends (issue 41, finding 4: after a kill -9
outside systemd they kept the public port and followed the next server beside its own workers).
Each gets the read end of a pipe whose write end only this process holds (--parent-fd): the
kernel closes it when the server dies, kill -9 included, and the worker reads EOF and stops as on
SIGTERM. Not PR_SET_PDEATHSIG: it fires when the *thread* that forked the child exits, and trio
spawns from a worker thread of its cache, which exits after 10 s idle, so a healthy worker would
get the signal. And each worker presents this start's secret (LLMGW_WORKER_KEY in its
environment) in its hello: a worker of another server is refused (llmgw.server.gwfeed).

A reload that changes the count resizes the pool live (`resize`): new slots start and serve; the
surplus (the highest indices) get SIGTERM and drain as at shutdown (stop accepting, finish their
requests for up to shutdown_grace, exit 0), and are not started again."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys

import trio

log = logging.getLogger("llmgw.gateway")

QUICK_DEATH = 5.0  # seconds: a worker that dies sooner than this is restarted after a backoff
BACKOFF = (0.2, 10.0)


class WorkerPool:
    def __init__(self, count: int, *, listen: str, feed_socket: str, key: str, log_level: str = "info",
                 debug: bool = False) -> None:
        self.count = count
        self.key = key  # this start's worker key (GatewayFeedService.worker_key)
        self.parent_fd = -1  # the pipe's read end the workers watch, while run() runs
        self.listen = listen
        self.feed_socket = feed_socket
        self.log_level = log_level
        self.debug = debug
        self.pids: dict[int, int] = {}  # worker index → pid of its current process
        self.restarts = 0
        self.stopping = False
        self._gone = trio.Event()  # set when the last worker has exited after drain()
        self._slots: set[int] = set()  # worker indices with a task keeping them
        self._resized = trio.Event()  # set by resize(): run() starts the slots now wanted

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "llmgw", *(["--debug"] if self.debug else []), "gateway",
                "--worker", str(index), "--feed-socket", self.feed_socket, "--listen", self.listen,
                "--log-level", self.log_level, "--parent-fd", str(self.parent_fd)]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Both ends close-on-exec (os.pipe): only the workers get the read end (pass_fds), and no
        # child of this process inherits the write end, so the workers read EOF when this process ends.
        self.parent_fd, alive = os.pipe()
        try:
            async with trio.open_nursery() as nursery:
                self._start_slots(nursery)
                log.info("gateway: %d worker(s) on %s", self.count, self.listen)
                task_status.started()
                while True:
                    await self._resized.wait()
                    self._resized = trio.Event()
                    self._start_slots(nursery)
        finally:
            os.close(alive)
            os.close(self.parent_fd)

    def _start_slots(self, nursery: trio.Nursery) -> None:
        for index in range(self.count):
            if index not in self._slots:  # a slot still draining after a shrink is kept by its task
                self._slots.add(index)
                nursery.start_soon(self._keep, index)

    def resize(self, count: int) -> None:
        """Run `count` workers from now on: start the missing ones, retire the surplus (SIGTERM:
        each drains for up to shutdown_grace and exits; its slot is not started again)."""
        old, self.count = self.count, count
        log.info("gateway: %d → %d worker(s)", old, count)
        for index, pid in list(self.pids.items()):
            if index >= count:
                _terminate(pid)
        self._resized.set()

    async def drain(self, grace: float) -> None:
        """Shutdown: SIGTERM to every worker (each stops accepting and lets its requests in
        flight finish for up to shutdown_grace), none started again; wait for them, a second
        more than `grace`. Cancelling the pool afterwards kills what is left."""
        self.stopping = True
        for pid in list(self.pids.values()):
            _terminate(pid)
        if self.pids:
            with trio.move_on_after(grace + 1):
                await self._gone.wait()

    async def _keep(self, index: int) -> None:
        try:
            await self._keep_running(index)
        finally:
            self._slots.discard(index)

    async def _keep_running(self, index: int) -> None:
        wait = BACKOFF[0]
        while not self.stopping and index < self.count:
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(functools.partial(
                    trio.run_process, self.command(index), check=False, stdin=subprocess.DEVNULL,
                    pass_fds=(self.parent_fd,), env={**os.environ, "LLMGW_WORKER_KEY": self.key}))
                self.pids[index] = process.pid
                if index >= self.count:  # resized away while it started
                    _terminate(process.pid)
            code = process.returncode
            self.pids.pop(index, None)
            if self.stopping:
                log.info("gateway worker-%d (pid %d) stopped (exit code %s)", index, process.pid, code)
                if not self.pids:
                    self._gone.set()
                return
            if index >= self.count:
                log.info("gateway worker-%d (pid %d) retired (exit code %s)", index, process.pid, code)
                return
            self.restarts += 1
            quick = trio.current_time() - started < QUICK_DEATH
            log.warning("gateway worker-%d (pid %d) exited with %s; starting it again%s", index, process.pid,
                        f"signal {-code}" if code is not None and code < 0 else f"code {code}",
                        f" in {wait:g}s" if quick else "")
            if quick:
                await trio.sleep(wait)
                wait = min(wait * 2, BACKOFF[1])
            else:
                wait = BACKOFF[0]


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
