"""The pure half of dynamic completion (llmgw.cli.candidates): which names a TAB offers, what a
cache entry holds and when it is stale. The whole path (the installed command, a real server,
real bash) is tests/e2e/test_completion.py."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.cli import candidates as c

NODES = [{"id": "gpu-01", "fabrics": ["ib", "roce"], "address": "10.0.0.1"}, {"id": "gpu-02", "fabrics": ["ib"]},
         {"id": "gpu-03", "fabrics": ["roce"]}, {"id": "cpu-04", "fabrics": []}]
REPLICAS = [{"id": "big-a", "model": "big", "tail": ["secret output"], "shards": [{"rank": 1}, {"rank": 0}]},
            {"id": "chat-b", "model": "chat", "shards": [{"rank": 0}]}, {"id": "chat-c", "model": "chat", "shards": []}]


def test_reduce_keeps_only_what_completion_uses() -> None:
    assert c.reduce("nodes", NODES)[0] == {"name": "gpu-01", "fabrics": ["ib", "roce"]}  # no address on disk
    assert c.reduce("replicas", REPLICAS)[0] == {"name": "big-a", "model": "big", "ranks": [0, 1]}  # no tail
    assert c.names(c.reduce("models", [{"name": "chat", "source": "x"}, {"name": 3}])) == ["chat"]
    assert c.names(c.reduce("fabrics", [{"id": "0x0c42a1"}, {"name": "no-id"}])) == ["0x0c42a1"]
    assert c.names(c.reduce("gateways", [{"name": "worker-0"}, {"name": "edge-1"}])) == ["worker-0", "edge-1"]
    assert c.reduce("nodes", {"error": {"message": "unauthorized"}}) == []


def test_a_name_a_shell_would_misread_is_never_offered() -> None:
    hostile = [{"id": "ok-1"}, {"id": "two\nlines"}, {"id": "esc\x1b[2J"}, {"id": "a,b"}, {"id": "a b"}, {"id": ""},
               {"id": "x" * 201}, {"id": None}, "not a dict", {"id": "gpu-9", "fabrics": ["ib", "bad\x07", 7]}]
    assert c.reduce("nodes", hostile) == [{"name": "ok-1", "fabrics": []}, {"name": "gpu-9", "fabrics": ["ib"]}]
    assert c.matching(["ok", "bell\x07", "ok", "okay"], "ok") == ["ok", "okay"]  # each once, in order


def test_matching_filters_by_prefix() -> None:
    nodes = c.names(c.reduce("nodes", NODES))
    assert c.matching(nodes, "gpu-0") == ["gpu-01", "gpu-02", "gpu-03"]
    assert c.matching(nodes, "") == nodes
    assert c.matching(nodes, "gpu-02") == ["gpu-02"] and c.matching(nodes, "zz") == []


def test_fabric_test_b_shares_a_fabric_with_a() -> None:
    nodes = c.reduce("nodes", NODES)
    assert c.fabric_peers(nodes, "gpu-01") == ["gpu-02", "gpu-03"]
    assert c.fabric_peers(nodes, "gpu-02") == ["gpu-01"]
    assert c.fabric_peers(nodes, "cpu-04") == [] and c.fabric_peers(nodes, "unknown") == []
    assert c.fabric_peers(nodes, None) == ["gpu-01", "gpu-02", "gpu-03"]  # A: a node with a peer


def test_ranks_of_the_typed_replica() -> None:
    replicas = c.reduce("replicas", REPLICAS)
    assert c.ranks(replicas, "big-a") == ["0", "1"]
    assert c.ranks(replicas, "chat-b") == ["0"] and c.ranks(replicas, "chat-c") == []
    assert c.ranks(replicas, None) == ["0", "1"]


def test_cache_key_separates_servers_and_credentials_and_hides_the_token() -> None:
    key = c.cache_key("http://h:1", "/api/v1/nodes", token="s3cret", cert=None, key=None, ca=None)
    assert "s3cret" not in key and len(key) == 32
    assert key == c.cache_key("http://h:1/", "/api/v1/nodes", token="s3cret", cert=None, key=None, ca=None)
    others = [
        c.cache_key("http://h:2", "/api/v1/nodes", token="s3cret", cert=None, key=None, ca=None),
        c.cache_key("http://h:1", "/api/v1/models", token="s3cret", cert=None, key=None, ca=None),
        c.cache_key("http://h:1", "/api/v1/nodes", token="other", cert=None, key=None, ca=None),
        c.cache_key("http://h:1", "/api/v1/nodes", token=None, cert="op.crt", key="op.key", ca=None),
    ]
    assert len({key, *others}) == 5


def test_a_cache_entry_is_fresh_for_ttl_seconds_only() -> None:
    records = c.reduce("nodes", NODES)
    entry = c.encode(records, 1000.0)
    assert c.decode(entry, 1000.0) == (True, records)
    assert c.decode(entry, 1000.0 + c.TTL - 0.01) == (True, records)
    assert c.decode(entry, 1000.0 + c.TTL)[0] is False
    assert c.decode(entry, 999.0)[0] is False  # written "in the future": the clock stepped back
    assert c.decode(c.encode(None, 1000.0), 1001.0) == (True, None)  # a failure is kept too: one timeout per TTL
    for broken in (b"", b"{", b"[]", b'{"at": "x", "records": []}', b'{"at": 1000, "records": 5}'):
        assert c.decode(broken, 1000.0)[0] is False
    tampered = json.dumps({"at": 1000.0, "records": [{"name": "a\nb"}, {"name": "ok"}, 3]}).encode()
    assert c.decode(tampered, 1000.0) == (True, [{"name": "ok"}])


def test_a_credential_goes_in_cleartext_only_to_loopback_or_with_insecure() -> None:
    assert c.may_ask("http", "127.0.0.1", credential=True, insecure=False)
    assert c.may_ask("http", "localhost", credential=True, insecure=False)
    assert c.may_ask("http", "::1", credential=True, insecure=False)
    assert not c.may_ask("http", "10.0.0.5", credential=True, insecure=False)
    assert c.may_ask("http", "10.0.0.5", credential=True, insecure=True)
    assert c.may_ask("http", "10.0.0.5", credential=False, insecure=False)
    assert c.may_ask("https", "ctrl.example.com", credential=True, insecure=False)
    assert not c.may_ask("ftp", "127.0.0.1", credential=False, insecure=False)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
                        ["id", "name", "fabrics", "shards", "rank", "model", "x"]), inner, max_size=4), max_leaves=20)


@given(JSON, st.text(max_size=4))
def test_arbitrary_answers_never_raise(body: Any, typed: str) -> None:
    for kind in c.PATHS:
        records = c.reduce(kind, body)
        assert all(c.safe(n) for n in c.matching(c.names(records), typed))
        assert c.decode(c.encode(records, 5.0), 5.0) == (True, records)
    c.fabric_peers(c.reduce("nodes", body), typed or None)
    c.ranks(c.reduce("replicas", body), typed or None)


@given(st.binary(max_size=64))
def test_arbitrary_cache_bytes_never_raise(data: bytes) -> None:
    c.decode(data, 0.0)


def test_a_tab_loads_no_http_stack_before_it_asks() -> None:
    """The CLI with its completion callbacks imports neither httpx, cryptography, trio nor even
    http.client and ssl (those load at the first TAB that asks): a TAB's cost is mostly start-up."""
    import subprocess
    import sys

    check = ("import sys, llmgw.cli.main, llmgw.cli.complete; "
             "print(','.join(m for m in ('httpx', 'cryptography', 'trio', 'http.client', 'ssl') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "", (result.stdout, result.stderr)
