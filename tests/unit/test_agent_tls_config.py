"""The agent's TLS settings: a `tls:` section without a CA is one clear error, not a traceback
(client_context was handed None for the CA file; mypy found it)."""

from __future__ import annotations

import pytest

from llmgw.agent.run import agent_ssl_context
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig
from llmgw.errors import UsageError


def test_a_tls_section_without_a_ca_names_the_missing_key() -> None:
    cfg = parse_config("server: https://ctrl:8443\ntls:\n  cert: node.crt\n  key: node.key\n", AgentConfig)
    with pytest.raises(UsageError, match=r"^tls\.ca: "):
        agent_ssl_context(cfg)


def test_no_tls_section_is_no_context() -> None:
    cfg = parse_config("server: http://ctrl:8080\n", AgentConfig)
    assert agent_ssl_context(cfg) == (None, 0.0)
