"""One task that serves many sockets by callback: an epoll set of our own, edge-triggered.

Why: a plain gateway request is two waits (the client's request, the engine's answer), and on
trio each wait is a task switch plus an epoll registration change. Measured on the dev machine
with wrk -c32 against an nginx upstream, a trio proxy that does nothing but os.read/os.write
with one task per connection used 27 µs of CPU a request; the same reads and writes driven
by callbacks from one task's epoll set used 11 µs (nginx's proxy: 10). The gateway's fast
lane (llmgw.web.fastserve, llmgw.web.fastclient) runs on this; everything else stays on tasks.

Sockets stay registered (EPOLLET) for as long as their owner keeps them: a callback is told
what the kernel said and must read until the socket is drained (a short read) or it will not
hear of those bytes again. Callbacks run in this task, one at a time, and must not block;
work they schedule with `soon` runs after the current batch, never recursively, so a client
pipelining thousands of requests costs bounded stack and bounded work per step.

epoll is Linux's: elsewhere `available` is False and nobody registers anything (the fast lane
is then off and every request takes the task path).
"""

from __future__ import annotations

import collections
import logging
import os
import select
from collections.abc import Callable

import trio

from llmgw.netaddr import READ_SIZE

log = logging.getLogger("llmgw.web.reactor")

_epoll = getattr(select, "epoll", None)
READ: int = getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLRDHUP", 0)
WRITE: int = getattr(select, "EPOLLOUT", 0)
GONE: int = getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLHUP", 0) | getattr(select, "EPOLLERR", 0)
_EDGE: int = getattr(select, "EPOLLET", 0)
STOPPED = 1 << 30  # not the kernel's: the reactor stops, its sockets are no longer served
BATCH = 512  # events served per pass: the bounded step between two checkpoints
POLLS = 3  # polls a step at most (see run)

Callback = Callable[[int], None]


class Reactor:
    """`add(fd, mask, callback)`, `set(fd, callback)`, `remove(fd)`, `soon(fn)`; `run` is its task."""

    def __init__(self) -> None:
        self.available = _epoll is not None
        self.running = False
        self._ep = _epoll() if _epoll is not None else None
        self._callbacks: dict[int, Callback] = {}
        self._soon: collections.deque[Callable[[], None]] = collections.deque()
        self.passes = 0
        # `soon` from another task (a lane answering from a timer) while this one waits on the
        # set: a write here makes the set readable.
        self._wake_fd = -1
        self._sleeping = False

    def add(self, fd: int, mask: int, callback: Callback) -> None:
        assert self._ep is not None
        try:
            self._ep.register(fd, mask | _EDGE)
        except FileExistsError:  # a descriptor number reused while the kernel still held the old one
            self._ep.modify(fd, mask | _EDGE)
        self._callbacks[fd] = callback

    def want(self, fd: int, mask: int) -> None:
        """Change what `fd` is watched for. Writability only while bytes wait to be written: watched
        always, every ACK the peer sends would wake the reactor for nothing (two a request)."""
        assert self._ep is not None
        self._ep.modify(fd, mask | _EDGE)

    def set(self, fd: int, callback: Callback) -> None:
        """Who hears of `fd` from now on (it stays registered)."""
        self._callbacks[fd] = callback

    def remove(self, fd: int) -> None:
        """Forget `fd` (before it is closed, or handed to a task that waits on it through trio)."""
        if self._callbacks.pop(fd, None) is None or self._ep is None:
            return
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass  # closed already: the kernel dropped it from the set itself

    def soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` in this task after the current batch of events (at once if it was waiting)."""
        self._soon.append(fn)
        if self._sleeping:
            self._sleeping = False
            os.eventfd_write(self._wake_fd, 1)

    def __contains__(self, fd: int) -> bool:
        return fd in self._callbacks

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The reactor's task (`await nursery.start(reactor.run)`). Callbacks that raise are
        logged and skipped: one bad exchange must not stop the others."""
        ep = self._ep
        if ep is None:
            task_status.started()
            await trio.sleep_forever()
            return
        ep_fd = ep.fileno()
        callbacks, soon = self._callbacks, self._soon
        wait_readable, checkpoint = trio.lowlevel.wait_readable, trio.lowlevel.checkpoint
        wake_fd = self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.add(wake_fd, READ, lambda mask: _drain(wake_fd))
        self.running = True
        try:
            task_status.started()
            while True:
                if soon:
                    await checkpoint()
                else:
                    self._sleeping = True
                    try:
                        await wait_readable(ep_fd)
                    finally:
                        self._sleeping = False
                # Poll again while events keep coming, up to POLLS times and BATCH events a step:
                # what arrived while a batch was served is served without a trip through trio's
                # epoll and scheduler (under load a batch is a few events, and each trip costs
                # about as much as they do). Not until none come: under load some always do, and
                # the tasks (a request the lane handed over, a stream) waited ~8 ms a step
                # (wrk -c32 p99 2 -> 52-87 ms). `soon` work runs after every batch, empty or not.
                budget = BATCH
                for _ in range(POLLS):
                    events = ep.poll(0, budget)
                    budget -= len(events)
                    self.passes += 1
                    for fd, mask in events:
                        callback = callbacks.get(fd)
                        if callback is not None:
                            try:
                                callback(mask)
                            except Exception:
                                log.exception("reactor callback for fd %d failed", fd)
                    for _ in range(len(soon)):
                        try:
                            soon.popleft()()
                        except Exception:
                            log.exception("reactor callback failed")
                    if not events or budget <= 0:
                        break
        finally:
            # Whoever still waits on a socket hears it is gone (a client connection ends, an
            # exchange is abandoned), so no task is left waiting on a reactor that stopped.
            self.running = False
            for fd, callback in list(callbacks.items()):
                if fd == wake_fd:
                    continue
                try:
                    callback(STOPPED)
                except Exception:
                    log.exception("reactor callback for fd %d failed at stop", fd)
            self._callbacks.clear()
            self._soon.clear()
            ep.close()
            os.close(wake_fd)
            self._ep = None


def write_out(reactor: Reactor, fd: int, data: bytes, pending: bytes) -> bytes:
    """Write what the socket takes of `data`; returns the rest (b"": all written). Writability is
    watched only while a rest waits (`pending`: the rest before this call), else every ACK the peer
    sends would wake the reactor for nothing. Raises OSError when the peer is gone."""
    try:
        sent = os.write(fd, data)
    except BlockingIOError:
        sent = 0
    rest = data[sent:] if sent < len(data) else b""
    if rest and not pending:
        reactor.want(fd, READ | WRITE)
    elif pending and not rest:
        reactor.want(fd, READ)
    return rest


def read_into(fd: int, buf: bytearray, mask: int, *, limit: int = 0) -> bool:
    """Read what `fd` has into `buf` as an edge-triggered socket must: until it is drained (a
    short read, or EAGAIN when the peer hung up, so its EOF is seen now) or `buf` holds more than
    `limit` bytes (0: no limit). True at EOF (a reset counts as EOF)."""
    while True:
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            return True
        if not data:
            return True
        buf += data
        if limit and len(buf) > limit:
            return False
        if len(data) < READ_SIZE and not mask & GONE:
            return False


def _drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass
