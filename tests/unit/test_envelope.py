"""The envelope codec: round trips, and arbitrary bytes never do more than fail cleanly."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.wire.envelope import (
    FLAG_END_STREAM,
    HEADER_SIZE,
    EnvelopeDecoder,
    EnvelopeError,
    encode_envelope,
)

MAX = 4096


def feed_in_chunks(decoder: EnvelopeDecoder, data: bytes, cuts: list[int]) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    pos = 0
    for cut in [*sorted(set(c % (len(data) + 1) for c in cuts)), len(data)]:
        out += decoder.feed(data[pos:cut])
        assert decoder.buffered <= HEADER_SIZE + decoder.max_message
        pos = max(pos, cut)
    return out


@given(
    payloads=st.lists(st.tuples(st.sampled_from([0, FLAG_END_STREAM]), st.binary(max_size=MAX)), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=200_000), max_size=30),
)
def test_round_trip_any_chunking(payloads: list[tuple[int, bytes]], cuts: list[int]) -> None:
    data = b"".join(encode_envelope(p, f) for f, p in payloads)
    assert feed_in_chunks(EnvelopeDecoder(MAX), data, cuts) == payloads


@settings(max_examples=500)
@given(data=st.binary(max_size=20_000), cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=10))
def test_random_bytes_only_raise_envelope_error(data: bytes, cuts: list[int]) -> None:
    decoder = EnvelopeDecoder(MAX)
    try:
        for flags, payload in feed_in_chunks(decoder, data, cuts):
            assert len(payload) <= MAX
            assert flags in (0, FLAG_END_STREAM)
    except EnvelopeError:
        pass
    assert decoder.buffered <= HEADER_SIZE + MAX


@given(length=st.integers(min_value=MAX + 1, max_value=2**32 - 1))
def test_huge_declared_length_rejected_at_the_header(length: int) -> None:
    decoder = EnvelopeDecoder(MAX)
    with pytest.raises(EnvelopeError, match="exceeds the limit"):
        # Only the 5 header bytes arrive: the lie is caught before any body is buffered.
        decoder.feed(struct.pack(">BI", 0, length))
    assert decoder.buffered == 0


@given(payload=st.binary(min_size=1, max_size=MAX), keep=st.integers(min_value=0, max_value=MAX + 4))
def test_truncated_envelope_waits_and_reports_partial(payload: bytes, keep: int) -> None:
    data = encode_envelope(payload)
    keep = min(keep, len(data) - 1)
    decoder = EnvelopeDecoder(MAX)
    assert decoder.feed(data[:keep]) == []
    assert decoder.in_envelope == (keep > 0)
    assert decoder.feed(data[keep:]) == [(0, payload)]
    assert not decoder.in_envelope


def test_unknown_and_compressed_flags_rejected() -> None:
    with pytest.raises(EnvelopeError, match="unknown envelope flags"):
        EnvelopeDecoder(MAX).feed(struct.pack(">BI", 0x80, 1) + b"x")
    with pytest.raises(EnvelopeError, match="compressed"):
        EnvelopeDecoder(MAX).feed(struct.pack(">BI", 0x01, 1) + b"x")


def test_exact_limit_accepted() -> None:
    payload = b"a" * MAX
    assert EnvelopeDecoder(MAX).feed(encode_envelope(payload)) == [(0, payload)]


def test_zero_length_envelope() -> None:
    assert EnvelopeDecoder(MAX).feed(encode_envelope(b"", FLAG_END_STREAM)) == [(FLAG_END_STREAM, b"")]
