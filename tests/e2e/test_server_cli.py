"""`llmgw server` and `llmgw ctl` as an operator meets them: clear one-line errors, exit codes."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.e2e.harness import free_port, run_llmgw


def test_bad_config_is_one_line_with_file_line_and_path(tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text("listen: 127.0.0.1:0\nmodels:\n  - name: m\n    profiles:\n      - gpus: two\n")
    result = run_llmgw("server", "--config", str(cfg), "--insecure")
    assert result.returncode == 2
    assert result.stderr.strip() == f'llmgw: error: {cfg}:5 models[0].profiles[0].gpus: expected int, got "two"'
    assert "Traceback" not in result.stderr


def test_unknown_key_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text("fleet:\n  heartbeat: 5s\n")
    result = run_llmgw("server", "--config", str(cfg), "--insecure")
    assert result.returncode == 2
    assert "server.yaml:2 fleet.heartbeat: unknown key" in result.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    result = run_llmgw("server", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "no such config file" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_fleet_port_without_tls_needs_insecure() -> None:
    result = run_llmgw("server", "--listen", f"127.0.0.1:{free_port()}", "--fleet-listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert "the fleet port needs TLS" in result.stderr and "--insecure" in result.stderr


def test_port_in_use_is_one_clear_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = run_llmgw("server", "--insecure", "--listen", f"127.0.0.1:{port}",
                           "--fleet-listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} for the public port" in result.stderr
    assert "--listen" in result.stderr and "Traceback" not in result.stderr


def test_debug_shows_traceback(tmp_path: Path) -> None:
    result = run_llmgw("--debug", "server", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_ctl_unreachable_server_exit_3() -> None:
    result = run_llmgw("ctl", "--server", f"http://127.0.0.1:{free_port()}", "nodes")
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the llmgw server" in lines[0]


def test_ctl_server_from_environment() -> None:
    port = free_port()
    result = run_llmgw("ctl", "nodes", "-o", "json", env={"LLMGW_SERVER": f"http://127.0.0.1:{port}"})
    assert result.returncode == 3 and f"127.0.0.1:{port}" in result.stderr


def test_help_lists_commands() -> None:
    result = run_llmgw("--help")
    assert result.returncode == 0
    for name in ("server", "agent", "ctl", "sim", "demo"):
        assert name in result.stdout


def test_missing_tls_files_are_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(f"tls:\n  cert: {tmp_path}/nope.crt\n  key: {tmp_path}/nope.key\n  ca: {tmp_path}/ca.crt\n")
    result = run_llmgw("server", "--config", str(cfg), "--listen", f"127.0.0.1:{free_port()}",
                       "--fleet-listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.crt" in lines[0] and "does not exist" in lines[0], result.stderr
    # The public port's files: the line names the config key as well as the file.
    cfg.write_text(f"public_tls:\n  cert: {tmp_path}/pub.crt\n  key: {tmp_path}/pub.key\n")
    result = run_llmgw("server", "--config", str(cfg), "--insecure", "--listen", f"127.0.0.1:{free_port()}",
                       "--fleet-listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "public_tls: " in lines[0] and "pub.crt does not exist" in lines[0], result.stderr
    agent_cfg = tmp_path / "agent.yaml"
    agent_cfg.write_text(f"server: https://127.0.0.1:1\ntls:\n  cert: {tmp_path}/n.crt\n  key: {tmp_path}/n.key\n  ca: "
                         f"{tmp_path}/ca.crt\n")
    result = run_llmgw("agent", "--config", str(agent_cfg))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "does not exist" in result.stderr
