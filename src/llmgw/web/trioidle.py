"""Whether trio has anything to run but the reactor: what lets the reactor wait in its own epoll set.

Why: a gateway worker that is not saturated sleeps and wakes about once a request (perf stat,
2 Dec, compiled, wrk against nginx: 0.7 context switches a request in each of two workers at 64
connections, 0.09 in one saturated worker at 32), and each wake through trio is a pass of its
scheduler (an epoll_ctl re-arming the reactor's set, trio's epoll_wait, a task switch) on top of
the reactor's own poll. When the reactor is the only task that can run, it blocks in its own
epoll set instead, with trio's epoll set nested in it (readable when any fd a task waits on is,
trio's wakeup socket for threads and signals among them) and a timeout at trio's next deadline:
the same things wake it, without trio's pass.

trio has no public way to ask this (current_statistics counts every registered fd, and has no
epoll fd): this module reads trio's runner, which is private. `find` says None wherever it is
not what was read here (another trio, a clock that is not the system's, guest mode), and the
reactor then waits through trio as it always did; a test fails when the installed trio no longer
matches, so the fallback is never taken unseen.
"""

from __future__ import annotations

from typing import Any

MAX_TASKS = 256  # more tasks than this: not worth the scan (a loaded process is rarely idle)
MAX_NAP = 86400.0  # trio's own longest wait


class TrioIdle:
    """The runner's state the reactor needs: `fd` (trio's epoll set), `alone`, `runnable`, `timeout`."""

    def __init__(self, runner: Any, fd: int) -> None:
        self._runner = runner
        self.fd = fd

    @classmethod
    def find(cls) -> TrioIdle | None:
        try:
            from trio._core import _run
            from trio._core._io_epoll import EpollIOManager

            runner = _run.GLOBAL_RUN_CONTEXT.runner
            io = runner.io_manager
            if (type(runner.clock) is not _run.SystemClock or runner.is_guest
                    or not isinstance(io, EpollIOManager)):
                return None
            runner.runq.__len__, runner.tasks.__len__, runner.waiting_for_idle.__len__  # noqa: B018
            runner.deadlines.next_deadline()
            return cls(runner, io._epoll.fileno())
        except (ImportError, AttributeError):
            return None

    def alone(self, me: object) -> bool:
        """Nothing but `me` (the running task) can run: nothing queued, no task of this batch still
        to step (a task is scheduled while its _next_send_fn is set), nobody waiting for idle."""
        runner = self._runner
        if runner.runq or runner.waiting_for_idle:
            return False
        tasks = runner.tasks
        if len(tasks) > MAX_TASKS:
            return False
        return all(task is me or task._next_send_fn is None for task in tasks)

    def runnable(self) -> bool:
        """A task was scheduled (by a callback) since `alone`."""
        return bool(self._runner.runq)

    def timeout(self) -> float:
        """Seconds until trio's next deadline (0: due now), at most a day."""
        runner = self._runner
        return min(max(runner.clock.deadline_to_sleep_time(runner.deadlines.next_deadline()), 0.0), MAX_NAP)
