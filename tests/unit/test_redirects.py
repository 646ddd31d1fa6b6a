"""The redirect rules of the weights fetch (llmgw.catalog.redirects; issue 40, finding 4), pure:
which hosts and addresses a source may hand the fetcher to. The real path (a redirecting server
on loopback) is tested in test_weights_fetch.py."""

from __future__ import annotations

import pytest

from llmgw.catalog.redirects import (
    address_kind,
    address_problem,
    allowed_host_problem,
    host_problem,
)
from llmgw.catalog.sources import parse_url


def problem(source: str, target: str, allowed: list[str] | None = None) -> str | None:
    return host_problem(parse_url(source), parse_url(target), allowed or [])


@pytest.mark.parametrize(("source", "target"), [
    ("http://mirror.example/m.bin", "http://mirror.example/store/m.bin"),
    ("http://mirror.example/m.bin", "https://mirror.example/m.bin"),  # an upgrade to the default https port
    ("http://Mirror.Example:8080/m.bin", "http://mirror.example.:8080/x/m.bin"),
    ("https://huggingface.co/org/m/resolve/main/model.safetensors", "https://cas-bridge.xethub.hf.co/xet-bridge-us/abc"),
    ("https://huggingface.co/org/m/resolve/main/model.safetensors", "https://cdn-lfs-us-1.hf.co/repos/ab/cd/x"),
    ("https://hf.co/org/m/resolve/main/model.safetensors", "https://cdn-lfs.huggingface.co/repos/x"),
])
def test_the_sources_own_host_and_the_hubs_cdn_are_followed(source: str, target: str) -> None:
    assert problem(source, target) is None


@pytest.mark.parametrize(("source", "target", "why"), [
    ("http://mirror.example/m.bin", "http://169.254.169.254/latest/meta-data/iam",
     "169.254.169.254 is not the source's host"),
    ("http://mirror.example:8080/m.bin", "http://mirror.example:9090/m.bin",
     "mirror.example:9090 is not the source's host"),
    ("http://mirror.example/m.bin", "http://mirror.example.evil/m.bin", "not the source's host"),
    ("http://mirror.example/m.bin", "ftp://mirror.example/m.bin", "scheme 'ftp' is not http or https"),
    ("https://huggingface.co/m/resolve/main/w.bin", "https://hf.co.evil/w.bin", "not the source's host"),
    ("https://mirror.example/m.bin", "https://cdn-lfs.hf.co/w.bin", "nor in the catalog's allow_redirect_hosts"),
])
def test_any_other_host_is_refused_with_the_reason(source: str, target: str, why: str) -> None:
    assert why in (problem(source, target) or "")


def test_the_catalogs_hosts_name_a_host_a_port_or_every_name_under_a_domain() -> None:
    src = "http://mirror.example/m.bin"
    assert problem(src, "https://cdn.example/x", ["cdn.example"]) is None
    assert problem(src, "https://cdn.example:8443/x", ["cdn.example"]) is None  # no port given: any
    assert problem(src, "https://cdn.example:8443/x", ["cdn.example:9000"]) is not None
    assert problem(src, "https://a.b.store.example/x", ["*.store.example"]) is None
    assert problem(src, "https://store.example/x", ["*.store.example"]) is not None  # the domain itself is not under it
    assert problem(src, "http://[fd00::5]:81/x", ["[fd00::5]:81"]) is None
    assert allowed_host_problem("cdn.example") is None and allowed_host_problem("*.hf.co") is None
    for bad in ("https://cdn.example", "cdn.example/path", "user@cdn.example", "*", ""):
        assert "is not a host, host:port or *.domain" in (allowed_host_problem(bad) or ""), bad


@pytest.mark.parametrize(("address", "kind"), [
    ("127.0.0.1", "loopback"), ("127.8.9.1", "loopback"), ("::1", "loopback"), ("0.0.0.0", "loopback"),
    ("::ffff:127.0.0.1", "loopback"), ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"),
    ("100.100.100.200", "metadata"), ("169.254.10.1", "link-local"), ("fe80::1%eth0", "link-local"),
    ("::ffff:169.254.1.1", "link-local"), ("10.0.0.5", None), ("93.184.216.34", None), ("2606:4700::1", None),
])
def test_loopback_link_local_and_metadata_addresses_are_told_apart(address: str, kind: str | None) -> None:
    assert address_kind(address) == kind


def test_an_internal_address_is_reached_only_when_the_source_itself_was_of_that_kind() -> None:
    cdn = parse_url("https://cdn.example/x")
    assert "resolves to 169.254.169.254, a metadata address" in (address_problem(cdn, ["169.254.169.254"],
                                                                                 ["93.184.216.34"]) or "")
    assert "a loopback address" in (address_problem(cdn, ["93.184.216.35", "127.0.0.1"], ["93.184.216.34"]) or "")
    # a loopback source: loopback only
    assert "a link-local address" in (address_problem(cdn, ["fe80::1"], ["127.0.0.1"]) or "")
    assert address_problem(cdn, ["127.0.0.1"], ["127.0.0.1"]) is None  # a mirror on the node itself
    assert address_problem(cdn, ["10.1.2.3"], ["93.184.216.34"]) is None


def test_the_catalog_takes_allow_redirect_hosts_per_model_and_profile_and_refuses_a_url_in_one_line() -> None:
    from llmgw.catalog import ConfigError, ServerConfig, parse_config
    from llmgw.server.reconcile import shard_spec

    cfg = parse_config("models:\n  - {name: m, source: 'https://mirror.example/m.bin', allow_redirect_hosts: "
                       "[cdn.example],"
                       " profiles: [{engine: sim, allow_redirect_hosts: ['*.store.example', cdn.example]}]}\n",
                       ServerConfig, "server.yaml")
    model = cfg.models[0]
    assert shard_spec(model, model.profiles[0], "r", "s", [0], 20000).allow_redirect_hosts == ["cdn.example",
                                                                                               "*.store.example"]
    with pytest.raises(ConfigError) as info:
        parse_config("models:\n  - {name: m, source: 'https://h/m.bin', allow_redirect_hosts: ['https://cdn/']}\n",
                     ServerConfig, "server.yaml")
    text = str(info.value)
    assert text.startswith("server.yaml:2 models[0]") and "'https://cdn/' is not a host" in text and "\n" not in text
