"""JSON answers of the public port's routes: `{"error": {"message", "type", "code"}}` for every
refusal, the shape the JSON API, the admin pages and the log streams share (OpenAI's error shape,
which the gateway's /v1 answers use too: server/gateway/openai_api.py).

Here rather than in api.py, the routes' table, so that the modules the table routes to (logs.py,
logfollow.py, admin/) answer without importing the table that imports them (issue 42's circle).
"""

from __future__ import annotations

import msgspec

from llmgw.catalog.units import enc_hook
from llmgw.web.server import Responder

# Durations and sizes as plain numbers, as the API documents them.
json_encoder = msgspec.json.Encoder(enc_hook=enc_hook)
JSON = (b"content-type", b"application/json")


async def send_json(responder: Responder, status: int, body: object,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await responder.respond(status, [JSON, *(headers or [])], json_encoder.encode(body))


async def send_error(responder: Responder, status: int, message: str, code: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(responder, status, {"error": {"message": message, "type": code, "code": code}}, headers)
