"""The OpenAI API's own shapes the gateway answers with: its error object, and `GET /v1/models`
and `GET /v1/models/{id}` (what the clients' `models.list()` and `models.retrieve()` read).
Pure: names in, status and body out.

A model is listed, and retrieved, while it has a replica in rotation: `retrieve(x)` answers
exactly when `x` is in `list()`, so a client that checks before it calls is told the truth.
The id arrives percent-encoded (openai-python 3.x `path_template` quotes `/` as `%2F`), or raw
with its slashes (older clients, curl): both name the same model.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

import msgspec

PATH = b"/v1/models"
_ITEM = PATH + b"/"
_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")  # urllib.parse.unquote, without the urllib import the purity rule refuses


def openai_error(message: str, kind: str, code: str | int | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": None, "code": code}})


def is_models_path(path: bytes) -> bool:
    return path == PATH or path.startswith(_ITEM)


def _model(name: str, created: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": created, "owned_by": "llmgw"}


def models_answer(path: bytes, ready: Sequence[str], known: Collection[str], created: int) -> tuple[int, bytes]:
    """(status, body) for a GET of `path`; `ready`: models in rotation, `known`: every routed model."""
    if path == PATH:
        return 200, msgspec.json.encode({"object": "list", "data": [_model(name, created) for name in ready]})
    name = _ESCAPE.sub(lambda m: bytes((int(m[1], 16),)), path[len(_ITEM):]).decode("utf-8", "replace")
    if name in ready:
        return 200, msgspec.json.encode(_model(name, created))
    if name in known:
        why = f"The model `{name}` has no ready replica right now (GET /v1/models lists the ones that do)"
    else:
        why = f"The model `{name}` does not exist (known: {', '.join(sorted(known)) or 'none'})"
    return 404, openai_error(why, "invalid_request_error", "model_not_found")
