"""What the gateway reads of a request before it forwards the body untouched: the model and the
stream flag, the prefix-affinity key, and the request's id."""

from __future__ import annotations

import itertools
import os
from typing import Any

import msgspec

from llmgw.server.gateway.balance import prompt_prefix

ROUTES = {b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"}


class Peek(msgspec.Struct):
    """The only fields the gateway reads from a request body; the rest is forwarded as is."""

    model: Any = None
    stream: Any = False


peek = msgspec.json.Decoder(Peek).decode
# Everything msgspec's decoder raises on a body it refuses.
JSON_REFUSED: tuple[type[Exception], ...] = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
PREFIX_REFUSED: tuple[type[Exception], ...] = (*JSON_REFUSED, TypeError, AttributeError)  # a body with no usable prompt


def affinity_key(body: bytes) -> str | None:
    try:
        return prompt_prefix(msgspec.json.decode(body))
    except PREFIX_REFUSED:
        return None


# Request ids: 32 hex digits as uuid4().hex had, a random prefix per process (so gateway workers
# and restarts never collide) and a counter; uuid4 was ~2.5 % of the CPU per request (py-spy).
_RID_PREFIX = os.urandom(8).hex().encode()
_rid_counter = itertools.count(1)


def request_id() -> bytes:
    return b"%s%016x" % (_RID_PREFIX, next(_rid_counter))
