"""The Connect streaming envelope: 1 flag byte, 4-byte big-endian length, payload.

Pure: bytes in, envelopes out. The decoder never buffers more than one envelope's header
plus `max_message` bytes, and rejects a declared length over the limit as soon as the
5-byte header is seen, so a peer cannot make us allocate by lying about a length.
"""

from __future__ import annotations

import struct

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
HEADER_SIZE = 5
DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024

_HEADER = struct.Struct(">BI")


class EnvelopeError(ValueError):
    """The byte stream is not a valid sequence of envelopes (fatal to the stream)."""


def encode_envelope(payload: bytes, flags: int = 0) -> bytes:
    return _HEADER.pack(flags, len(payload)) + payload


class EnvelopeDecoder:
    """Incremental decoder; `feed` returns the complete envelopes as (flags, payload)."""

    __slots__ = ("_buf", "_flags", "_need", "max_message")

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        if max_message < 0:
            raise ValueError("max_message must be >= 0")
        self.max_message = max_message
        self._buf = bytearray()
        self._need = -1  # payload length of the envelope being read; -1 while in a header
        self._flags = 0

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete envelope (never more than 5 + max_message)."""
        return len(self._buf)

    @property
    def in_envelope(self) -> bool:
        """True when a partial envelope is pending (the stream must not end here)."""
        return bool(self._buf) or self._need >= 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        view = memoryview(data)
        pos = 0
        end = len(view)
        while pos < end:
            if self._need < 0:
                take = min(HEADER_SIZE - len(self._buf), end - pos)
                self._buf += view[pos : pos + take]
                pos += take
                if len(self._buf) < HEADER_SIZE:
                    break
                flags, length = _HEADER.unpack(self._buf)
                self._buf.clear()
                if flags & ~(FLAG_COMPRESSED | FLAG_END_STREAM):
                    raise EnvelopeError(f"unknown envelope flags 0x{flags:02x}")
                if flags & FLAG_COMPRESSED:
                    raise EnvelopeError("compressed envelopes are not supported")
                if length > self.max_message:
                    raise EnvelopeError(
                        f"envelope of {length} bytes exceeds the limit of {self.max_message}"
                    )
                self._flags = flags
                self._need = length
                if length == 0:
                    out.append((flags, b""))
                    self._need = -1
                continue
            missing = self._need - len(self._buf)
            if not self._buf and end - pos >= missing:
                # Fast path: the whole payload is in this chunk; no copy through the buffer.
                out.append((self._flags, bytes(view[pos : pos + missing])))
                pos += missing
                self._need = -1
                continue
            take = min(missing, end - pos)
            self._buf += view[pos : pos + take]
            pos += take
            if len(self._buf) == self._need:
                out.append((self._flags, bytes(self._buf)))
                self._buf.clear()
                self._need = -1
        return out
