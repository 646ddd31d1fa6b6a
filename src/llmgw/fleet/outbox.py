"""What one fleet stream has queued for its writer: a bounded memory channel, and what happens
when it is full.

Callers queue without waiting (`put` is synchronous: the supervisor's callbacks and the
reconciler's driver must never block on a peer), one writer task per stream drains the queue
into the stream, and HTTP/2 flow control holds that writer when the peer does not read. Before
this bound the queue was a list: a peer that kept its connection alive but stopped reading let
it grow without limit.

When the queue is full the peer has not read for a long time (the stream's window is full
and the writer is stuck behind it), and each side does what keeps both views true:

- A *replaceable* message (a heartbeat, download progress: the next one says everything the
  dropped one said) is dropped and counted. Closing the stream for it would throw away the
  statuses queued ahead of it.
- Any other message (a shard status, Start, Stop) cannot be dropped without the two ends
  disagreeing about a shard, and it cannot wait (no caller blocks): the stream is closed as a
  slow consumer. The agent reconnects, and its Register, which lists every shard in full, puts
  both views right again (adoption, disowning, Stops re-sent); waiting instead would keep a
  stuck stream and a growing gap.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import trio

from llmgw.wire import messages as m

# Messages queued per stream. A node lists at most fleet.max_shards (1,024) shards, and stopping
# them all queues a status or a Stop for each, twice (stopping, then stopped) at once, before the
# writer runs: 4,096 holds that burst, and at the usual few hundred bytes a message stays
# around a megabyte.
CAPACITY = 4096


class Sink(Protocol):
    """Where the writer sends (a FleetChannel)."""

    async def send(self, payload: bytes) -> None: ...


class Outbox:
    def __init__(self, capacity: int = CAPACITY, replaceable: tuple[type[msgspec.Struct], ...] = ()) -> None:
        self.capacity = capacity
        self.replaceable = replaceable
        self._tx, self._rx = trio.open_memory_channel[bytes](capacity)
        self.dropped = 0  # replaceable messages dropped because the queue was full
        self.overflow = trio.Event()  # set when a message that may not be dropped found it full
        self.reason = ""

    def put(self, msg: msgspec.Struct) -> bool:
        """Queue `msg`; False when it was dropped or the queue overflowed (the stream is done)."""
        if self.overflow.is_set():
            return False
        try:
            self._tx.send_nowait(m.encode(msg))
            return True
        except trio.WouldBlock:
            pass
        if isinstance(msg, self.replaceable):
            self.dropped += 1
            return False
        self.reason = (f"slow consumer: {self.capacity:,} messages queued and unread by the peer "
                       f"when a {m.message_type(msg)} was added")
        self.overflow.set()
        return False

    def take_queued(self) -> list[bytes]:
        """Everything queued and not yet written, taken out (for tests and inspection)."""
        out = []
        while True:
            try:
                out.append(self._rx.receive_nowait())
            except trio.WouldBlock:
                return out

    async def pump(self, channel: Sink) -> None:
        """The stream's one writer: send what is queued, in order, as the peer's window allows."""
        async for payload in self._rx:
            await channel.send(payload)
