"""Fleet protocol: message types and the envelope codec. Pure: no I/O, no trio."""

from llmgw.wire.envelope import (
    DEFAULT_MAX_MESSAGE,
    FLAG_END_STREAM,
    EnvelopeDecoder,
    EnvelopeError,
    encode_envelope,
)
from llmgw.wire.messages import (
    CONNECT_PATH,
    CONTENT_TYPE,
    MessageError,
    Unknown,
    decode_agent_message,
    decode_server_message,
    encode,
    message_type,
)

__all__ = [
    "CONNECT_PATH",
    "CONTENT_TYPE",
    "DEFAULT_MAX_MESSAGE",
    "FLAG_END_STREAM",
    "EnvelopeDecoder",
    "EnvelopeError",
    "MessageError",
    "Unknown",
    "decode_agent_message",
    "decode_server_message",
    "encode",
    "encode_envelope",
    "message_type",
]
