"""One HTTP/2 connection carrying one fleet stream, on trio and h2, for both ends.

Flow control follows purerpc's lesson (DESIGN.md):
- one reader task per connection that never blocks on the application: received messages go
  to an inbox, and their bytes are acknowledged to the peer (WINDOW_UPDATE) only when the
  application takes them, so a slow consumer slows the sender through flow control alone;
- per-stream and connection windows of at least twice the largest message;
- one writer task that owns the socket's send side; nothing else writes, so the reader is
  never stuck behind a full send buffer (the classic HTTP/2 deadlock).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import msgspec
import trio

from llmgw.netaddr import READ_SIZE
from llmgw.wire.envelope import (
    FLAG_END_STREAM,
    HEADER_SIZE,
    EnvelopeDecoder,
    EnvelopeError,
    encode_envelope,
)

log = logging.getLogger("llmgw.fleet")

MAX_FRAME = 65536  # our SETTINGS_MAX_FRAME_SIZE: fewer frames for a big Register


class ChannelClosed(Exception):
    """The stream ended. `error` is True when it ended because something went wrong."""

    def __init__(self, reason: str, *, error: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class _EndOfStream(msgspec.Struct, omit_defaults=True):
    error: dict[str, str] | None = None


_eos_decoder = msgspec.json.Decoder(_EndOfStream)


def window_for(max_message: int) -> int:
    """Stream and connection window: at least twice the largest message (and ≤ 2^31-1)."""
    return min(max(2 * (max_message + HEADER_SIZE), 65535), 2**31 - 1)


class FleetChannel:
    """The application's view of a Connect stream: whole message payloads in and out."""

    def __init__(self, conn: H2Connection, stream_id: int) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self._decoder = EnvelopeDecoder(conn.max_message)
        self._inbox: collections.deque[bytes] = collections.deque()
        self._held = 0  # flow-controlled bytes of the messages in the inbox (not yet acknowledged)
        self._inbox_event = trio.Event()
        self._window_event = trio.Event()
        self._send_lock = trio.Lock()
        self.closed_reason: str | None = None
        self.closed_error = False
        self.remote_ended = False
        self.local_ended = False

    @property
    def peer(self) -> str:
        return self._conn.peer

    @property
    def tls_identity(self) -> str | None:
        return self._conn.tls_identity

    @property
    def connection(self) -> H2Connection:
        return self._conn

    @property
    def buffered(self) -> int:
        """Received bytes the application has not taken yet; flow control keeps this within the window."""
        return self._held + self._decoder.buffered

    # -- receiving -------------------------------------------------------------------------

    def _on_data(self, data: bytes, flow_controlled_length: int) -> None:
        padding = flow_controlled_length - len(data)
        if padding:
            self._conn.h2.acknowledge_received_data(padding, self.stream_id)
        for flags, payload in self._decoder.feed(data):
            if flags & FLAG_END_STREAM:
                self._conn.h2.acknowledge_received_data(HEADER_SIZE + len(payload), self.stream_id)
                self._on_end_of_stream(payload)
            else:
                self._inbox.append(payload)
                self._held += HEADER_SIZE + len(payload)
        self._inbox_event.set()

    def _on_end_of_stream(self, payload: bytes) -> None:
        reason, error = "peer ended the stream", False
        if payload:
            try:
                eos = _eos_decoder.decode(payload)
            except msgspec.DecodeError:
                eos = _EndOfStream(error={"code": "unknown", "message": "malformed end-of-stream message"})
            if eos.error:
                reason = eos.error.get("message") or eos.error.get("code") or "error"
                error = True
        self.remote_ended = True
        self._mark_closed(reason, error=error)

    def _mark_closed(self, reason: str, *, error: bool) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
            self.closed_error = error
        self._inbox_event.set()
        self._window_event.set()

    async def receive(self) -> bytes:
        """The next message payload; raises ChannelClosed once the stream is over."""
        while not self._inbox:
            if self.closed_reason is not None:
                raise ChannelClosed(self.closed_reason, error=self.closed_error)
            self._inbox_event = trio.Event()
            await self._inbox_event.wait()
        return self._take()

    def _take(self) -> bytes:
        """Pop the oldest message and give its bytes back to the peer's window."""
        payload = self._inbox.popleft()
        self._held -= HEADER_SIZE + len(payload)
        if self.closed_reason is None:
            self._conn.h2.acknowledge_received_data(HEADER_SIZE + len(payload), self.stream_id)
            self._conn.pump()
        return payload

    # -- sending -----------------------------------------------------------------------------

    async def send(self, payload: bytes) -> None:
        """Send one message; waits for flow-control window, never buffers without bound."""
        if len(payload) > self._conn.max_message:
            raise ValueError(
                f"message of {len(payload)} bytes exceeds the limit of {self._conn.max_message} (max_message)")
        await self.send_raw(encode_envelope(payload))

    async def send_raw(self, data: bytes, end_stream: bool = False) -> None:
        """Bytes as they are, no envelope (a refusal's plain text), under flow control."""
        h2c = self._conn.h2
        async with self._send_lock:
            view = memoryview(data)
            while True:
                # The stream's own reason first: a peer that ended it with an error (the server
                # shutting down) said why, and that beats the GOAWAY that follows it.
                if self.closed_reason is not None and self.closed_error:
                    raise ChannelClosed(self.closed_reason, error=True)
                if self._conn.closed_reason is not None:
                    raise ChannelClosed(self._conn.closed_reason, error=self._conn.closed_error)
                if self.local_ended:
                    raise ChannelClosed("stream already ended by this side")
                if not view:
                    break
                try:
                    window = h2c.local_flow_control_window(self.stream_id)
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                    self._mark_closed("stream closed", error=True)
                    raise ChannelClosed(self.closed_reason or "stream closed", error=True) from None
                if window <= 0:
                    self._window_event = trio.Event()
                    await self._window_event.wait()
                    continue
                n = min(window, len(view), h2c.max_outbound_frame_size)
                h2c.send_data(self.stream_id, bytes(view[:n]))
                view = view[n:]
                self._conn.pump()
            if end_stream:
                self.local_ended = True
                try:
                    h2c.end_stream(self.stream_id)
                except h2.exceptions.H2Error:
                    pass
                self._conn.pump()


class H2Connection:
    """An HTTP/2 connection; the server side accepts one Connect stream, the client opens one."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        client_side: bool,
        max_message: int,
        peer: str = "",
        tls_identity: str | None = None,
        idle_timeout: float | None = None,
    ) -> None:
        self.stream = stream
        self.client_side = client_side
        self.max_message = max_message
        self.peer = peer
        self.tls_identity = tls_identity
        self.idle_timeout = idle_timeout
        config = h2.config.H2Configuration(
            client_side=client_side, header_encoding="utf-8", validate_inbound_headers=True
        )
        self.h2 = h2.connection.H2Connection(config=config)
        self.window = window_for(max_message)
        self.channels: dict[int, FleetChannel] = {}
        self._outbuf = bytearray()
        self._flush_event = trio.Event()
        # Bytes handed to the writer and bytes it sent: flushed() waits for the first count.
        self._queued = 0
        self._written = 0
        self._wrote_event = trio.Event()
        self._writer_done = False
        self._writer_sending = False  # inside send_all: cut there, the byte stream is unusable
        self._writer_broken = False
        self._late_sending = False  # flushed() sending what a cancelled writer left
        self._request_event = trio.Event()
        self._response_event = trio.Event()
        self._request_headers: dict[str, str] | None = None
        self._request_stream: int | None = None
        self._response_headers: dict[str, str] | None = None
        self.closed_reason: str | None = None
        self.closed_error = False
        self.closed_exc: BaseException | None = None  # what broke the socket, for TLS errors
        self.last_received = 0.0
        self.ping_acks = 0

    # -- plumbing ------------------------------------------------------------------------------

    def start(self) -> None:
        self.h2.local_settings = h2.settings.Settings(
            client=self.client_side,
            initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.window,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1 if not self.client_side else 0,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            },
        )
        # Replacing the settings object makes these values current at once (they go out in
        # the preface, so the peer obeys them from its first frame); h2 caches this one.
        self.h2.max_inbound_frame_size = MAX_FRAME
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(self.window - 65535)
        self.pump()

    def pump(self) -> None:
        """Move whatever h2 wants to send into the writer's buffer and wake the writer."""
        data = self.h2.data_to_send()
        if data:
            self._outbuf += data
            self._queued += len(data)
            self._flush_event.set()

    async def writer(self) -> None:
        try:
            while True:
                if not self._outbuf:
                    if self.closed_reason is not None:
                        return
                    self._flush_event = trio.Event()
                    await self._flush_event.wait()
                    continue
                # A cancelled writer stops here, with its data still queued (flushed() may send
                # it), not inside send_all where part of it may or may not have gone out.
                await trio.lowlevel.checkpoint_if_cancelled()
                data = bytes(self._outbuf)
                self._outbuf.clear()
                self._writer_sending = True
                await self.stream.send_all(data)
                self._writer_sending = False
                self._written += len(data)
                self._wrote_event.set()
                self._wrote_event = trio.Event()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._writer_broken = True
            self._close_all(f"connection lost while sending ({type(exc).__name__})", error=True)
        finally:
            self._writer_done = True
            self._wrote_event.set()

    async def flushed(self) -> None:
        """Wait until everything queued so far went to the socket (or the writer is gone).

        Counting bytes, not watching an "idle" flag: a GOAWAY queued just before the caller
        closes the socket must really be sent, even when the writer has not woken up for it yet.
        """
        target = self._queued
        while self._written < target and not self._writer_done:
            await self._wrote_event.wait()
        idle = not (self._writer_sending or self._writer_broken or self._late_sending)
        if self._writer_done and self._outbuf and idle:
            # The writer is gone but left the byte stream whole: it was cancelled while idle
            # (the agent stopping). Nothing else writes now; say goodbye from here.
            data = bytes(self._outbuf)
            self._outbuf.clear()
            self._late_sending = True
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            finally:
                self._late_sending = False
            self._written += len(data)

    async def _receive(self) -> bytes | None:
        """Bytes from the peer; None when the idle timeout passed without any."""
        if self.idle_timeout is None:
            return bytes(await self.stream.receive_some(READ_SIZE))
        with trio.move_on_after(self.idle_timeout):
            return bytes(await self.stream.receive_some(READ_SIZE))
        return None

    async def reader(self) -> None:
        try:
            while self.closed_reason is None:
                data = await self._receive()
                if data is None:
                    self.fail(f"no data from peer for {self.idle_timeout:g}s (half-open connection?)")
                    return
                if not data:
                    self._close_all("connection closed by peer", error=not self._all_ended())
                    return
                self.last_received = trio.current_time()
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    self.pump()
                    self._close_all(f"HTTP/2 protocol error from peer: {exc}", error=True)
                    return
                for event in events:
                    self._handle(event)
                self.pump()
        except EnvelopeError as exc:
            self.fail(f"bad envelope: {exc}")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.closed_exc = exc
            cause = exc.__cause__
            detail = f": {cause}" if cause is not None else ""
            self._close_all(f"connection lost ({type(exc).__name__}{detail})", error=True)

    def _all_ended(self) -> bool:
        return bool(self.channels) and all(c.remote_ended for c in self.channels.values())

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            channel = self.channels.get(event.stream_id)
            if channel is None:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                return
            channel._on_data(event.data, event.flow_controlled_length)
        elif isinstance(event, h2.events.WindowUpdated):
            if event.stream_id:
                channel = self.channels.get(event.stream_id)
                if channel is not None:
                    channel._window_event.set()
            else:
                for channel in self.channels.values():
                    channel._window_event.set()
        elif isinstance(event, h2.events.RequestReceived):
            self._on_request(event)
        elif isinstance(event, h2.events.ResponseReceived):
            self._response_headers = _text_headers(event.headers)
            self._response_event.set()
        elif isinstance(event, h2.events.TrailersReceived):
            headers = _text_headers(event.headers)
            channel = self.channels.get(event.stream_id)
            if channel is not None and headers.get("grpc-status", "0") not in ("", "0"):
                channel._mark_closed(headers.get("grpc-message", "error"), error=True)
        elif isinstance(event, h2.events.StreamEnded):
            channel = self.channels.get(event.stream_id)
            if channel is not None:
                if channel._decoder.in_envelope:
                    channel._mark_closed("stream ended inside a message", error=True)
                channel.remote_ended = True
                channel._mark_closed("peer ended the stream", error=False)
        elif isinstance(event, h2.events.StreamReset):
            channel = self.channels.get(event.stream_id)
            if channel is not None:
                channel.remote_ended = True
                channel._mark_closed(f"stream reset by peer ({event.error_code!s})", error=True)
            self._response_event.set()
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            for channel in self.channels.values():
                channel._window_event.set()
        elif isinstance(event, h2.events.PingAckReceived):
            self.ping_acks += 1
        elif isinstance(event, h2.events.ConnectionTerminated):
            msg = "peer closed the connection (GOAWAY"
            if event.error_code and event.error_code != h2.errors.ErrorCodes.NO_ERROR:
                msg += f", {event.error_code!s}"
            if event.additional_data:
                msg += f": {event.additional_data.decode('utf-8', 'replace')}"
            msg += ")"
            self._close_all(msg, error=bool(event.error_code))

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        if self.client_side or self._request_stream is not None:
            # One Connect stream per connection.
            self.h2.reset_stream(event.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        self._request_stream = event.stream_id
        self._request_headers = _text_headers(event.headers)
        channel = FleetChannel(self, event.stream_id)
        self.channels[event.stream_id] = channel
        self._request_event.set()

    def _close_all(self, reason: str, *, error: bool) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
            self.closed_error = error
        for channel in self.channels.values():
            channel._mark_closed(reason, error=error)
        self._request_event.set()
        self._response_event.set()
        self._flush_event.set()

    def fail(self, reason: str, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.PROTOCOL_ERROR) -> None:
        """Close because of a protocol-level fault: GOAWAY with the reason, then hang up."""
        try:
            self.h2.close_connection(error_code=code, additional_data=reason.encode()[:256])
        except h2.exceptions.H2Error:
            pass
        self.pump()
        self._close_all(reason, error=True)

    def ping(self) -> None:
        try:
            self.h2.ping(b"llmgwpng")
        except h2.exceptions.H2Error:
            return
        self.pump()

    # -- server side ---------------------------------------------------------------------------

    async def accept(self) -> tuple[FleetChannel, dict[str, str]]:
        await self._request_event.wait()
        if self._request_stream is None or self.closed_reason is not None:
            raise ChannelClosed(self.closed_reason or "connection closed before a request", error=True)
        return self.channels[self._request_stream], self._request_headers or {}

    def respond(self, channel: FleetChannel, status: int, headers: list[tuple[str, str]], end: bool = False) -> None:
        self.h2.send_headers(channel.stream_id, [(":status", str(status)), *headers], end_stream=end)
        self.pump()

    # -- client side ---------------------------------------------------------------------------

    async def open(self, authority: str, path: str, headers: list[tuple[str, str]], scheme: str) -> FleetChannel:
        stream_id = self.h2.get_next_available_stream_id()
        channel = FleetChannel(self, stream_id)
        self.channels[stream_id] = channel
        self.h2.send_headers(
            stream_id,
            [(":method", "POST"), (":scheme", scheme), (":authority", authority), (":path", path), *headers],
        )
        self.pump()
        await self._response_event.wait()
        if self._response_headers is None:
            raise ChannelClosed(channel.closed_reason or self.closed_reason or "no response", error=True)
        return channel

    @property
    def response_headers(self) -> dict[str, str]:
        return self._response_headers or {}

    # -- ending ----------------------------------------------------------------------------------

    async def end_channel(self, channel: FleetChannel, error: str | None = None, code: str = "internal") -> None:
        """End our side: an end-of-stream envelope (with the error, if any), then END_STREAM."""
        if self.closed_reason is not None or channel.local_ended:
            return
        body = {"error": {"code": code, "message": error}} if error else {}
        payload = msgspec.json.encode(body)
        with trio.move_on_after(2):
            try:
                if not self.client_side:
                    await channel.send_raw(encode_envelope(payload, FLAG_END_STREAM), end_stream=True)
                else:
                    await channel.send_raw(b"", end_stream=True)
            except ChannelClosed:
                pass

    async def goaway(self, reason: str = "", code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
        """Graceful close: GOAWAY, flush (bounded), then close the socket."""
        try:
            self.h2.close_connection(error_code=code, additional_data=reason.encode()[:256] or None)
        except h2.exceptions.H2Error:
            pass
        self.pump()
        with trio.move_on_after(2):
            await self.flushed()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(1):
                await self.stream.aclose()


def _text_headers(headers: Iterable[tuple[bytes | str, bytes | str]] | None) -> dict[str, str]:
    """Headers as text. The connection decodes them (header_encoding="utf-8"), so they arrive as
    str; h2's types allow bytes too, which are decoded here the same way."""
    return {
        (k if isinstance(k, str) else k.decode("utf-8", "replace")):
            (v if isinstance(v, str) else v.decode("utf-8", "replace"))
        for k, v in headers or ()
    }
