"""Config errors name the file, the YAML path and the line; unknown keys are errors."""

from __future__ import annotations

import textwrap

import pytest

from llmgw.catalog import AgentConfig, ConfigError, ServerConfig, override, parse_config
from llmgw.catalog.units import parse_duration, parse_size

SERVER = textwrap.dedent(
    """\
    listen: 127.0.0.1:8080
    fleet_listen: 0.0.0.0:8443
    fleet:
      heartbeat_interval: 5s
      lost_after: 2m
    models:
      - name: llama-3-8b
        replicas: 2
        profiles:
          - name: h100
            engine: vllm
            gpus: 1
          - name: a100-tp2
            engine: vllm
            gpus: 2
            args: ["--max-model-len", "8192"]
    """
)


def error_of(text: str, kind: type = ServerConfig, name: str = "server.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, kind, name)
    return str(info.value)


def test_valid_config_parses() -> None:
    cfg = parse_config(SERVER, ServerConfig, "server.yaml")
    assert cfg.fleet.heartbeat_interval == 5.0
    assert cfg.fleet.lost_after == 120.0
    assert [p.gpus for p in cfg.models[0].profiles] == [1, 2]
    assert cfg.models[0].profiles[1].args == ["--max-model-len", "8192"]


def test_wrong_type_names_file_line_and_path() -> None:
    text = SERVER.replace("gpus: 2", 'gpus: "two"')
    assert error_of(text) == 'server.yaml:15 models[0].profiles[1].gpus: expected int, got "two"'


def test_unknown_key_is_an_error_with_a_suggestion() -> None:
    text = SERVER.replace("lost_after: 2m", "lost_afer: 2m")
    assert error_of(text) == "server.yaml:5 fleet.lost_afer: unknown key (did you mean 'lost_after'?)"


def test_unknown_top_level_key() -> None:
    assert error_of("listen: x:1\nmodle: []\n").startswith("server.yaml:2 modle: unknown key")


def test_missing_required_key() -> None:
    assert error_of("models:\n  - replicas: 1\n") == "server.yaml:2 models[0]: missing required key 'name'"


def test_bad_enum_lists_choices() -> None:
    text = SERVER.replace("engine: vllm\n        gpus: 1", "engine: vlm\n        gpus: 1")
    assert error_of(text) == (
        'server.yaml:11 models[0].profiles[0].engine: expected one of command, sglang, sim, vllm, got "vlm"')


def test_negative_count_rejected() -> None:
    assert error_of(SERVER.replace("replicas: 2", "replicas: -1")) == (
        "server.yaml:8 models[0].replicas: expected int >= 0, got -1")


def test_expect_nodes_must_be_node_ids() -> None:
    assert parse_config("reconcile:\n  expect_nodes: [gpu-01, gpu-02]\n", ServerConfig,
                        "s.yaml").reconcile.expect_nodes == ["gpu-01", "gpu-02"]
    assert error_of("reconcile:\n  expect_nodes: [gpu-01, 'a b']\n").startswith(
        "server.yaml:1 reconcile: expect_nodes[1]: invalid node id 'a b'")


def test_placement_spread_choices_and_cooldown() -> None:
    cfg = parse_config("placement:\n  spread: leaves\n  spread_cooldown: 30s\n", ServerConfig, "s.yaml")
    assert (cfg.placement.spread, cfg.placement.spread_cooldown) == ("leaves", 30.0)
    default = parse_config("", ServerConfig, "s.yaml").placement
    assert (default.spread, default.spread_cooldown) == ("nodes", 300.0)  # the defaults: nodes, 5 min
    assert error_of("placement:\n  spread: node\n") == (
        'server.yaml:2 placement.spread: expected one of leaves, nodes, off, got "node"')
    # YAML's false
    assert parse_config("placement:\n  spread: off\n", ServerConfig, "s.yaml").placement.spread_mode == "off"
    assert error_of("placement:\n  spread: true\n").startswith("server.yaml:1 placement: spread: true is not a mode")
    assert error_of("placement:\n  spread_cooldown: soon\n").startswith("server.yaml:2 placement.spread_cooldown:")


def test_bad_duration() -> None:
    assert error_of(SERVER.replace("5s", "soon")) == (
        'server.yaml:4 fleet.heartbeat_interval: expected a duration like 30s, 2m or 1h30m, got "soon"')


def test_yaml_syntax_error_has_line() -> None:
    assert error_of("listen: x\nmodels: [\n").startswith("server.yaml:3: invalid YAML")


def test_top_level_must_be_mapping() -> None:
    assert "expected a mapping" in error_of("- a\n- b\n")


def test_duplicate_model_names() -> None:
    text = SERVER + "  - name: llama-3-8b\n"
    assert "duplicate model name 'llama-3-8b'" in error_of(text)


def test_agent_config_and_fabrics() -> None:
    cfg = parse_config(
        "server: https://ctrl:8443\nnode_id: gpu-01\nfabrics:\n  - name: ib-a\n    devices: [mlx5_0]\n",
        AgentConfig,
        "agent.yaml",
    )
    assert cfg.node_id == "gpu-01" and cfg.fabrics[0].devices == ["mlx5_0"]
    assert error_of("fabrics:\n  - name: x\n    kind: token-ring\n", AgentConfig, "agent.yaml").startswith(
        "agent.yaml:3 fabrics[0].kind: expected one of"
    )


def test_empty_file_gives_defaults() -> None:
    assert parse_config("", ServerConfig, "s.yaml") == ServerConfig()


def test_override_wins_and_is_validated() -> None:
    cfg = parse_config(SERVER, ServerConfig, "server.yaml")
    assert override(cfg, {"listen": "0.0.0.0:9000", "state_dir": None}).listen == "0.0.0.0:9000"
    assert override(cfg, {}).listen == "127.0.0.1:8080"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("2m", 120), ("1h30m", 5400), ("250ms", 0.25), (5, 5), ("1.5", 1.5), ("1d", 86400)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(("text", "size"), [("4MiB", 4 << 20), ("512k", 512_000), (1024, 1024), ("1GiB", 1 << 30)])
def test_sizes(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "5x", "-1s", True, "m"])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_duplicate_keys_are_errors() -> None:
    text = "fleet:\n  lost_after: 2m\n  heartbeat_interval: 5s\n  lost_after: 3m\n"
    assert error_of(text) == (
        "server.yaml:4 fleet.lost_after: duplicate key (first at line 2); YAML would silently keep the last one")


@pytest.mark.parametrize("text, line", [
    ("models: " + "[" * 50_000 + "]" * 50_000 + "\n", 1),  # flow lists: one line
    ("a:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(3000)), 64),  # block mappings: the line of level 65
])
def test_deep_nesting_is_one_config_error_not_a_recursion_error(text: str, line: int) -> None:
    with pytest.raises(ConfigError, match=rf"^s\.yaml:{line}: YAML nested deeper than 64 levels"):
        parse_config(text, ServerConfig, "s.yaml")


def test_nesting_up_to_the_limit_is_read_as_yaml() -> None:
    with pytest.raises(ConfigError, match=r"models\[0\]: expected mapping, got a list"):
        parse_config("models: " + "[" * 63 + "]" * 63 + "\n", ServerConfig, "s.yaml")


def test_since_is_a_duration_back_seconds_back_or_an_epoch_time():
    from llmgw.catalog.units import parse_since

    now = 1_800_000_000.0
    assert parse_since("2h", now) == now - 7200
    assert parse_since("90", now) == now - 90
    assert parse_since("1700000000", now) == 1_700_000_000.0
    with pytest.raises(ValueError, match="expected a duration back from now"):
        parse_since("2x", now)
