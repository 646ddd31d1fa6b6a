"""Configuration and the model catalog: schema and loading. Pure: no trio, no sockets."""

from llmgw.catalog.load import (
    ConfigError,
    load_agent_config,
    load_config,
    load_server_config,
    override,
    parse_config,
)
from llmgw.catalog.schema import AgentConfig, Model, Profile, ServerConfig

__all__ = [
    "AgentConfig",
    "ConfigError",
    "Model",
    "Profile",
    "ServerConfig",
    "load_agent_config",
    "load_config",
    "load_server_config",
    "override",
    "parse_config",
]
