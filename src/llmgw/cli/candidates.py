"""Which names a TAB offers: the pure half of dynamic shell completion (`llmgw.cli.complete`
does the asking and the caching).

An API answer is cut down to the few fields completion needs (`reduce`), which is also all
that reaches the cache file: a replica's output tail or a node's address never lands on disk.
Every name is checked before a shell sees it (`safe`): a hostile or broken server could send
a newline (a second, forged candidate in click's line protocol), a comma (fish splits the
type from the value on every one) or an escape sequence, and a completion must never paint
the operator's terminal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from llmgw.netaddr import is_loopback

TTL = 5.0  # seconds an answer is reused: a burst of TABs (bash asks again on the second TAB) asks once
# Seconds for the whole exchange, connect to last byte. The issue allows 1 s for the TAB, and the
# process itself takes 0.15 s to start idle, 0.4-0.7 s on a loaded 2-core machine (measured).
# Connect, TLS handshake and GET are three round trips: 0.5 s leaves a server 100 ms away room.
TIMEOUT = 0.5
MAX_BODY = 4 << 20  # bytes read of an answer at most, all parsed at once: what a hostile server can make a TAB hold
MAX_NAME = 200  # characters: longer is no name anyone types
MAX_CANDIDATES = 2000  # offered at once (bash asks before it shows more than 100: completion-query-items)

# What each kind of name is asked of: one read-only GET, answered to a viewer credential.
PATHS = {
    "nodes": "/api/v1/nodes",
    "replicas": "/api/v1/replicas",
    "models": "/api/v1/models",
    "fabrics": "/api/v1/fabrics",
    "gateways": "/api/v1/gateways",
}


def safe(name: object) -> bool:
    """A name a shell may show and insert as is: printable, no space, no comma, not empty."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME and name.isprintable()
            and not any(c.isspace() or c == "," for c in name))


def _strings(values: Any) -> list[str]:
    return [v for v in values if safe(v)] if isinstance(values, list) else []


def reduce(kind: str, body: Any) -> list[dict[str, Any]]:
    """The fields completion uses from an answer of PATHS[kind]; anything malformed is left out."""
    if not isinstance(body, list):
        return []
    out: list[dict[str, Any]] = []
    for item in body:
        if not isinstance(item, dict):
            continue
        if kind == "nodes" and safe(item.get("id")):
            out.append({"name": item["id"], "fabrics": _strings(item.get("fabrics"))})
        elif kind == "replicas" and safe(item.get("id")):
            shards = item["shards"] if isinstance(item.get("shards"), list) else []
            ranks = sorted({s["rank"] for s in shards if isinstance(s, dict) and type(s.get("rank")) is int})
            out.append({"name": item["id"], "model": item.get("model") if safe(item.get("model")) else "",
                        "ranks": ranks})
        elif kind in ("models", "gateways") and safe(item.get("name")):
            out.append({"name": item["name"]})
        elif kind == "fabrics" and safe(item.get("id")):
            out.append({"name": item["id"]})
    return out[:MAX_CANDIDATES]


def names(records: Iterable[dict[str, Any]]) -> list[str]:
    return [r["name"] for r in records]


def fabric_peers(nodes: list[dict[str, Any]], a: str | None) -> list[str]:
    """`fabric-test A B`: for B, the other nodes that share a usable fabric with A (a rail needs
    one, fabric by fabric name, as the server pairs them); for A, every node that has such a peer."""
    fabrics = {r["name"]: set(r["fabrics"]) for r in nodes}
    if a is None:
        return [n for n, f in fabrics.items() if any(f & g for m, g in fabrics.items() if m != n)]
    mine = fabrics.get(a, set())
    return [n for n, f in fabrics.items() if n != a and mine & f]


def log_targets(replicas: list[dict[str, Any]]) -> list[str]:
    """`logs NAME`: each model that has replicas, followed by its replicas' ids."""
    out: list[str] = []
    for model in dict.fromkeys(r["model"] for r in replicas if r["model"]):
        out += [model, *(r["name"] for r in replicas if r["model"] == model)]
    return out + [r["name"] for r in replicas if not r["model"]]


def ranks(replicas: list[dict[str, Any]], replica: str | None) -> list[str]:
    """`logs NAME --rank RANK`: the ranks of NAME's shards (a replica's, or a model's replicas');
    of every replica when it is not typed yet."""
    chosen = [r for r in replicas if replica is None or replica in (r["name"], r["model"])]
    return [str(n) for n in sorted({rank for r in chosen for rank in r["ranks"]})]


def matching(candidates: Iterable[str], incomplete: str) -> list[str]:
    """The safe candidates that start with what is typed, each once, in the order given."""
    seen: dict[str, None] = {}
    for c in candidates:
        if safe(c) and c.startswith(incomplete):
            seen.setdefault(c)
    return list(seen)[:MAX_CANDIDATES]


def cache_key(server: str, path: str, *, token: str | None, cert: str | None, key: str | None, ca: str | None) -> str:
    """The cache file's name: one per server URL, credential and question. The token is hashed
    into it, never stored: another token (another operator, a viewer) never sees this one's answer,
    and a wrong token's empty answer is not kept for the right one."""
    material = json.dumps([server.rstrip("/"), path, token or "", cert or "", key or "", ca or ""])
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def encode(records: list[dict[str, Any]] | None, now: float) -> bytes:
    """A cache entry: the reduced answer, or None for "asked and got nothing" (kept as long, so a
    hung server costs one timeout per TTL, not one per TAB)."""
    return json.dumps({"at": now, "records": records}).encode()


def decode(data: bytes, now: float, ttl: float = TTL) -> tuple[bool, list[dict[str, Any]] | None]:
    """(fresh, records) of a cache entry; stale when older than ttl, from the future (the clock
    stepped back), or not one of ours."""
    try:
        entry = json.loads(data)
        at = float(entry["at"])
        records = entry["records"]
    except (ValueError, TypeError, KeyError):
        return False, None
    if not (0 <= now - at < ttl) or not (records is None or isinstance(records, list)):
        return False, None
    return True, None if records is None else [r for r in records if isinstance(r, dict) and safe(r.get("name"))]


def may_ask(scheme: str, host: str, *, credential: bool, insecure: bool) -> bool:
    """Whether a TAB may send the credential: never in cleartext to another machine without
    --insecure (the command itself refuses it; a completion must not send it either)."""
    if scheme not in ("http", "https"):
        return False
    return scheme == "https" or not credential or insecure or is_loopback(host)
