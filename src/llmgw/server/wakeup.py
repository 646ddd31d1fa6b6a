"""The controller's wake-up: "make a pass now", asked by the parts that change what it decides on.

Before issue 42 the drainer and the remedy service were handed `lambda: self.controller.wake()`
in app.py: closures over a controller not built yet, which the composition test could not see
(it checks assignments, and a closure assigns nothing). A `Wakeup` is built first, handed to
whoever asks (the drainer, the remedy service, the controller itself, the operator through the
controller) and to the controller that waits on it; nobody needs the controller to exist to ask.
"""

from __future__ import annotations

import trio


class Wakeup:
    """A level, not a count: any number of `wake()`s before the next `wait()` make one pass."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def wake(self) -> None:
        """Ask for a pass now (never blocks; the controller's loop makes it)."""
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        """Until woken; then ready for the next wake, also when the wait ends otherwise (the
        controller's `move_on_after(tick)`): a wake before the next wait still counts."""
        try:
            await self._event.wait()
        finally:
            self._event = trio.Event()
